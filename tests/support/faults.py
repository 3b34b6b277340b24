"""A training run in which one rank dies or is told to stop, for fault-handling tests.

:func:`fit_until_killed` trains the reference GPT with ``ModelCheckpoint(save_last=True)`` after
every step; rank ``victim`` sends itself ``signum`` right after step ``kill_at``: SIGKILL (no
clean-up, as an OOM kill or a lost node would; the other ranks must stop with an error instead
of hanging) or SIGTERM / SIGINT (a scheduler's preemption: every rank must save and stop).
"""

from __future__ import annotations

import os
import signal
from typing import Any, Optional


def fit_until_killed(
    rank: int,
    root: str,
    steps: int,
    kill_at: Optional[int],
    victim: int = 1,
    timeout_s: float = 30.0,
    resume: Any = False,
    signum: int = signal.SIGKILL,
    world: int = 2,
) -> dict[str, Any]:
    """Returns ``losses`` (of this process) and ``global_step``, and ``preempted`` (the message)
    when the run stopped on a signal; raises anything else the trainer raises. ``resume``:
    ``True`` for the last checkpoint, or a checkpoint path."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lightning_3d import ThreeDStrategy
    from lightning_3d.data import TextDataModule
    from lightning_3d.models import LitGPT
    from lightning_3d.observe.summary import RunSummary
    from lightning_3d.runtime.preemption import Preempted
    from tools.harness.runs import TINY_DATA, TINY_MODEL

    catchable = signum in (signal.SIGTERM, signal.SIGINT)

    class Kill(Callback):
        # SIGKILL lands after step ``kill_at``; SIGTERM / SIGINT during it, as a scheduler's
        # signal usually does (forward and backward are most of a step): the ranks agree on
        # signals inside each step (one collective with the non-finite check), so a signal
        # received during step ``kill_at`` stops every rank right after it.
        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if catchable and self._due(trainer.global_step + 1):
                os.kill(os.getpid(), signum)

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if not catchable and self._due(trainer.global_step):
                os.kill(os.getpid(), signum)

        def _due(self, step: int) -> bool:
            return kill_at is not None and rank == victim and step == kill_at

    L.seed_everything(1234, verbose=False)
    summary = RunSummary()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
        strategy=ThreeDStrategy(zero_stage=2, timeout_s=timeout_s),
        callbacks=[
            summary,
            Kill(),
            ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=1, save_top_k=0),
        ],
    )
    ckpt_path = ("last" if resume is True else resume) or None
    try:
        trainer.fit(
            LitGPT(**TINY_MODEL), TextDataModule(seed=1234, **TINY_DATA), ckpt_path=ckpt_path
        )
    except Preempted as err:
        return {"losses": summary.losses, "global_step": trainer.global_step, "preempted": str(err)}
    return {"losses": summary.losses, "global_step": trainer.global_step}
