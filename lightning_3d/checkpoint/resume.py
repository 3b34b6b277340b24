"""The Hydra apps' checkpoints and ``resume=last|PATH``: where runs save, and what "last" means.

Every run of ``examples/train.py`` (and ``examples/finetune.py``) saves ``<run dir>/last.ckpt``
every ``checkpoint.every_n_steps`` optimizer steps and at its last step (``trainer.max_steps``),
through Lightning's ``ModelCheckpoint`` (:class:`PeriodicCheckpoint`), so the strategy writes it
in ``parallelism.checkpoint_format`` (one file, or a directory of shards under the same name) and
atomically (the previous ``last.ckpt`` stays whole until the new one replaces it). On SIGTERM /
SIGINT every rank saves ``<run dir>/preempted.ckpt`` (:mod:`lightning_3d.runtime.preemption`). Both are
taken right after an optimizer step, so a run resumed from either continues exactly as the
uninterrupted run would have: weights, optimizer state, LR schedule, loop counters, the data
loader's position and every rank's RNG states (``trainer.fit(ckpt_path=...)``).

``resume=PATH`` continues from that checkpoint (a ``.ckpt`` file or a sharded checkpoint
directory; relative to the working directory). ``resume=last`` picks the checkpoint written
most recently (modification time) among the ``last.ckpt`` and ``preempted.ckpt`` of every run
directory under ``./outputs`` of the same app: ``examples/train.py``'s runs are
``outputs/<date>/<time>`` (``outputs/finetune/`` left out), ``examples/finetune.py``'s are
``outputs/finetune/...`` — the default ``hydra.run.dir`` of each. A resumed run is a new run, in
a new directory, with its own ``last.ckpt``; it may change the layout (``trainer.devices``,
``parallelism.*``) and ``trainer.max_steps``, and should keep everything else.

Resolved in the launching process (:func:`resolve_resume`, called once by
:func:`lightning_3d.app.spec.read_spec`, the run's one reading of its config), so a missing file
or no earlier checkpoint is one ``error:`` line and exit code 2, and every rank resumes from the
same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_3d.runtime.resume_hint import LAST_NAME, RESUMABLE, written_at

LAST = "last"  # resume=last: the newest checkpoint of this app's runs
# outputs/finetune/...: the fine-tune app's own run directories (see conf/finetune.yaml).
FINETUNE_RUNS = "finetune"
OUTPUTS = "outputs"  # the apps' run directories, relative to the working directory (conf/*.yaml)


class PeriodicCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` keeping one file, ``<dirpath>/last.ckpt``, saved every ``every_n_steps``
    optimizer steps and at ``trainer.max_steps``, always right after an optimizer step.

    Lightning's own fallback save in ``on_train_end`` is left out: there the fit loop has counted
    the epoch as finished, so a run resumed from it would start the next epoch instead of going on
    where it stopped.

    Example::

        trainer = L.Trainer(max_steps=120, callbacks=[PeriodicCheckpoint("runs/a", every_n_steps=50)])
        trainer.fit(model, data)  # runs/a/last.ckpt at steps 50, 100 and 120
    """

    def __init__(self, dirpath: str | Path, every_n_steps: int) -> None:
        super().__init__(
            dirpath=str(dirpath),
            save_last=True,
            save_top_k=0,
            every_n_train_steps=every_n_steps,
            enable_version_counter=False,
            save_on_train_epoch_end=True,
        )
        self.every_n_steps = every_n_steps
        self.last_path = Path(dirpath) / LAST_NAME

    @override
    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        # The last step, not saved above.
        if step == trainer.max_steps and step % self.every_n_steps:
            trainer.save_checkpoint(self.last_path, weights_only=False)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        pass  # no end-of-fit save (see the class docstring)


