"""The body of the Hydra apps (``examples/train.py``): validate, launch ranks, train, summarise.

Everything that can be wrong with a configuration is checked in the launching process, before
any rank, process group or file exists; a bad value ends the app with one ``error:`` line and
exit code 2 instead of a traceback from every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_3d.config import (
    HYDRA_KEYS,
    build_strategy,
    plan_of,
    check_target_keys,
    model_limits,
    target_of,
    without_weights,
    world_size_of,
)
from lightning_3d.launch import already_launched, launch_job
from lightning_3d.plan import Plan
from lightning_3d.recipe import check


def validate(cfg: DictConfig) -> None:
    """Raise ``ValueError`` for any inconsistent value in ``cfg`` (no side effects)."""
    world = world_size_of(cfg.trainer)
    plan = plan_of(cfg.parallelism, cfg.get("offload")).resolved(world)
    layout = plan.layout
    batch_size = cfg.data.get("batch_size") if "data" in cfg else None
    if batch_size is not None and batch_size % layout.data:
        raise ValueError(
            f"global data.batch_size ({batch_size}) is not divisible by data-parallel size ({layout.data})"
        )
    if layout.pipeline > 1 and batch_size is not None and (batch_size // layout.data) % plan.pp.micro_batches:
        raise ValueError(
            f"per-rank batch {batch_size // layout.data} (data.batch_size {batch_size} / data {layout.data}) "
            f"is not divisible by micro_batches={plan.pp.micro_batches}"
        )
    if layout.tensor > 1 or layout.pipeline > 1:
        _check_on_meta(cfg, plan, world)
    if "model" in cfg and "data" in cfg:
        check_model_and_data(cfg.model, cfg.data)


def check_model_and_data(model: DictConfig, data: DictConfig) -> None:
    """The model's and the data's keys against their targets' parameters, each one's own checks
    (a Hugging Face model directory or config; the data files and tokenizer, when the data module
    has a ``check`` classmethod), and the two against each other: the data's ids must fit the
    model's vocabulary and its ``block_size`` the model's positions."""
    check_target_keys(model, "model")
    check_target_keys(data, "data")
    limits = model_limits(model)
    block_size = data.get("block_size")
    if block_size is not None and limits.max_positions is not None and block_size > limits.max_positions:
        raise ValueError(
            f"data.block_size={block_size} is above the model's maximum positions {limits.max_positions} "
            f"({limits.source}); set data.block_size={limits.max_positions} or less"
        )
    data_check = getattr(target_of(data, "data"), "check", None)
    if data_check is None:
        return
    options = OmegaConf.to_container(data, resolve=True)
    data_vocab = data_check(**{k: v for k, v in options.items() if k not in HYDRA_KEYS})
    if limits.vocab_size is not None and data_vocab > limits.vocab_size:
        raise ValueError(
            f"the data's ids need a vocabulary of {data_vocab} but the model has vocab_size={limits.vocab_size} "
            f"({limits.source}); use the model's own tokenizer or a model with a larger vocabulary"
        )


def _check_on_meta(cfg: DictConfig, plan: Plan, world: int) -> None:
    """The plan against the model's shapes, with the model built on ``meta`` (no memory):
    :func:`lightning_3d.recipe.check` (tensor-parallel plan, tied weights split alike, the
    pipeline split)."""
    import torch
    from hydra.utils import instantiate

    try:
        with torch.device("meta"):
            model = instantiate(without_weights(cfg.model))
    except Exception:  # a module that cannot be built on meta is checked by the ranks instead
        return
    check(model, plan, world)


def train(cfg: DictConfig, output_dir: str) -> dict[str, Any]:
    """Train on this rank (the world is already launched, or has one process)."""
    import lightning as L
    from hydra.utils import instantiate

    from lightning_3d.callbacks import RNGStateCheckpoint, RunSummary

    L.seed_everything(cfg.seed, verbose=False)
    model = instantiate(cfg.model)
    datamodule = instantiate(cfg.data)
    summary = RunSummary(out_dir=output_dir)
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer = L.Trainer(
        **trainer_kwargs,
        strategy=build_strategy(cfg.parallelism, cfg.get("offload")),
        callbacks=[summary, RNGStateCheckpoint()],  # a resume from its checkpoints continues exactly
        default_root_dir=output_dir,
    )
    trainer.fit(model, datamodule)
    # The trained model, consolidated (any layout, plain Lightning or examples/finetune.py
    # loads it; `python -m lightning_3d.checkpoint consolidate` turns it into safetensors).
    trainer.save_checkpoint(Path(output_dir) / "final.ckpt")
    return summary.summary


def run(cfg: DictConfig, script: str, body: Callable[[DictConfig, str], dict[str, Any]] | None = None,
        validated: bool = False) -> int:
    """Entry point shared by the example apps; returns the process exit code. ``body`` runs on
    every rank once the world exists (default :func:`train`); ``validated``: the caller has run
    :func:`validate` on ``cfg`` already."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    try:
        if not validated:
            validate(cfg)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        _discard_run_dir(Path(output_dir), hydra_cfg.job.name)
        return 2
    world = world_size_of(cfg.trainer)
    if world > 1 and not already_launched():
        if cfg.trainer.get("num_nodes", 1) > 1:
            print("error: multi-node runs are started by torchrun or SLURM, one launcher per node", file=sys.stderr)
            return 2
        threads = max(1, (os.cpu_count() or 1) // world)
        code = launch_job(world, script, list(hydra_cfg.overrides.task), output_dir, threads)
        if code == 0:
            _report(Path(output_dir) / "summary.json")
        return code
    summary = (body or train)(cfg, output_dir)
    if world == 1:
        _report(Path(output_dir) / "summary.json", summary)
    return 0


def _discard_run_dir(path: Path, job_name: str) -> None:
    """Remove a run directory that holds only what Hydra wrote before the config was refused."""
    hydra_only = {".hydra", f"{job_name}.log"}
    if path.is_dir() and {p.name for p in path.iterdir()} <= hydra_only:
        shutil.rmtree(path, ignore_errors=True)


def _report(path: Path, summary: dict[str, Any] | None = None) -> None:
    if summary is None:
        if not path.exists():
            return
        summary = json.loads(path.read_text())
    losses = summary.get("losses") or [float("nan")]
    print(
        f"done: {summary['steps']} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"{summary['tokens_per_s']:.0f} tokens/s; summary: {path}"
    )
