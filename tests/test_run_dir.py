"""A run directory belongs to one run at a time, and an earlier run in it is not overwritten
(``lightning_3d/app/run_dir.py``); resuming a finished run is refused (``resume.check_steps_left``).

Before: a fresh run and a ``resume=last`` given the same ``hydra.run.dir`` at once both exited 0,
one ``summary.json`` survived and the earlier run's ``last.ckpt`` and ``final.ckpt`` were
overwritten; resuming a finished run trained nothing and exited 0. Broken variants caught (seen
failing): ``app.run`` without ``hold`` (both concurrent runs exit 0), ``acquire`` not checking
that the holder is alive (a stale lock refused), ``check_steps_left`` not called.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_3d.app.run_dir import LOCK, RunDirInUse, hold
from lightning_3d.checkpoint.resume import check_steps_left
from tools.harness.apps import start_app, wait_all

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "model=gpt_tiny",
    "trainer.devices=1",
    "trainer.max_steps=3",
    "data.max_bytes=100000",
    "trainer.limit_val_batches=0",
    "data.batch_size=4",
]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_two_runs_given_one_directory_at_once_one_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    procs = {
        name: start_app(REPO / "examples/train.py", [*TINY, f"hydra.run.dir={run_dir}"], tmp_path)
        for name in ("a", "b")
    }
    done = wait_all(procs, timeout=300)
    codes = sorted(p.returncode for p in done.values())
    assert codes == [0, 2], {n: (p.returncode, p.stderr[-2000:]) for n, p in done.items()}
    refused = next(p for p in done.values() if p.returncode == 2)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(run_dir) in errors[0] and "Traceback" not in refused.stderr, (
        refused.stderr
    )
    assert "in use by another run" in errors[0] or "holds an earlier run" in errors[0]
    assert len(json.loads((run_dir / "summary.json").read_text())["losses"]) == 3
    assert not (run_dir / LOCK).exists()  # released at the end


def test_an_earlier_run_is_kept_unless_resumed_or_overwritten(tmp_path):
    (tmp_path / "final.ckpt").write_bytes(b"earlier")
    with pytest.raises(RunDirInUse, match=r"holds an earlier run \(final.ckpt\).*overwrite=true"):
        with hold(tmp_path):
            pass
    with hold(tmp_path, resuming=True):
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    with hold(tmp_path, overwrite=True):
        pass
    assert (tmp_path / "final.ckpt").read_bytes() == b"earlier" and not (tmp_path / LOCK).exists()


def test_a_live_holder_is_refused_and_a_dead_ones_lock_taken_over(tmp_path, capsys):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK).write_text(
            json.dumps({"pid": live.pid, "host": socket.gethostname(), "since": "then"})
        )
        with pytest.raises(
            RunDirInUse, match=f"in use by another run \\(pid {live.pid}, since then\\)"
        ):
            with hold(tmp_path):
                pass
    finally:
        live.kill()
        live.wait()
    dead = _dead_pid()
    (tmp_path / LOCK).write_text(
        json.dumps({"pid": dead, "host": socket.gethostname(), "since": "then"})
    )
    stale_save = tmp_path / f".last.ckpt.tmp-{dead}"
    stale_save.mkdir()  # the shards of a save killed part-way
    with hold(tmp_path):
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert (
        f"took over the lock of pid {dead}, which is no longer running" in capsys.readouterr().err
    )
    assert not stale_save.exists() and not (tmp_path / LOCK).exists()
    (tmp_path / LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": "then"}))
    # Cannot tell: refused, the lock named.
    with pytest.raises(RunDirInUse, match="pid 1 on host elsewhere"):
        with hold(tmp_path):
            pass


def test_resuming_a_finished_run_is_refused_unless_max_steps_was_raised(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "global_step": 3}, path)
    with pytest.raises(ValueError, match=r"holds weights only .*finetune.pretrained=PATH"):
        check_steps_left(path, 4)  # a weights-only checkpoint: nothing to resume
    torch.save(
        {
            "state_dict": {"w": torch.zeros(2)},
            "global_step": 3,
            "loops": {},
            "optimizer_states": [],
        },
        path,
    )
    with pytest.raises(
        ValueError, match=r"that run is finished \(global step 3, trainer.max_steps=3\)"
    ):
        check_steps_left(path, 3)
    check_steps_left(path, 4)
    check_steps_left(path, -1)  # the epochs decide


def test_the_app_refuses_to_resume_a_finished_run_before_launch(tmp_path):
    from hydra.utils import instantiate

    from lightning_3d.app.run import validate
    from tools.harness.apps import compose_config

    cfg = compose_config("train", "model=gpt_tiny", "trainer.max_steps=3")
    path = tmp_path / "last.ckpt"
    torch.save(
        {
            "state_dict": instantiate(cfg.model).state_dict(),
            "global_step": 3,
            "loops": {},
            "optimizer_states": [],
        },
        path,
    )
    with pytest.raises(ValueError, match="that run is finished"):
        validate(compose_config("train", "model=gpt_tiny", "trainer.max_steps=3", f"resume={path}"))
    validate(compose_config("train", "model=gpt_tiny", "trainer.max_steps=4", f"resume={path}"))


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_sharded_checkpoint_without_a_whole_meta_file_is_refused_before_launch(tmp_path, damage):
    """Each rank used to fail on it with ``OSError: Invalid argument``; now one line from the launcher."""
    from lightning_3d.checkpoint import sharded_files

    directory = tmp_path / "last.ckpt"
    directory.mkdir()
    (directory / ".metadata").write_bytes(b"")  # enough to be taken for a sharded checkpoint
    if damage == "truncated":
        torch.save(
            {"format": "lightning_3d.sharded/1", "global_step": 3, "loops": {}},
            directory / sharded_files.META_FILE,
        )
        data = (directory / sharded_files.META_FILE).read_bytes()
        (directory / sharded_files.META_FILE).write_bytes(data[: len(data) // 2])
    match = (
        "no meta.pt" if damage == "missing" else "meta.pt: corrupted or truncated checkpoint file"
    )
    with pytest.raises(ValueError, match=f"resume={directory}: .*{match}"):
        check_steps_left(directory, 5)
