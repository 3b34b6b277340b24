"""One run of the Hydra apps, read from its config once: :class:`RunSpec`.

:func:`read_spec` is the one place the apps parse their ``DictConfig``: the app's keys, the seed,
``resume=`` (resolved to one file), the world size and the Trainer's counts, and the
``parallelism`` / ``offload`` groups as a checked :class:`~lightning_3d.options.Plan`. Validation,
the launcher, training and resuming (:mod:`lightning_3d.app.run`) read the spec, never the config
again, so ``resume=last`` names one file and ``parallelism=auto`` is planned once
(:func:`with_auto`, in the launching process), its choice carried to the ranks as overrides
spelled from the option table (:func:`lightning_3d.options.hydra_overrides`).

Example::

    spec = read_spec(cfg)  # ValueError naming a bad value
    spec.plan.layout.tensor, spec.world, spec.resume
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_3d.app.config import HYDRA_KEYS, plan_of, target_of, world_size_of
from lightning_3d.checkpoint.resume import check_every_n_steps, resolve_resume
from lightning_3d.options import Plan, hydra_overrides

# The apps' top-level keys (conf/train.yaml, conf/finetune.yaml): any other (``+ckpt_path=...``)
# would be read by nothing, so it is refused instead of being silently ignored.
APP_KEYS = frozenset(
    {
        "model",
        "data",
        "parallelism",
        "offload",
        "trainer",
        "seed",
        "checkpoint",
        "resume",
        "finetune",
        "overwrite",
    }
)
CHECKPOINT_KEYS = frozenset({"every_n_steps"})
# What the planner chooses for parallelism=auto, as options (the rest of the plan is kept):
# always, with a pipeline, and with an offload group in the config.
AUTO_CHOSEN = ("auto", "data", "tensor", "pipeline", "zero_stage", "ac_policy")
AUTO_CHOSEN_PIPELINED = ("micro_batches", "schedule")
AUTO_CHOSEN_OFFLOAD = ("offload", "offload_params")
AUTO_CHOSEN_CONTEXT = ("context", "context_scheme")  # where the choice splits sequences
# The memory kit's options (planner/search.py), where the choice turned them on.
AUTO_CHOSEN_KIT = ("loss_chunks", "activation_offload")


@dataclass(frozen=True)
class RunSpec:
    """What one run of the app is: every value validation, launch, training and resume read.

    ``model`` and ``data`` stay config nodes: Hydra's ``instantiate`` builds them (on ``meta``
    for the checks, for real on the ranks)."""

    plan: Plan  # parallelism + offload, checked; auto off once planned (with_auto)
    world: int  # processes: trainer.devices x trainer.num_nodes
    resume: Optional[Path]  # the one checkpoint resume= names (last: found now), or None
    model: Optional[DictConfig]  # the model node (_target_ and arguments)
    data: Optional[DictConfig]  # the data module node
    trainer: DictConfig  # Lightning Trainer arguments, plus peak_tflops (ours)
    seed: Any  # checked: a whole number in [0, 2**32 - 1]
    every_n_steps: Optional[int]  # periodic last.ckpt; None: none
    overwrite: Any  # an earlier run's directory may be reused (checked by app.run)
    finetune: bool  # examples/finetune.py: resume=last looks under outputs/finetune/
    has_offload: bool  # the config has an offload group (auto's choice goes there too)
    pretrained: Optional[Path] = None  # finetune: the weights loaded before fit

    @property
    def max_steps(self) -> Any:
        return self.trainer.get("max_steps", -1)

    def trainer_kwargs(self) -> dict[str, Any]:
        """The Trainer's arguments as plain values (``peak_tflops`` included)."""
        return OmegaConf.to_container(self.trainer, resolve=True)


def read_spec(cfg: DictConfig) -> RunSpec:
    """The run ``cfg`` describes, each value read and checked once (in this order, so the first
    bad value is the one named): the app's keys, the seed, ``resume=``, the world, the Trainer's
    step counts, the plan. ``ValueError`` naming a bad value."""
    check_app_keys(cfg)
    check_seed(cfg.get("seed"))
    finetune = "finetune" in cfg
    resume = resolve_resume(cfg.get("resume"), project_dir(), finetune=finetune)
    world = world_size_of(cfg.trainer)
    max_steps = cfg.trainer.get("max_steps", -1)
    if max_steps == 0 or (isinstance(max_steps, int) and max_steps < -1):
        raise ValueError(
            f"trainer.max_steps={max_steps} trains no step (the run would save untrained weights "
            "as final.ckpt); give a positive number of steps, or -1 to let trainer.max_epochs decide"
        )
    check_trainer_counts(cfg.trainer)  # max_steps=2.5 (Lightning would train 3)
    return RunSpec(
        plan=plan_of(cfg.parallelism, cfg.get("offload")),
        world=world,
        resume=resume,
        model=cfg.get("model"),
        data=cfg.get("data"),
        trainer=cfg.trainer,
        seed=cfg.seed,
        every_n_steps=(cfg.get("checkpoint") or {}).get("every_n_steps"),
        overwrite=cfg.get("overwrite", False),
        finetune=finetune,
        has_offload="offload" in cfg,
    )


