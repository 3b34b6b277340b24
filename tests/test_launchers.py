"""End-to-end ``Trainer(strategy="3d...")`` in a user's script, under the launchers users use.

The same script runs under Lightning's own launcher (``python script.py``: Lightning re-runs the
script for rank 1) and under ``torchrun``; both must train and agree with each other.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

import lightning_3d.app.launch
from lightning_3d.app.launch import launch_job, rank_command

SCRIPT = r"""
import json, sys
import lightning as L
import lightning_3d
from lightning_3d.data import TextDataModule
from lightning_3d.models import LitGPT


class SyncLogging(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        # sync_dist=True must average over ranks: (0 + 1) / 2 on every rank
        module.log("rank_mean", float(trainer.global_rank), sync_dist=True)


L.seed_everything(7, verbose=False)
model = LitGPT(block_size=32, n_layer=2, n_head=4, n_embd=32, warmup_steps=1, max_steps=4)
data = TextDataModule(block_size=32, batch_size=8, max_bytes=300_000)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=sys.argv[2], max_steps=4, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                    num_sanity_val_steps=0, callbacks=[SyncLogging()])
trainer.fit(model, data)
result = {k: float(v) for k, v in trainer.callback_metrics.items()}
result["dp_size"] = trainer.strategy.dp_size
result["zero_stage"] = trainer.strategy.layout.zero_stage
with open(f"{sys.argv[1]}/rank{trainer.global_rank}.json", "w") as f:
    json.dump(result, f)
"""


def _run(command, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "user_script.py"
    path.write_text(SCRIPT)
    return path


def test_lightning_launcher_and_torchrun_train_the_same(script, tmp_path):
    lightning_run = _run([sys.executable, str(script), str(tmp_path), "3d_zero2"], tmp_path)
    for rank in lightning_run:
        assert rank["dp_size"] == 2 and rank["zero_stage"] == 2
        assert rank["rank_mean"] == pytest.approx(0.5)
    # every rank logs the global batch's token mean (parallel/objective.py)
    assert lightning_run[0]["train_loss"] == pytest.approx(lightning_run[1]["train_loss"])

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    torchrun_run = _run([*torchrun, str(script), str(tmp_path), "3d_zero2"], tmp_path)
    for a, b in zip(lightning_run, torchrun_run):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-6)
        assert b["rank_mean"] == pytest.approx(0.5)


RANK_SCRIPT = r"""
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env://, as Lightning does it
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.txt"), "w") as f:
    f.write(f"{t.item()} {os.environ['MASTER_PORT']}")
# Exiting with the group alive can abort in gloo's teardown ("terminate called without an
# active exception", seen once in CI): close it first.
dist.destroy_process_group()
"""


def test_launch_job_forms_its_world_when_the_picked_port_is_taken(tmp_path, monkeypatch):
    """The app's launcher hosts the rendezvous store on a port the OS assigned and keeps, so a port
    that another program took after a launcher picked it cannot stop the world from forming."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other_program:
        other_program.bind(("127.0.0.1", 0))
        other_program.listen()
        taken = other_program.getsockname()[1]
        monkeypatch.setattr(lightning_3d.app.launch, "free_port", lambda: taken)
        assert (
            launch_job(2, [sys.executable, str(script)], [str(tmp_path)], str(tmp_path), threads=1)
            == 0
        )
    outs = [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(2)]
    assert [value for value, _ in outs] == ["3.0", "3.0"]
    assert outs[0][1] == outs[1][1] != str(taken)


def test_ranks_start_the_app_as_it_was_started(monkeypatch):
    """``python -m lightning_3d.app.train`` starts its ranks with ``-m`` too (run as a file, the
    package folder would stand first on ``sys.path``); a script (an example, a console script)
    as the same file, by this interpreter."""
    from types import ModuleType, SimpleNamespace

    main = ModuleType("__main__")
    main.__spec__ = SimpleNamespace(name="lightning_3d.app.train")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["/site/lightning_3d/app/train.py"])
    assert rank_command() == [sys.executable, "-m", "lightning_3d.app.train"]
    main.__spec__ = SimpleNamespace(name="lightning_3d.planner.__main__")
    assert rank_command() == [sys.executable, "-m", "lightning_3d.planner"]
    main.__spec__ = None
    monkeypatch.setattr(sys, "argv", ["examples/train.py"])
    assert rank_command() == [sys.executable, os.path.abspath("examples/train.py")]
