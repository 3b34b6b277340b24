"""A non-finite loss, gradient or gradient norm stops the run (or skips the step) before the step applies it.

Without this check a diverging run (``model.lr=1e6``) trains on NaN from the step the loss
blows up, reports success and saves NaN weights over the last good checkpoint. The check runs
where :mod:`lightning_3d.strategy.precision`'s plugin runs the closure (training step + backward), so
the optimizer has not stepped yet:

* the loss and the gradients the optimizer would apply: every rank flags its own, and one
  all-reduce (MAX) of two flags per rank tells every rank which ranks saw a non-finite value,
  so all ranks stop (or skip) together and none hangs in the next collective. Under a pipeline
  every stage holds the broadcast loss. The gradients are checked too because a finite loss
  can come with NaN gradients (``lr=1e6`` on a pipeline: the weights turned NaN one step before
  the loss did); one read of each gradient, no host sync per tensor. Under 16-mixed the grad
  scaler checks the (scaled) gradients itself, so only the loss is checked here;
* the gradient norm, when ``gradient_clip_val`` has the norm computed anyway (global over every
  rank, so already agreed). Under 16-mixed an overflow the grad scaler found is the scaler's to
  handle (skip the step, lower the scale): not an error.

The flags stay on the device until :meth:`NonFiniteGuard.resolve` reads them all (loss,
gradients and norm) in one host sync per step, just before the optimizer steps (the precision
plugin's ``_after_closure``): on a GPU each read waits for the device's queue to drain. The
gradients are read by one fused max-abs per device and dtype, not a few kernels per tensor.
Under 16-mixed the loss is read at once (the scaler unscales and may skip right after).

``nonfinite="stop"`` (default) raises :class:`NonFiniteError` naming the global step and the
ranks; ``"skip"`` drops the step's gradients on every rank, leaves the optimizer (and the ZeRO
engines' state, the loss scale) as they were, and raises once more than ``max_nonfinite_skips``
steps were skipped, naming them. A skipped step still counts as a global step, as a step the
grad scaler skips does.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_3d.parallel.tensor import by_device_and_dtype, local_tensor

NONFINITE_ACTIONS = ("stop", "skip")


@dataclass(frozen=True)
class NonFiniteOptions:
    """What a non-finite loss, gradient or gradient norm does: ``action`` ``"stop"`` or ``"skip"``;
    ``max_skips``: with ``"skip"``, the most steps the run may skip before it stops."""

    action: str = "stop"
    max_skips: int = 10

    def problems(self) -> list[str]:
        """What is wrong with these values, in the option names users give (empty: nothing)."""
        problems = []
        if self.action not in NONFINITE_ACTIONS:
            problems.append(f"nonfinite must be one of {NONFINITE_ACTIONS}, got {self.action!r}")
        if (
            not isinstance(self.max_skips, int)
            or isinstance(self.max_skips, bool)
            or self.max_skips < 0
        ):
            problems.append(
                f"max_nonfinite_skips must be a whole number >= 0, got {self.max_skips!r}"
            )
        return problems


class NonFiniteError(RuntimeError):
    """The run stopped at a non-finite loss, gradient or gradient norm; the step was not applied, so the
    weights (and any checkpoint written) are those before ``step``."""

    agreed_stop = True  # every rank raises it at the same step: no per-rank failure line

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.step)


class SkipStep(Exception):
    """Raised inside the closure to abandon the step before the optimizer applies it (caught by
    the precision plugin's ``optimizer_step``; never escapes it)."""


def nonfinite_flags(
    loss: Optional[torch.Tensor], grads: Sequence[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """``(2, world_size)`` flags (row 0: loss, row 1: gradients; 1.0 where that rank saw a
    non-finite value), the same on every rank: one all-reduce of the flags over the default
    group when one exists. ``None`` (a step that returned no loss) counts as finite; ``grads``
    are this rank's parts (local tensors of DTensors are read). Left on ``device``: no host
    sync, so the caller reads them together with other flags."""
    world, rank = (
        (dist.get_world_size(), dist.get_rank())
        if dist.is_available() and dist.is_initialized()
        else (1, 0)
    )
    flags = torch.zeros(2, world, dtype=torch.float32, device=device)
    if loss is not None:
        flags[0, rank] = (
            (~torch.isfinite(local_tensor(loss).detach())).any().float()
        )  # a vocab-parallel loss: its part
    if grads:
        flags[1, rank] = _any_nonfinite(grads, device)
    if world > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags


@torch.no_grad()
def _any_nonfinite(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 (a 0-d tensor on ``device``) if any element of ``grads`` is NaN or infinite. One
    fused max-abs (``_foreach_norm`` of order inf, which propagates NaN) per device and dtype,
    not a few kernels per tensor: on a GPU the check costs one read of the gradients."""
    flag = torch.zeros((), dtype=torch.float32, device=device)
    # The max of nothing is undefined; nothing is finite.
    for tensors in by_device_and_dtype(g for g in grads if local_tensor(g).numel()).values():
        largest = torch.stack(torch._foreach_norm(tensors, float("inf")))
        flag = torch.maximum(flag, (~torch.isfinite(largest)).any().float().to(device))
    return flag


def _ranks(rows: list[list[float]]) -> tuple[list[int], list[int]]:
    loss_row, grad_row = ([r for r, flag in enumerate(row) if flag] for row in rows)
    return loss_row, grad_row


class NonFiniteGuard:
    """Per-run state of the check: the options, the step under way and the steps skipped so far
    (one per process; a resumed run starts counting again)."""

    def __init__(self, options: NonFiniteOptions = NonFiniteOptions()) -> None:
        self.options = options
        self.step = 0
        self.skipped: list[int] = []
        self._flags: Optional[torch.Tensor] = None  # noted by flag_step, read by resolve
        self._norm: Optional[torch.Tensor] = None  # noted by flag_norm, read by resolve

    def check_step(self, loss: Any, grads: Sequence[torch.Tensor], device: torch.device) -> None:
        """After training step and backward: stop or skip (on every rank alike) if any rank's
        loss or any of its gradients (``grads``: what the optimizer would apply) is not finite."""
        self.flag_step(loss, grads, device)
        self.resolve()

    def check_norm(self, norm: torch.Tensor) -> None:
        """The global gradient norm (the same on every rank): stop or skip if it is not finite."""
        self.flag_norm(norm)
        self.resolve()

    def flag_step(self, loss: Any, grads: Sequence[torch.Tensor], device: torch.device) -> None:
        """:meth:`check_step` without reading the answer yet (no host sync): :meth:`resolve`
        reads it, with the norm's, before the optimizer steps. The collective runs now."""
        self._flags = nonfinite_flags(
            loss if isinstance(loss, torch.Tensor) else None, grads, device
        )

    def flag_norm(self, norm: torch.Tensor) -> None:
        """:meth:`check_norm` without reading the answer yet (see :meth:`flag_step`)."""
        self._norm = norm

    def resolve(self) -> None:
        """Read every flag noted since the last call in one host sync, then stop or skip as
        :meth:`check_step` and :meth:`check_norm` would (the loss first, then the gradients,
        then the norm); nothing noted: nothing to do."""
        flags, norm, self._flags, self._norm = self._flags, self._norm, None, None
        if flags is None and norm is None:
            return
        parts = [] if flags is None else [flags.flatten()]
        if norm is not None:
            device = parts[0].device if parts else norm.device
            parts.append((~torch.isfinite(norm.detach())).float().reshape(1).to(device))
        read = torch.cat(parts).tolist()  # the one host sync
        if flags is not None:
            world = flags.shape[1]
            loss_ranks, grad_ranks = _ranks([read[:world], read[world : 2 * world]])
            if loss_ranks:
                self.failed(f"non-finite loss at global step {self.step} on rank(s) {loss_ranks}")
            if grad_ranks:
                self.failed(
                    f"non-finite gradients at global step {self.step} on rank(s) {grad_ranks}"
                )
        if norm is not None and read[-1]:
            self.failed(f"non-finite gradient norm ({float(norm)}) at global step {self.step}")

    def failed(self, what: str) -> None:
        """Raise :class:`NonFiniteError` (stop, or more skips than allowed) or :class:`SkipStep`."""
        if self.options.action == "skip":
            if len(self.skipped) < self.options.max_skips:
                self.skipped.append(self.step)
                raise SkipStep(what)
            raise NonFiniteError(
                f"{what}, after {len(self.skipped)} skipped step(s) {self.skipped} "
                f"(max_nonfinite_skips={self.options.max_skips}): the run stops. The step was not applied: the "
                "weights (and checkpoints) are those before it",
                self.step,
            )
        raise NonFiniteError(
            f"{what}. The step was not applied: the weights (and checkpoints) are those before it. Lower the "
            "learning rate, or skip such steps with nonfinite='skip' (Hydra: parallelism.nonfinite=skip)",
            self.step,
        )
