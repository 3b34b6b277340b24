"""The app reads its config once: ``app.run`` turns the Hydra config into one run description
(:class:`lightning_3d.app.spec.RunSpec`) and validation, launch, training and resume read that.

Before: one one-process run parsed ``parallelism``/``offload`` into a plan 4 times
(``from_hydra``), resolved ``resume=`` 3 times (``resolve_resume``: ``resume=last`` could name two
files if a checkpoint appeared in between) and built the model on ``meta`` twice with
``parallelism=auto``. These tests run the app's own entry point in this process, under a real
Hydra config, and count.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import pytest
import torch

from lightning_3d.models import LitGPT

TINY = [
    "model=gpt_tiny",
    f"model._target_={__name__}.CountedGPT",
    "data.batch_size=4",
    "data.max_bytes=100000",
    "trainer.devices=1",
    "trainer.max_steps=2",
    "trainer.limit_val_batches=0",
    "checkpoint.every_n_steps=null",
]


def _counting(monkeypatch, name: str, calls: Counter) -> None:
    """Every ``lightning_3d`` module's binding of the function ``name`` counted in ``calls``
    (however it was imported), once the app's modules are loaded."""
    import lightning_3d.app.finetune  # noqa: F401 -- load every module that may bind it
    import lightning_3d.app.run  # noqa: F401
    import lightning_3d.checkpoint.resume
    import lightning_3d.options

    original = {
        "from_hydra": lightning_3d.options.from_hydra,
        "resolve_resume": lightning_3d.checkpoint.resume.resolve_resume,
    }[name]

    def counted(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("lightning_3d") and (
            getattr(module, name, None) is original
        ):
            monkeypatch.setattr(module, name, counted)


class CountedGPT(LitGPT):
    """The reference GPT, noting the device of each of its constructions (``meta`` or not)."""

    def __init__(self, **kwargs):
        CountedGPT.builds.append(torch.empty(0).device.type)
        super().__init__(**kwargs)


def _builds(monkeypatch) -> list[str]:
    """The devices of the app's model's constructions from now on (``meta`` or ``cpu``)."""
    builds: list[str] = []
    monkeypatch.setattr(CountedGPT, "builds", builds, raising=False)
    return builds


def _run_app(tmp_path, monkeypatch, *overrides: str) -> int:
    """``python examples/train.py *overrides`` in this process (a run directory under tmp_path)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from lightning_3d.app.config import CONF_DIR, register_configs
    from lightning_3d.app.run import run

    # A launcher's variables (Lightning sets some in this process too): none before, none after.
    launcher = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_PROCID", "MASTER_ADDR", "MASTER_PORT")
    for key in launcher:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    register_configs()
    run_dir = tmp_path / "run"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(
            "train",
            overrides=[*overrides, f"hydra.run.dir={run_dir}"],
            return_hydra_config=True,
        )
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
        cfg.hydra.job.name = "train"
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):  # what Hydra hands the task: the config without its own node
        del cfg["hydra"]
    run_dir.mkdir()
    try:
        return run(cfg)
    finally:
        HydraConfig.instance().cfg = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key in launcher:
            os.environ.pop(key, None)


def test_a_run_parses_its_plan_and_resolves_resume_once(tmp_path, monkeypatch):
    calls: Counter = Counter()
    _counting(monkeypatch, "from_hydra", calls)
    _counting(monkeypatch, "resolve_resume", calls)
    builds = _builds(monkeypatch)
    assert _run_app(tmp_path, monkeypatch, *TINY) == 0
    assert (tmp_path / "run" / "final.ckpt").is_file()
    assert calls == Counter(from_hydra=1, resolve_resume=1)
    assert builds == ["meta", "cpu"]  # validate's check, then the model trained


def test_a_resumed_run_resolves_last_once(tmp_path, monkeypatch):
    _builds(monkeypatch)
    (tmp_path / "first").mkdir()
    assert _run_app(tmp_path / "first", monkeypatch, *TINY, "checkpoint.every_n_steps=2") == 0
    first = tmp_path / "outputs" / "2026-01-01" / "00-00-00"
    first.parent.mkdir(parents=True)
    (tmp_path / "first" / "run").rename(first)  # where resume=last looks: outputs/<date>/<time>
    calls: Counter = Counter()
    _counting(monkeypatch, "resolve_resume", calls)
    _counting(monkeypatch, "from_hydra", calls)
    code = _run_app(tmp_path, monkeypatch, *TINY, "trainer.max_steps=3", "resume=last")
    assert code == 0
    assert calls == Counter(from_hydra=1, resolve_resume=1)


@pytest.mark.slow  # the planner measures the model's activations (~10 s)
def test_parallelism_auto_builds_the_model_on_meta_once(tmp_path, monkeypatch):
    calls: Counter = Counter()
    _counting(monkeypatch, "from_hydra", calls)
    builds = _builds(monkeypatch)
    assert _run_app(tmp_path, monkeypatch, *TINY, "parallelism=auto") == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["planned"]["label"]
    assert calls == Counter(from_hydra=1)
    assert builds == ["meta", "cpu"]  # planned and checked on one meta model