def check_every_n_steps(value: Any) -> None:
    """``checkpoint.every_n_steps``: a whole number >= 1, or ``None`` (no periodic checkpoints)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            f"checkpoint.every_n_steps={value!r} must be a whole number >= 1, or null for no periodic "
            "checkpoints"
        )


def runs_of(finetune: bool) -> tuple[str, Optional[str]]:
    """``(directory of this app's runs, a subdirectory of it that holds another app's runs)``,
    relative to the working directory."""
    return (f"{OUTPUTS}/{FINETUNE_RUNS}", None) if finetune else (OUTPUTS, FINETUNE_RUNS)


def newest_checkpoint(runs: Path, skip: Optional[str] = None) -> Optional[Path]:
    """The ``last.ckpt`` or ``preempted.ckpt`` under ``runs`` (any depth; not under ``runs/skip``)
    written most recently, or ``None``."""
    from lightning_3d.checkpoint.sharded_files import is_sharded_checkpoint

    if not runs.is_dir():
        return None
    found = [
        p
        for name in RESUMABLE
        for p in runs.glob(f"**/{name}")
        if (p.is_file() or is_sharded_checkpoint(p))
        and (skip is None or p.relative_to(runs).parts[0] != skip)
    ]
    return max(found, key=written_at, default=None)


def resolve_resume(value: Any, project_dir: str | Path, finetune: bool = False) -> Optional[Path]:
    """The checkpoint ``resume=value`` names, as an absolute path (``None`` for ``None``):
    ``"last"`` (see the module's docstring) or a path relative to ``project_dir``. ``ValueError``
    when there is none, it does not exist, or it is not a training checkpoint."""
    from lightning_3d.checkpoint.checks import SAFETENSORS, detect_format

    if value is None:
        return None
    if value == LAST:
        runs, skip = runs_of(finetune)
        path = newest_checkpoint(Path(project_dir) / runs, skip)
        if path is None:
            raise ValueError(
                f"resume=last: no {' or '.join(RESUMABLE)} under {Path(project_dir) / runs}"
                f"{f' (outside {runs}/{skip}/)' if skip else ''} to resume from; pass resume=PATH, "
                "or start without resume"
            )
        return path.resolve()
    path = Path(str(value)).expanduser()
    path = (path if path.is_absolute() else Path(project_dir) / path).resolve()
    try:
        kind = detect_format(path)
    except FileNotFoundError:
        raise ValueError(
            f"resume={value!r}: {path} does not exist (give a last.ckpt or preempted.ckpt file or "
            "sharded directory, or resume=last)"
        ) from None
    except ValueError as err:
        raise ValueError(f"resume={value!r}: {err}") from None
    if kind == SAFETENSORS:
        raise ValueError(
            f"resume={value!r}: {path} holds weights only (safetensors), not a training state to resume; "
            "start from its weights with examples/finetune.py finetune.pretrained=PATH"
        )
    return path


def check_fits(path: Path, module: Any, adapter: Any = None) -> None:
    """``ValueError`` naming every name and shape in which the checkpoint at ``path`` differs from
    ``module`` (built on ``meta``): read from a ``.ckpt`` mapped, not loaded, or from a sharded
    checkpoint's metadata, so no tensor data is read here (the ranks verify checksums as they load).

    An adapter checkpoint holds only the adapters (``module.keeps_in_checkpoint``): its adapter
    record (:func:`~lightning_3d.adapters.checkpoint.saved_adapter`) is compared with the
    module's options first, a base-vs-adapter mismatch said as such, then only the names the
    module keeps in a checkpoint. ``module=None`` (a model that cannot be built on ``meta``:
    QLoRA quantizes its base as it is built) compares the record with ``adapter``, the run's
    :class:`~lightning_3d.adapters.AdapterOptions` (``None``: no adapter), and nothing else."""
    from lightning_3d.adapters.checkpoint import adapter_mismatch, saved_adapter
    from lightning_3d.adapters.options import AdapterOptions
    from lightning_3d.checkpoint import sharded_files
    from lightning_3d.checkpoint.checks import check_against, load_lightning_checkpoint, shapes_of

    try:
        if sharded_files.is_sharded_checkpoint(path):
            entries = sharded_files.read_meta(path)
            tensors = sharded_files.tensor_entries(
                sharded_files.read_metadata(path), sharded_files.MODEL
            )
            saved = {name: tuple(md.size) for name, md in tensors.items()}
        else:
            entries = load_lightning_checkpoint(path, mmap=True, verify=None)
            saved = shapes_of(entries["state_dict"])
        if module is not None:
            adapter = getattr(module, "adapter", None)  # HFCausalLM's options; others: none
        mismatch = adapter_mismatch(
            saved_adapter(entries), adapter if isinstance(adapter, AdapterOptions) else None
        )
        if mismatch is not None:
            raise ValueError(mismatch)
        if module is None:
            return
        keeps = getattr(module, "keeps_in_checkpoint", None)
        mine = {
            name: shape
            for name, shape in shapes_of(module.state_dict()).items()
            if not callable(keeps) or keeps(name)
        }
        check_against(mine, saved, source="the checkpoint")
    except ValueError as err:
        raise ValueError(f"resume={path}: {err}") from None


def check_steps_left(path: Path, max_steps: Any) -> None:
    """``ValueError`` if the checkpoint at ``path`` is already at ``max_steps`` (a finished run:
    the resumed one would train nothing and exit 0), or its loop counters cannot be read (a
    sharded checkpoint's ``meta.pt`` missing, truncated or damaged). Reads those counters only
    (``meta.pt``; a ``.ckpt`` memory-mapped)."""
    from lightning_3d.checkpoint import sharded_files
    from lightning_3d.checkpoint.checks import load_lightning_checkpoint

    try:  # read whatever max_steps is: a sharded checkpoint's missing or damaged meta.pt is named here
        if sharded_files.is_sharded_checkpoint(path):
            entries = sharded_files.read_meta(path)
        else:
            entries = load_lightning_checkpoint(path, mmap=True, verify=None)
    except ValueError as err:
        raise ValueError(f"resume={path}: {err}") from None
    if "loops" not in entries or "optimizer_states" not in entries:
        raise ValueError(
            f"resume={path}: it holds weights only (no optimizer state or loop counters: saved with "
            "weights_only=True), not a training state to resume; start from its weights with "
            "examples/finetune.py finetune.pretrained=PATH"
        )
    step = entries.get("global_step")
    if not isinstance(max_steps, int) or max_steps < 1:
        return  # -1: the epochs decide; Lightning says when there is nothing left
    if isinstance(step, int) and step >= max_steps:
        raise ValueError(
            f"resume={path}: that run is finished (global step {step}, trainer.max_steps={max_steps}): "
            f"nothing to train; raise trainer.max_steps above {step} to go on"
        )