def check_app_keys(cfg: DictConfig) -> None:
    """Every top-level key (and every ``checkpoint.*`` key) is one the app reads;
    ``trainer.enable_checkpointing`` is ``checkpoint.every_n_steps``'s to set."""
    unknown = sorted(str(k) for k in cfg.keys() if k not in APP_KEYS)
    if "ckpt_path" in unknown:
        raise ValueError(
            "ckpt_path is not a key of this app: to resume, pass resume=last (the newest "
            "checkpoint of the app's earlier runs under ./outputs) or resume=PATH"
        )
    if unknown:
        one = len(unknown) == 1
        raise ValueError(
            f"{', '.join(unknown)}: not {'a key' if one else 'keys'} of this app, nothing would "
            f"read {'it' if one else 'them'} (its keys: {', '.join(sorted(APP_KEYS))})"
        )
    checkpoint = cfg.get("checkpoint")
    if checkpoint is not None:
        extra = sorted(str(k) for k in checkpoint.keys() if k not in CHECKPOINT_KEYS)
        if extra:
            raise ValueError(
                f"{', '.join(f'checkpoint.{k}' for k in extra)}: not a key of the checkpoint "
                f"block (its keys: {', '.join(sorted(CHECKPOINT_KEYS))})"
            )
        check_every_n_steps(checkpoint.get("every_n_steps"))
    if "enable_checkpointing" in cfg.trainer:
        raise ValueError(
            "trainer.enable_checkpointing: set checkpoint.every_n_steps instead (a number of "
            "steps, or null for no periodic checkpoints)"
        )


def check_trainer_counts(trainer: Any) -> None:
    """The Trainer's counts are whole numbers (Lightning takes ``max_steps=2.5`` and trains 3)."""
    for key, least in (
        ("log_every_n_steps", 0),
        ("num_sanity_val_steps", -1),
        ("max_steps", -1),
        ("min_steps", 0),
        ("max_epochs", -1),
        ("min_epochs", 0),
    ):
        value = trainer.get(key, 0)
        if value is None and key != "log_every_n_steps":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"trainer.{key}={value!r} must be an integer >= {least}")


def check_seed(seed: Any) -> None:
    """``seed``: a whole number in [0, 2**32 - 1], what ``seed_everything`` and numpy take."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed!r} must be a whole number in [0, {2**32 - 1}]")


def project_dir() -> str:
    """Where the app was started (relative ``resume=`` paths and ``./outputs`` are from there)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        from hydra.utils import get_original_cwd

        return get_original_cwd()
    return os.getcwd()


def with_auto(spec: RunSpec, model: Any) -> tuple[RunSpec, list[str], dict[str, Any]]:
    """``parallelism=auto`` planned once, in the launching process (``model``: built on meta):
    the spec with the chosen plan (auto off), the Hydra overrides that give the ranks the same
    layout, and the choice's predictions for ``summary.json``
    (:func:`~lightning_3d.strategy.auto.record_planned`)."""
    import torch
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    from lightning_3d.strategy.auto import choose_plan, found_cluster

    if model is None:
        target = spec.model.get("_target_") if spec.model is not None else None
        raise ValueError(
            f"parallelism.auto: model ({target}) cannot be built on meta to plan; "
            "choose the layout by hand"
        )
    trainer = spec.trainer
    nodes = trainer.get("num_nodes", 1) or 1
    accelerator = str(trainer.get("accelerator", "auto"))
    on_gpu = accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available()
    device_type = "cuda" if on_gpu else "cpu"
    precision = str(trainer.get("precision", "32-true"))
    data = spec.data or {}
    batch = data.get("batch_size")
    accumulate = trainer.get("accumulate_grad_batches", 1) or 1
    cluster = found_cluster(spec.world // nodes, nodes, device_type, precision)
    chosen = choose_plan(
        model,
        spec.plan,
        cluster,
        batch_size=batch * accumulate if isinstance(batch, int) else None,
        seq_len=data.get("block_size"),
        accumulate=accumulate,
        precision=precision,
        device_type=device_type,
        context_sizes="auto" if _data_splits(spec) else (1,),
        # The 8-bit rung (it changes the update's rounding): in the fine-tune app only, where
        # the model names its optimizer (model.optimizer, handed on below).
        optimizer_settable=spec.finetune and spec.model is not None and "optimizer" in spec.model,
        checkpoints=spec.every_n_steps is not None,
    )
    rank_zero_info(chosen.line)
    names = AUTO_CHOSEN
    if chosen.plan.layout.pipeline > 1:
        names += AUTO_CHOSEN_PIPELINED
    if spec.has_offload:
        names += AUTO_CHOSEN_OFFLOAD
    if chosen.plan.layout.context > 1:
        names += AUTO_CHOSEN_CONTEXT
    given = spec.plan.options()
    names += tuple(n for n in AUTO_CHOSEN_KIT if chosen.plan.options()[n] != given[n])
    overrides = [
        f"{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in hydra_overrides(chosen.plan, names).items()
    ]
    model_cfg = spec.model
    if model_cfg is not None and chosen.optimizer != model_cfg.get("optimizer", chosen.optimizer):
        model_cfg = OmegaConf.merge(model_cfg, {"optimizer": chosen.optimizer})
        overrides.append(f"model.optimizer={chosen.optimizer}")
    return replace(spec, plan=chosen.plan, model=model_cfg), overrides, chosen.figures


def _data_splits(spec: RunSpec) -> bool:
    """Whether the data module takes context parallelism (its ``check_layout``, where it has
    one, accepts ``context=2``): where not, auto plans without it."""
    check_layout = (
        getattr(target_of(spec.data, "data"), "check_layout", None) if spec.data else None
    )
    if check_layout is None:
        return True
    options = OmegaConf.to_container(spec.data, resolve=True)
    given = {k: v for k, v in options.items() if k not in HYDRA_KEYS}
    try:
        check_layout(1, context=2, **given)
    except ValueError:
        return False
    return True
