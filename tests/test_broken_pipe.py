"""A reader that closes the app's output early (``| head``) never stops the run: it trains to
its last step, saves ``final.ckpt`` and exits 0.

Before, the first write after the reader left raised ``BrokenPipeError``, which Rich's console
turns into ``SystemExit(1)``: rc 1, no checkpoint, no message (one process and two ranks alike).
Broken variant caught (seen failing): ``guard_streams()`` not called by ``cli.hydra_app``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_3d.app.streams import NOTICE, ClosedPipeSafe
from tools.harness.apps import app_env

REPO = Path(__file__).resolve().parents[1]
STEPS = 12
ARGS = [
    "model=gpt_tiny",
    f"trainer.max_steps={STEPS}",
    "data.max_bytes=100000",
    "trainer.limit_val_batches=0",
    "data.batch_size=4",
]


@pytest.mark.parametrize(
    "devices, both", [(1, False), (2, True)], ids=["one_process_stdout", "two_ranks_2>&1"]
)
def test_a_reader_that_closes_early_does_not_stop_the_run(tmp_path, devices, both):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "examples/train.py"),
            *ARGS,
            f"trainer.devices={devices}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=app_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if both else (tmp_path / "stderr.txt").open("w"),
        text=True,
    )
    for _ in range(3):  # what head -3 reads, then it exits
        proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=300) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["losses"]) == STEPS and (run_dir / "final.ckpt").exists()
    if not both:  # stderr still open: it says what happened, once
        told = (tmp_path / "stderr.txt").read_text()
        assert told.count(NOTICE.format(name="stdout")) == 1 and "Traceback" not in told, told


def test_the_wrapper_drops_writes_after_the_pipe_closed(tmp_path):
    class Closing:
        def __init__(self):
            self.lines = []

        def write(self, text):
            if self.lines:
                raise BrokenPipeError(32, "Broken pipe")
            self.lines.append(text)
            return len(text)

        def flush(self):
            pass

        def fileno(self):
            raise ValueError("no descriptor")

    told = []
    out = ClosedPipeSafe(Closing(), "stdout")
    out.partner = ClosedPipeSafe(
        type("Sink", (), {"write": lambda self, t: told.append(t), "flush": lambda self: None})(),
        "stderr",
    )
    assert out.write("a\n") == 2 and out.write("b\n") == 2 and out.write("c\n") == 2
    assert out.closed_by_reader and told == [NOTICE.format(name="stdout")]
    out.flush()
