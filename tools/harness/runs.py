"""A reference training run of the project's GPT, reused by parity tests and benchmarks.

``fit_gpt`` trains ``LitGPT`` on the embedded text for a few steps with a fixed seed and
returns the per-step global losses, the full updated weights and the run summary, so a parallel
layout can be compared with a single-process run number by number. What to run is a
:class:`Run`, built with keywords: ``run_world(fit_gpt, 2, Run(strategy={"tensor": 2}, devices=2))``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from typing import Any, Optional

TINY_MODEL = dict(
    vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32, warmup_steps=2, max_steps=20
)
TINY_DATA = dict(corpus="stdlib", block_size=32, batch_size=8, max_bytes=400_000, val_fraction=0.05)


@dataclasses.dataclass(frozen=True)
class Run:
    """One reference run of :func:`fit_gpt` (picklable: ``run_world`` sends it to each rank).

    ``strategy`` holds ``ThreeDStrategy`` keyword arguments; ``None`` means Lightning's plain
    single device. ``devices`` is the Trainer's, ``steps`` the optimizer steps to train.
    ``model`` / ``data`` / ``trainer`` are merged over ``TINY_MODEL`` / ``TINY_DATA`` / the
    Trainer's defaults. ``arch`` is ``"gpt"`` (the reference model), ``"llama"`` / ``"gpt2"``
    (tiny test models) or ``"hf_llama"`` / ``"hf_qwen2"`` / ``"hf_gpt2"`` (tiny ``transformers``
    models, ``HFCausalLM``). ``validate=True`` also runs ``trainer.validate``, ``trainer.test``
    and ``trainer.predict`` on 2 batches afterwards (``val`` and ``test`` metrics,
    ``predictions`` of the first batch, ``all_predictions`` of each). ``resume_from`` is a checkpoint to resume from;
    ``save_to`` a ``.ckpt`` path that a ``ModelCheckpoint`` writes at the end of every training
    epoch (the usual user path), or, with ``save_every_n_steps=n``, after every n-th optimizer
    step as ``<stem>-step=<global step>.ckpt``. ``rank_state=True``: every rank also returns the
    parameters it holds (see :func:`fit_gpt`). ``accelerator`` is the Trainer's (``"gpu"`` for the
    CUDA tests, ``tests/test_cuda.py``); returned weights are on the CPU either way.
    ``rank_seeds=True``: each rank builds its model under its own seed (``seed + rank``), as a
    script that seeds by rank would, then every rank goes on from ``seed``: an engine that says
    replicas start alike must make rank 0's initial weights everyone's.
    ``initial_state=False``: no copy of the initial weights (a benchmark's peak RSS would count it).
    ``summary_warmup``: the steps ``RunSummary`` leaves out of its medians (tokens/s).
    ``data={"chat": {...}}``: :class:`~lightning_3d.data.ChatDataModule`'s keyword arguments
    (``path``, ``tokenizer``, ``block_size``, ``packing``, ...) instead of the text's.
    ``build_device``: where the module is constructed (``torch.device(...)`` as the default
    device; ``None``: the CPU, as a user script builds it). A model built on a CUDA device has its
    build's peak recorded (``build_device_peak_mb``) and the device's peak statistics reset before
    training, so the run's device peak is the training's.
    """

    strategy: Optional[dict[str, Any]] = None
    devices: int = 1
    steps: int = 5
    seed: int = 1234
    model: Optional[dict[str, Any]] = None
    data: Optional[dict[str, Any]] = None
    trainer: Optional[dict[str, Any]] = None
    arch: str = "gpt"
    validate: bool = False
    resume_from: Optional[str] = None
    save_to: Optional[str] = None
    save_every_n_steps: Optional[int] = None
    rank_state: bool = False
    accelerator: str = "cpu"
    rank_seeds: bool = False
    initial_state: bool = True
    summary_warmup: int = 3
    build_device: Optional[str] = None


# HFCausalLM's mixture-of-experts options a run's ``model`` may set (models/hf_moe.py).
HF_MOE_OPTIONS = ("router_aux_loss_coef", "router_bias_update_rate")


def fit_gpt(rank: int, run: Run) -> dict[str, Any]:
    """Train ``run.steps`` optimizer steps of ``run`` (a :class:`Run`) as ``rank``.

    RNG states are saved and restored with the checkpoints (``RNGStateCheckpoint``). Returns
    ``losses`` and ``summary`` on every rank and ``state`` (full weights, CPU) on rank 0 only.
    Also on every rank: ``local_losses``, this rank's own loss of each step before the reduction
    over ranks, and ``initial_state``, the weights before the first step (as seeded on this
    rank). With ``run.rank_state`` every rank also returns ``rank_state``: the parameters this
    rank holds, each gathered over its own mesh (ZeRO-3, tensor parallel) but not merged over
    pipeline stages, so each rank's copy can be checked, not only rank 0's.
    """
    import lightning as L
    import torch

    from lightning_3d import ThreeDStrategy
    from lightning_3d.checkpoint.view import full_state_dict
    from lightning_3d.data import TextDataModule
    from lightning_3d.observe.summary import RNGStateCheckpoint, RunSummary

    L.seed_everything(run.seed + (rank if run.rank_seeds else 0), verbose=False)
    kwargs = {**TINY_MODEL, **(run.model or {})}
    build = contextlib.nullcontext() if run.build_device is None else torch.device(run.build_device)
    with build:
        module = _build_module(run, kwargs)
    build_peak_mb = _reset_device_peak(run.build_device)
    initial_state = (
        {k: v.detach().clone() for k, v in module.state_dict().items()}
        if run.initial_state
        else None
    )
    if run.rank_seeds:
        L.seed_everything(run.seed, verbose=False)
    if "chat" in (run.data or {}):  # dict batches: ids, unshifted labels, positions or a mask
        from lightning_3d.data import ChatDataModule

        datamodule = ChatDataModule(seed=run.seed, **run.data["chat"])
    else:
        datamodule = TextDataModule(seed=run.seed, **{**TINY_DATA, **(run.data or {})})
    summary = RunSummary(warmup_steps=run.summary_warmup)
    callbacks: list = [summary, RNGStateCheckpoint()]
    if run.save_to is not None:
        from pathlib import Path

        from lightning.pytorch.callbacks import ModelCheckpoint

        target = Path(run.save_to)
        if run.save_every_n_steps is None:
            callbacks.append(
                ModelCheckpoint(
                    dirpath=target.parent,
                    filename=target.stem,
                    save_on_train_epoch_end=True,
                    enable_version_counter=False,
                )
            )
        else:
            callbacks.append(
                ModelCheckpoint(
                    dirpath=target.parent,
                    filename=target.stem + "-{step}",
                    every_n_train_steps=run.save_every_n_steps,
                    save_top_k=-1,
                    enable_version_counter=False,
                )
            )
    with tempfile.TemporaryDirectory() as root:
        fit = L.Trainer(
            accelerator=run.accelerator,
            devices=run.devices,
            strategy=ThreeDStrategy(**run.strategy) if run.strategy is not None else "auto",
            max_steps=run.steps,
            logger=False,
            enable_checkpointing=run.save_to is not None,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=2 if run.validate else 0,
            limit_test_batches=2,
            limit_predict_batches=2,
            callbacks=callbacks,
            default_root_dir=root,
            **(run.trainer or {}),
        )
        fit.fit(module, datamodule, ckpt_path=run.resume_from)
        val, test, predictions, all_predictions = {}, {}, None, None
        if run.validate:
            val = fit.validate(module, datamodule, verbose=False)[0]
            test = fit.test(module, datamodule, verbose=False)[0]
            all_predictions = fit.predict(module, datamodule)
            predictions = all_predictions[0]
    state = (
        fit.strategy.full_state_dict()
        if isinstance(fit.strategy, ThreeDStrategy)
        else full_state_dict(module)
    )
    # A collective: every rank.
    own = full_state_dict(fit.lightning_module) if run.rank_state else None
    # 16-mixed: the dynamic loss scale reached.
    scaler = getattr(fit.precision_plugin, "scaler", None)
    return {
        "losses": summary.losses,
        "summary": summary.summary,
        "state": state if rank == 0 else None,
        "val": val,
        "test": test,
        "predictions": predictions,
        "all_predictions": all_predictions,
        "loss_scale": float(scaler.get_scale()) if scaler is not None else None,
        "local_losses": summary.local_losses,
        "initial_state": initial_state,
        "rank_state": own,
        "ties": tie_report(module),
        "build_device_peak_mb": build_peak_mb,
    }


def _build_module(run: Run, kwargs: dict[str, Any]) -> Any:
    """The LightningModule of ``run.arch`` with the merged model keywords ``kwargs``."""
    from lightning_3d.models import LitGPT
    from tools.harness.tiny_models import LitTinyLM

    if run.arch == "gpt":
        module = LitGPT(**kwargs)
    elif run.arch == "moe":  # the reference GPT with mixture-of-experts MLPs
        from lightning_3d.models.moe import LitMoEGPT

        module = LitMoEGPT(**kwargs)
    elif run.arch == "hf" or run.arch.startswith(
        "hf_"
    ):  # a tiny transformers model: hf_llama, hf_qwen2, ...
        from lightning_3d.models.hf import HFCausalLM
        from tools.harness.hf_configs import tiny_hf_config

        # model={"hf": {...}} overrides keys of the tiny transformers config (arch="hf": it is the
        # whole config); model={"path": DIR} loads a saved directory instead (deferred: each rank
        # reads its slices, unless "deferred_init": False)
        if "path" in kwargs:
            source = {"path": kwargs["path"], "deferred_init": kwargs.get("deferred_init", True)}
        elif run.arch == "hf":
            source = {"config": kwargs["hf"]}
        else:
            source = {"config": tiny_hf_config(run.arch[3:], **kwargs.get("hf", {}))}
        module = HFCausalLM(
            **source,
            lr=kwargs.get("lr", 3e-3),
            warmup_steps=kwargs["warmup_steps"],
            max_steps=kwargs["max_steps"],
            optimizer=kwargs.get("optimizer", "adamw"),
            attn_implementation=kwargs.get("attn_implementation"),
            adapter=kwargs.get("adapter"),
            **{k: kwargs[k] for k in HF_MOE_OPTIONS if k in kwargs},
        )
    else:
        module = LitTinyLM(arch=run.arch, n_kv_head=kwargs.pop("n_kv_head", 2), **kwargs)
    return module


def _reset_device_peak(build_device: Optional[str]) -> Optional[float]:
    """After a build on a CUDA device: its peak in MB, and the device's peak statistics reset
    (the cached blocks released, so the reserved peak restarts from what is held); else None."""
    import torch

    if build_device is None or torch.device(build_device).type != "cuda":
        return None
    peak_mb = torch.cuda.max_memory_allocated() / 2**20
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return round(peak_mb, 1)


def fit_gpt_ranks(rank: int, run: Run) -> dict[str, Any]:
    """``fit_gpt`` with ``rank_state=True``, for ``run_world``: every rank also returns its own
    parameters."""
    return fit_gpt(rank, dataclasses.replace(run, rank_state=True))


def fit_layout(run: Run, world: int) -> dict[str, Any]:
    """``run`` on ``world`` processes (``devices=world``), rank 0's result; ``run.strategy=None``:
    plain Lightning in this process (``devices=1``)."""
    if run.strategy is None:
        return fit_gpt(0, dataclasses.replace(run, devices=1))
    from tools.harness.world import run_world

    return run_world(fit_gpt, world, dataclasses.replace(run, devices=world))[0]


def tie_report(module: Any) -> list[dict[str, Any]]:
    """This rank's view of each tied weight: which of its names it holds, whether they are one
    ``Parameter``, and the local values (CPU), so tests can check ties survive every layout."""
    from lightning_3d.parallel.tensor import local_tensor
    from lightning_3d.parallel.tied import TIED_ALIASES_ATTR

    aliases = getattr(module, TIED_ALIASES_ATTR, {})
    report = []
    for canonical in sorted(set(aliases.values())):
        names = [canonical, *sorted(a for a, c in aliases.items() if c == canonical)]
        held = {}
        for name in names:
            try:
                held[name] = module.get_parameter(name)
            except AttributeError:  # that module lives on another pipeline stage
                continue
        params = list(held.values())
        report.append(
            {
                "names": list(held),
                "one_parameter": all(p is params[0] for p in params),
                "value": local_tensor(params[0]).detach().float().cpu().clone() if params else None,
            }
        )
    return report
