"""The body of the Hydra apps (:mod:`lightning_3d.app.train`): validate, launch ranks, train, summarise.

Everything that can be wrong with a configuration is checked in the launching process, before
any rank, process group or file exists; a bad value ends the app with one ``error:`` line and
exit code 2 instead of a traceback from every rank.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_3d.app.config import (
    HYDRA_KEYS,
    check_target_keys,
    model_limits,
    target_of,
    without_weights,
)
from lightning_3d.app.launch import (
    already_launched,
    launch_job,
    quoted,
    rank_command,
    resume_override,
    typed_command,
)
from lightning_3d.app.rank_report import report_here, send
from lightning_3d.app.run_dir import RunDirInUse, hold
from lightning_3d.app.spec import RunSpec, check_trainer_counts, read_spec, with_auto
from lightning_3d.checkpoint.resume import PeriodicCheckpoint, check_fits, check_steps_left
from lightning_3d.options import Plan
from lightning_3d.options.model_check import check
from lightning_3d.parallel.masters import refuse_master_combinations
from lightning_3d.parallel.optimizers import optimizer_problems
from lightning_3d.runtime.failures import REPORTS_ENV
from lightning_3d.runtime.nonfinite import NonFiniteError
from lightning_3d.runtime.preemption import Preempted
from lightning_3d.runtime.resume_hint import resume_command, resume_hint, written_checkpoint
from lightning_3d.runtime.watchdog import LAUNCHER_PID_ENV
from lightning_3d.strategy.auto import record_planned
from lightning_3d.strategy.three_d import ThreeDStrategy

# The launcher's own step after validation (examples/finetune.py: the pretrained file), given
# the spec and the model built on meta (None: none); returns the spec the ranks train.
Prepare = Callable[[RunSpec, Any], RunSpec]


def validate(cfg: DictConfig | RunSpec) -> RunSpec:
    """Raise ``ValueError`` for any inconsistent value in ``cfg`` (no side effects): the app's
    keys, the periodic checkpoints and the checkpoint to resume from (``resume=``: it exists, and
    its names and shapes are the model's), the layout, the model's and the data's keys and values
    (the model built on meta, the data module built), the plan against the model's shapes,
    and the Trainer's arguments. Returns the run's spec (:func:`~lightning_3d.app.spec.read_spec`)."""
    spec = cfg if isinstance(cfg, RunSpec) else read_spec(cfg)
    check_spec(spec)
    return spec


def check_spec(spec: RunSpec, model: Any = None) -> Any:
    """:func:`validate`'s checks after the config was read: ``model`` is the model built on meta
    where the caller has built it already (``parallelism=auto`` planned on it), else it is built
    here. Returns that model (``None``: no model, or one that cannot be built on meta)."""
    plan = spec.plan.resolved(spec.world)
    layout = plan.layout
    batch_size = spec.data.get("batch_size") if spec.data is not None else None
    unplanned = plan.auto.enabled  # parallelism=auto left to the ranks: the planner picks sizes
    if (
        not unplanned
        and isinstance(batch_size, int)
        and batch_size > 0
        and batch_size % layout.data
    ):
        raise ValueError(
            f"global data.batch_size ({batch_size}) is not divisible by data-parallel size "
            f"({layout.data})"
        )
    if (
        not unplanned
        and layout.pipeline > 1
        and isinstance(batch_size, int)
        and batch_size > 0
        and (batch_size // layout.data) % plan.pp.micro_batches
    ):
        raise ValueError(
            f"per-rank batch {batch_size // layout.data} (data.batch_size {batch_size} / data "
            f"{layout.data}) is not divisible by micro_batches={plan.pp.micro_batches}"
        )
    if spec.data is not None and not unplanned:
        check_data_layout(spec.data, layout)
        block_size = spec.data.get("block_size")
        if layout.context > 1 and isinstance(block_size, int) and block_size % (2 * layout.context):
            raise ValueError(
                f"data.block_size={block_size} is not divisible by 2 × context = "
                f"{2 * layout.context}: context parallelism cuts each sequence into that many "
                "equal chunks"
            )
    if spec.model is not None:
        check_target_keys(spec.model, "model")
        model_limits(spec.model)  # a Hugging Face model's directory or config, said as such
        check_adapter_plan(spec.model, plan)
        check_optimizer_plan(
            spec.model,
            plan,
            spec.every_n_steps is not None,
            str(spec.trainer.get("precision", "32-true")),
        )
        # fp32 masters (bf16-true at ZeRO 0-2) and what they do not support yet.
        refuse_master_combinations(plan, str(spec.trainer.get("precision", "32-true")))
        model = model if model is not None else model_on_meta(spec.model)
        split = (layout.tensor, layout.pipeline, layout.context, layout.expert)
        if model is not None and any(size > 1 for size in split):
            check(model, plan, spec.world)
        if model is not None and plan.offload.device == "nvme":
            _check_offload_room(model, plan)
        if model is not None and spec.resume is not None:
            check_fits(spec.resume, model)
        elif spec.resume is not None:  # not buildable on meta (QLoRA): its adapter options only
            adapter = configured_adapter(spec.model)
            if adapter is not None:
                check_fits(spec.resume, None, adapter)
    if spec.resume is not None:
        check_steps_left(spec.resume, spec.max_steps)
    if spec.model is not None and spec.data is not None:
        check_model_and_data(spec.model, spec.data)
        if model is not None:
            check_data_model(spec.data, model)
    check_trainer(spec.trainer, spec.plan)
    # (A resumed epoch is shorter, and an unplanned layout unknown yet: the ranks check those.)
    if spec.data is not None and spec.resume is None and not unplanned:
        check_data_sizes(spec.data, spec.trainer, layout.data)
    return model


def check_model_and_data(model: DictConfig, data: DictConfig) -> None:
    """The model's and the data's keys against their targets' parameters, each one's own checks
    (a Hugging Face model directory or config; the data files and tokenizer, when the data module
    has a ``check`` classmethod; the data module's constructor), and the two against each other:
    the data's ids must fit the model's vocabulary and its ``block_size`` the model's positions."""
    check_target_keys(model, "model")
    check_target_keys(data, "data")
    limits = model_limits(model)
    block_size = data.get("block_size")
    if (
        block_size is not None
        and limits.max_positions is not None
        and block_size > limits.max_positions
    ):
        raise ValueError(
            f"data.block_size={block_size} is above the model's maximum positions {limits.max_positions} "
            f"({limits.source}); set data.block_size={limits.max_positions} or less"
        )
    # Its constructor's own checks (batch_size, val_fraction, ...); reads no data.
    _build(data, "data")
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


def check_data_layout(data: DictConfig, layout: Any) -> None:
    """The data module's own limits on the layout, where its class has a ``check_layout``
    (``data=chat``: packed rows need ``pipeline=1``)."""
    check_layout = getattr(target_of(data, "data"), "check_layout", None)
    if check_layout is not None:
        options = OmegaConf.to_container(data, resolve=True)
        given = {k: v for k, v in options.items() if k not in HYDRA_KEYS}
        check_layout(layout.pipeline, context=layout.context, **given)


def check_data_model(data: DictConfig, model: Any) -> None:
    """The data module's own limits on the model built on meta, where its class has a
    ``check_model`` (``data=chat``: packed rows need token mixers that keep conversations
    apart)."""
    check_model = getattr(target_of(data, "data"), "check_model", None)
    if check_model is not None:
        options = OmegaConf.to_container(data, resolve=True)
        check_model(model, **{k: v for k, v in options.items() if k not in HYDRA_KEYS})


def check_data_sizes(data: DictConfig, trainer: DictConfig, data_degree: int) -> None:
    """The data's splits against the batch size and the Trainer's validation interval, where the
    data module can count its windows (``split_windows``): at least one global batch in the
    validation split, and an integer ``trainer.val_check_interval`` within the batches of an
    epoch (Lightning's own check, which it makes only once the ranks have loaded the data). A
    module that counts by tokenizing (``data=text``) stops once the counts pass these checks."""
    split_windows = getattr(target_of(data, "data"), "split_windows", None)
    batch_size = data.get("batch_size")
    if split_windows is None or not isinstance(batch_size, int) or batch_size < data_degree:
        return
    interval = _checked_interval(trainer)

    def enough(train: int, val: int) -> bool:
        batches = _epoch_batches(train, batch_size, data_degree, trainer)
        return val >= batch_size and (interval is None or batches >= interval)

    options = OmegaConf.to_container(data, resolve=True)
    options = {k: v for k, v in options.items() if k not in HYDRA_KEYS}
    sizes = split_windows(**options, enough=enough)
    if sizes is None:
        return
    train, val = sizes
    if val < batch_size:
        raise ValueError(
            f"data.batch_size={batch_size} is larger than the validation split ({val} windows of "
            f"data.block_size+1 positions, data.val_fraction={data.get('val_fraction')}); lower "
            "data.batch_size, or raise data.val_fraction or the data's size"
        )
    batches = _epoch_batches(train, batch_size, data_degree, trainer)
    if interval is not None and interval > batches:
        raise ValueError(
            f"trainer.val_check_interval={interval} is above the {batches} batches of an epoch "
            f"({train} training windows, data.batch_size={batch_size}); give "
            f"trainer.val_check_interval={batches} or less, a fraction of the epoch such as 0.5, "
            "or trainer.limit_val_batches=0 for no validation"
        )


def _checked_interval(trainer: DictConfig) -> int | None:
    """``trainer.val_check_interval`` where Lightning checks it against an epoch's batches (an
    integer, validation by epoch, some validation batches); ``None`` elsewhere."""
    interval = trainer.get("val_check_interval", 1.0)
    limit_val = trainer.get("limit_val_batches", 1.0)
    if (
        isinstance(interval, bool)
        or not isinstance(interval, int)
        or trainer.get("check_val_every_n_epoch", 1) is None
        or not (isinstance(limit_val, (int, float)) and limit_val > 0)
    ):
        return None
    return interval


def _epoch_batches(train: int, batch_size: int, data_degree: int, trainer: DictConfig) -> int:
    """A rank's training batches per epoch of ``train`` windows, within
    ``trainer.limit_train_batches``."""
    # Per rank, incomplete batches dropped (the sampler's and the loader's drop_last).
    batches = (train // data_degree) // (batch_size // data_degree)
    limit = trainer.get("limit_train_batches", 1.0)
    if isinstance(limit, int) and not isinstance(limit, bool):
        return min(batches, limit)
    if isinstance(limit, float):
        return int(batches * limit)
    return batches


def configured_adapter(model: DictConfig) -> Any:
    """The :class:`~lightning_3d.adapters.AdapterOptions` of a configured ``HFCausalLM``
    (``adapter=lora|qlora``), read from the config without building the model; ``None`` for
    no adapter or another model."""
    target = target_of(model, "model")
    hf = sys.modules.get("lightning_3d.models.hf")  # imported with its target, if it is one
    if hf is None or not (isinstance(target, type) and issubclass(target, hf.HFCausalLM)):
        return None
    from lightning_3d.adapters import AdapterOptions

    node = model.get("adapter")
    value = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    options = AdapterOptions.parse(value)
    return options if options.enabled else None


def check_adapter_plan(model: DictConfig, plan: Plan) -> None:
    """QLoRA's limits on the layout, from the adapter options alone, before the model is built
    (whose own refusals, such as a base NF4 cannot hold, would otherwise be named first):
    ``ValueError`` naming the adapter, parallelism and offload keys that cannot go together."""
    adapter = configured_adapter(model)
    if adapter is None or adapter.method != "qlora":
        return
    from lightning_3d.adapters.qlora import refuse_qlora_plan

    layout, bnb = plan.layout, adapter.quantization == "bitsandbytes"
    keys = ["adapter=qlora" + (" model.adapter.quantization=bitsandbytes" if bnb else "")]
    if layout.tensor > 1:
        keys.append(f"parallelism.tensor={layout.tensor}")
    if layout.zero_stage == 3 and (bnb or plan.offload.params):
        keys.append("parallelism.zero_stage=3")
        if not bnb:
            keys.append("offload.params=true")
    try:
        refuse_qlora_plan(plan, adapter.quantization)
    except ValueError as err:
        raise ValueError(f"{' with '.join(keys)}: {err}") from None


def check_optimizer_plan(
    model: DictConfig, plan: Plan, checkpoints: bool, precision: str | None = None
) -> None:
    """The model's ``optimizer`` (low-bit AdamW among them) against the layout, offload,
    periodic checkpoints and the precision: ``ValueError`` naming the keys
    (``parallel/optimizers.py``)."""
    name = model.get("optimizer")
    if name is None:
        return
    problems = optimizer_problems(
        name,
        plan.layout.zero_stage,
        plan.offload.device,
        checkpoints,
        precision=precision,
        master_weights=plan.zero.master_weights,
    )
    if problems:
        raise ValueError(f"model.optimizer={name}: " + "; ".join(problems))


def model_on_meta(model: DictConfig) -> Any:
    """The configured model built on ``meta`` (no memory, no weights read), so its constructor's
    checks run here; ``None`` for a module that cannot be built on meta for other reasons (the
    ranks build it for real). ``ValueError`` for a bad value."""
    import torch

    with torch.device("meta"):
        built = _build(without_weights(model), "model")
        if built is None and model.get("path") is not None:
            # A directory model that declined its deferred build (transformers converts the
            # files' tensors on load; QLoRA quantizes as it builds): its config.json's shapes.
            built = _build(without_weights(model, always=True), "model")
    return built


def _build(node: DictConfig, where: str) -> Any:
    """``instantiate(node)``; a ``ValueError``, ``TypeError`` or ``ImportError`` from the
    constructor is a config error (``ValueError`` naming ``where``), anything else -> ``None``."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node)
    except Exception as err:  # noqa: BLE001 -- Hydra wraps the constructor's error
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ else err
        if isinstance(cause, (ValueError, TypeError, ImportError)):
            text = str(cause).strip().splitlines()
            raise ValueError(
                f"{where} ({node.get('_target_')}): {type(cause).__name__}: "
                f"{text[0] if text else ''}"
            ) from None
        return None


def _check_offload_room(model: Any, plan: Any) -> None:
    """The offload path has room for at least this rank's share of Adam's two fp32 moments
    (a lower bound: the rank checks the exact size before writing)."""
    from lightning_3d.offload.paths import check_offload_path

    layout = plan.layout
    shards = (layout.data if layout.zero_stage >= 1 else 1) * layout.tensor * layout.pipeline
    check_offload_path(plan.offload.path, 8 * sum(p.numel() for p in model.parameters()) // shards)


def check_trainer(trainer: DictConfig, plan: Plan) -> None:
    """The Trainer's arguments: Lightning's own checks (precision, max_steps, val_check_interval,
    an unknown argument, ...) by building the Trainer here, with the strategy, without starting
    anything, plus those Lightning leaves to the first step (``accumulate_grad_batches >= 1``,
    ``gradient_clip_val >= 0``)."""
    import logging

    import lightning as L

    from lightning_3d.observe.flops import check_peak_tflops

    kwargs = OmegaConf.to_container(trainer, resolve=True)
    try:
        check_peak_tflops(kwargs.pop("peak_tflops", None))
    except ValueError as err:
        raise ValueError(f"trainer.peak_tflops: {err}") from None
    accumulate = kwargs.get("accumulate_grad_batches", 1)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"trainer.accumulate_grad_batches={accumulate!r} must be an integer >= 1")
    clip = kwargs.get("gradient_clip_val")
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0
    ):
        raise ValueError(
            f"trainer.gradient_clip_val={clip!r} must be a number >= 0 (or null: no clipping)"
        )
    check_trainer_counts(trainer)
    quiet = logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # "GPU available: ..." belongs to the ranks' output
    try:
        L.Trainer(**{**kwargs, "logger": False}, strategy=ThreeDStrategy(plan))
    except Exception as err:  # noqa: BLE001 -- ValueError, MisconfigurationException, TypeError, a missing accelerator
        text = str(err).strip().splitlines()
        raise ValueError(f"trainer: {text[0] if text else type(err).__name__}") from None
    finally:
        quiet.setLevel(level)


def train(spec: RunSpec, output_dir: str) -> dict[str, Any]:
    """Train on this rank (the world is already launched, or has one process)."""
    import lightning as L
    from hydra.utils import instantiate

    from lightning_3d.observe.summary import RNGStateCheckpoint, RunSummary

    L.seed_everything(spec.seed, verbose=False)
    model = instantiate(spec.model)
    datamodule = instantiate(spec.data)
    trainer_kwargs = spec.trainer_kwargs()
    # peak_tflops is ours, for MFU.
    summary = RunSummary(out_dir=output_dir, peak_tflops=trainer_kwargs.pop("peak_tflops", None))
    callbacks = [summary, RNGStateCheckpoint()]  # a resume from its checkpoints continues exactly
    if spec.every_n_steps is not None:  # <run dir>/last.ckpt; preempted.ckpt goes next to it
        callbacks.append(PeriodicCheckpoint(output_dir, spec.every_n_steps))
    trainer = L.Trainer(
        **trainer_kwargs,
        enable_checkpointing=spec.every_n_steps is not None,
        strategy=ThreeDStrategy(spec.plan),
        callbacks=callbacks,
        default_root_dir=output_dir,
    )
    # spec.resume: one file, found by the launcher (our launcher hands it to its ranks; under
    # torchrun or SLURM each rank finds "last" itself).
    resume = spec.resume
    try:
        with warnings.catch_warnings():
            # A resumed run saves into its own new directory, which Lightning would warn about.
            warnings.filterwarnings("ignore", message="The dirpath has changed from")
            trainer.fit(model, datamodule, ckpt_path=str(resume) if resume is not None else None)
    except (NonFiniteError, Preempted) as err:
        _stop(trainer, err)
    # The trained model, consolidated (any layout, plain Lightning or the fine-tune app
    # loads it; `python -m lightning_3d.checkpoint consolidate` turns it into safetensors).
    # The whole state (optimizer, loops, callbacks): a later run resumes from it.
    trainer.save_checkpoint(Path(output_dir) / "final.ckpt", weights_only=False)
    return summary.summary


def run(
    cfg: DictConfig,
    body: Callable[[RunSpec, str], dict[str, Any]] | None = None,
    prepare: Prepare | None = None,
) -> int:
    """Entry point shared by the apps (train, fine-tune); returns the process exit code. ``cfg`` is read
    once (:func:`~lightning_3d.app.spec.read_spec`: ``resume=last`` names the newest checkpoint
    now, before this run writes any, so every rank and a relaunch resume from the same file),
    ``parallelism=auto`` planned, the run validated, then ``prepare`` (the app's own launcher
    step: the pretrained file) runs; ``body`` runs on every rank once the world exists (default
    :func:`train`)."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    try:
        spec = read_spec(cfg)
        chosen: list[str] = []
        planned, model = None, None
        # parallelism=auto: chosen here, once, and handed to the ranks as overrides (a rank of
        # torchrun / SLURM leaves it to its strategy, which plans on rank 0 for the whole world).
        if spec.plan.auto.enabled and not already_launched():
            model = model_on_meta(spec.model)
            spec, chosen, planned = with_auto(spec, model)
        if not already_launched():
            quoted(output_dir)  # the ranks get it as a Hydra override: refused here if it cannot be
        model = check_spec(spec, model)
        if prepare is not None:
            spec = prepare(spec, model)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        discard_run_dir(Path(output_dir), hydra_cfg.job.name)
        return 2
    launch = functools.partial(_launch_or_train, spec, body, hydra_cfg, chosen, planned)
    if already_launched():  # a rank: its launcher holds the run directory
        return _reporting(output_dir, launch)
    try:
        if not isinstance(spec.overwrite, bool):
            raise RunDirInUse(f"overwrite={spec.overwrite!r} must be true or false")
        with hold(Path(output_dir), resuming=spec.resume is not None, overwrite=spec.overwrite):
            return _reporting(output_dir, launch)
    except RunDirInUse as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _reporting(output_dir: str, call: Callable[[], int]) -> int:
    """``call()``; should it fail, one ``error:`` line from the launching process and the exit
    code of the failure's kind (:mod:`lightning_3d.app.rank_report`): a rank of our launcher sends
    it there, a one-process run says it itself. An agreed stop (a non-finite loss, a
    preemption), Ctrl-C and an exit go on as they are, as do errors under torchrun or SLURM."""
    ours = bool(os.environ.get(LAUNCHER_PID_ENV))
    launching = not already_launched()  # asked now: Lightning sets LOCAL_RANK in one process too
    if not (ours or launching):
        return call()
    before = os.environ.get(REPORTS_ENV)
    os.environ[REPORTS_ENV] = "1"  # the strategy leaves its lines to this report
    try:
        return call()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 -- CheckpointException is a BaseException
        if getattr(err, "agreed_stop", False):
            raise
        if ours:
            return send(err, int(os.environ.get("RANK", "0")))
        return report_here(err, Path(output_dir))
    finally:
        if before is None:
            os.environ.pop(REPORTS_ENV, None)
        else:
            os.environ[REPORTS_ENV] = before


def _launch_or_train(
    spec: RunSpec,
    body: Callable[[RunSpec, str], dict[str, Any]] | None,
    hydra_cfg: Any,
    chosen: list[str],
    planned: dict[str, Any] | None,
) -> int:
    """Start the ranks of a world of more than one process, or train in this one."""
    output_dir = hydra_cfg.runtime.output_dir
    if spec.world > 1 and not already_launched():
        if spec.trainer.get("num_nodes", 1) > 1:
            print(
                "error: multi-node runs are started by torchrun or SLURM, one launcher per node",
                file=sys.stderr,
            )
            return 2
        threads = max(1, (os.cpu_count() or 1) // spec.world)
        overrides = _without_resume(hydra_cfg.overrides.task) + chosen
        if spec.resume is not None:
            overrides.append(resume_override(spec.resume))
        code = launch_job(spec.world, rank_command(), overrides, output_dir, threads)
        if code == 0:
            # The ranks did not plan: add it.
            record_planned(Path(output_dir) / "summary.json", planned)
            _report(Path(output_dir) / "summary.json")
        return code
    # The stop messages of this rank (a preemption, a lost peer, a non-finite loss) name this
    # app's command line with resume=<checkpoint>.
    with resume_command([*typed_command(), *_without_resume(hydra_cfg.overrides.task)]):
        summary = (body or train)(spec, output_dir)
    if spec.world == 1:
        record_planned(Path(output_dir) / "summary.json", planned)
        _report(Path(output_dir) / "summary.json", summary)
    return 0


def _without_resume(overrides: Any) -> list[str]:
    """The run's Hydra overrides but ``resume=`` (``+resume=``, ``~resume``)."""
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "resume"]


def discard_run_dir(path: Path, job_name: str) -> None:
    """Remove a run directory that holds only what Hydra wrote before the config was refused."""
    hydra_only = {".hydra", f"{job_name}.log"}
    if path.is_dir() and {p.name for p in path.iterdir()} <= hydra_only:
        shutil.rmtree(path, ignore_errors=True)


def _stop(trainer: Any, err: Exception) -> None:
    """Rank 0 prints one ``error:`` line (every rank stopped at the same step: the check is
    agreed; a non-finite stop adds how to resume from the last good checkpoint), then this
    process ends with exit code 1 where it is the app's own run (a rank, or the one process);
    in a ``-m`` sweep job or outside Hydra the error propagates, so the sweep records the job
    and runs the next. No ``final.ckpt``: the weights are the last good step's,
    which the last checkpoint written holds already. The other ranks wait for rank 0's line
    before they exit, as the launcher ends the remaining ranks at the first exit code."""
    import torch.distributed as dist
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if trainer.global_rank == 0:
        hint = ""
        # (Preempted names its checkpoint and the command itself.)
        if isinstance(err, NonFiniteError):
            last_good = written_checkpoint(trainer)
            hint = f"; {'the last good checkpoint is kept, ' if last_good is not None else ''}{resume_hint(last_good)}"
        print(f"error: {err}{hint}", file=sys.stderr, flush=True)
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError:  # a peer gone already: nothing left to wait for
            pass
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.RUN:
        raise SystemExit(1) from None
    raise err


def _report(path: Path, summary: dict[str, Any] | None = None) -> None:
    if summary is None:
        if not path.exists():
            return
        summary = json.loads(path.read_text())
    losses = summary.get("losses") or [float("nan")]
    print(
        f"done: {summary.get('steps', 0)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"{summary.get('tokens_per_s', 0.0):.0f} tokens/s; summary: {path}"
    )
