"""Stopping every rank on SIGTERM / SIGINT, as a cluster scheduler sends them (preemption).

Lightning's own SIGTERM handler broadcasts from inside the signal handler, from rank 0 only: a
signal to any other rank leaves that rank in a collective its peers never join, and the job
hangs until the collective timeout. Here the handler only records the signal. The ranks agree
on the recorded signals once per optimizer step, inside the step's one agreement (the small
all-reduce that also carries the non-finite check, :mod:`lightning_3d.runtime.agreement`), or,
where no such agreement ran (manual optimization), in a small all-reduce of their own. After the
step, where ``ModelCheckpoint`` saves too (weights, optimizer state, loop counters and the data
loader's position agree), if any rank was signalled, all ranks save a checkpoint together and
raise :class:`Preempted`, so the job ends within one step, non-zero, with a checkpoint that
resumes exactly. ``ThreeDStrategy`` adds :class:`StopOnSignal` to the trainer's callbacks at
setup, and turns off Lightning's per-batch SIGTERM broadcast (:func:`without_signal_broadcast`):
with these handlers installed Lightning never records a SIGTERM, so that broadcast would only
cost a collective and a host read per batch.

A second SIGINT (Ctrl-C twice) is not deferred: the first restores the previous handler.
"""

from __future__ import annotations

import functools
import signal
import threading
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_3d.runtime.resume_hint import PREEMPTED, resume_hint

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(RuntimeError):
    """A rank received SIGTERM or SIGINT; every rank stopped after saving a checkpoint."""

    agreed_stop = True  # every rank raises it at the same step: no per-rank failure line


class StopOnSignal(Callback):
    """Record SIGTERM / SIGINT during ``fit``; stop every rank at the next step end."""

    def __init__(self) -> None:
        self.received = 0  # the signal number this process received (0: none)
        self._previous: dict[int, Any] = {}
        self._last_step = -1
        self._agreed: Optional[int] = None  # the signal the step's agreement settled on

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning registers its own handlers just before the training stage starts.
        self.install()
        self._last_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self._last_step:  # an optimizer step ended (not mid-accumulation)
            self._last_step = trainer.global_step
            self.stop_if_signalled(trainer, trainer.strategy.root_device, trainer.global_rank)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.restore()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Keep recording: putting Lightning's SIGTERM handler back now would let a signal during
        # the error handling broadcast from inside the handler. Lightning's signal connector puts
        # back the handlers it found when the trainer tears down, right after this.
        self._previous = {}

    def install(self) -> None:
        """Record SIGTERM / SIGINT from now on (main thread only; a no-op elsewhere)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum
        if signum == signal.SIGINT:  # a second Ctrl-C interrupts at once
            signal.signal(
                signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler)
            )

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def note_agreed(self, signum: int) -> None:
        """The signal the ranks agreed on in this step's agreement (no collective needed)."""
        self._agreed = max(signum, self._agreed or 0)

    def agreed(self, device: torch.device) -> int:
        """The signal any rank received (the largest number), agreed by every rank (a collective).
        A world of one agrees with itself: no tensor, so no host-device copy and sync per step."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def stop_if_signalled(self, trainer: Any, device: torch.device, rank: int) -> None:
        """At a step boundary: if any rank was signalled, save ``preempted.ckpt`` (all ranks take
        part) and raise :class:`Preempted` on every rank."""
        signum, self._agreed = self._agreed, None
        if signum is None:  # no agreement this step (manual optimization): one of our own
            signum = self.agreed(device)
        if not signum:
            return
        path = checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)
        name = signal.Signals(signum).name
        self.restore()
        raise Preempted(
            f"{name} received{' here' if self.received else ' by another rank'} (rank {rank}); stopped every rank "
            f"after step {trainer.global_step} and saved {path}; {resume_hint(path)}"
        )


def checkpoint_path(trainer: Any) -> Path:
    """Where the preemption checkpoint goes: the ``ModelCheckpoint`` directory if there is one,
    else the trainer's ``default_root_dir``."""
    callback: Optional[Any] = getattr(trainer, "checkpoint_callback", None)
    directory = getattr(callback, "dirpath", None) or trainer.default_root_dir
    return Path(directory) / PREEMPTED


@functools.lru_cache(maxsize=None)
def _quiet_loop_type(base: type) -> type:
    """``base`` (Lightning's training epoch loop type) without its per-batch SIGTERM broadcast."""

    def _broadcast_sigterm_tensor(self: Any) -> None:
        """No broadcast: :class:`StopOnSignal` agrees on signals within each step."""

    name = f"SignalAgreed{base.__name__}"
    return type(
        name,
        (base,),
        {
            "__module__": __name__,
            "__qualname__": name,
            "_broadcast_sigterm_tensor": _broadcast_sigterm_tensor,
            "signal_agreed": True,
        },
    )


def without_signal_broadcast(trainer: Any) -> None:
    """Make ``trainer``'s training epoch loop one of a subclass of its type that skips
    Lightning's per-batch SIGTERM broadcast (a ``torch.distributed.broadcast`` of a flag and a
    host read before every batch, on every rank), with the same state. Call it only with
    :class:`StopOnSignal` among the callbacks: its handlers replace Lightning's, so Lightning's
    flag stays 0, and it stops every rank on a signal itself."""
    fit_loop = trainer.fit_loop
    loop = fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor") or getattr(loop, "signal_agreed", False):
        return
    quiet = _quiet_loop_type(type(loop)).__new__(_quiet_loop_type(type(loop)))
    quiet.__dict__.update(vars(loop))
    fit_loop.epoch_loop = quiet
