"""A non-finite loss, gradient or gradient norm stops the run (or skips the step) before the step applies it.

Without this check a diverging run (``model.lr=1e6``) trains on NaN from the step the loss
blows up, reports success and saves NaN weights over the last good checkpoint. The check runs
where :mod:`lightning_3d.strategy.precision`'s plugin runs the closure (training step + backward), so
the optimizer has not stepped yet:

* the loss and the gradients the optimizer would apply: every rank flags its own, and the step's
  one agreement (:mod:`lightning_3d.runtime.agreement`, a small all-reduce that also carries the
  signal agreement and, where it spans the world, the clipping norm's sum) tells every rank
  which ranks saw a non-finite value, so all ranks stop (or skip) together and none hangs in the
  next collective. Under a pipeline every stage holds the broadcast loss. The gradients are
  checked too because a finite loss can come with NaN gradients (``lr=1e6`` on a pipeline: the
  weights turned NaN one step before the loss did). Under 16-mixed the grad scaler checks the
  (scaled) gradients itself, so only the loss is checked here;
* the gradient norm, when ``gradient_clip_val`` has the norm computed anyway (global over every
  rank, so already agreed): it stands for the gradients (a NaN or infinite gradient makes it
  non-finite), which are then not read a second time. Under 16-mixed an overflow the grad
  scaler found is the scaler's to handle (skip the step, lower the scale): not an error.

Everything is read in one host sync per step (:meth:`NonFiniteGuard.resolve`), just before the
optimizer steps (the precision plugin's ``_after_closure``): on a GPU each read waits for the
device's queue to drain. Without clipping, the gradients are read by one fused 2-norm per
device and dtype (see :func:`_any_nonfinite`), not a few kernels per tensor. Under 16-mixed the
loss is read at once (the scaler unscales and may skip right after).

``nonfinite="stop"`` (default) raises :class:`NonFiniteError` naming the global step and the
ranks; ``"skip"`` drops the step's gradients on every rank, leaves the optimizer (and the ZeRO
engines' state, the loss scale) as they were, and raises once more than ``max_nonfinite_skips``
steps were skipped, naming them. A skipped step still counts as a global step, as a step the
grad scaler skips does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_3d.parallel.tensor import by_device_and_dtype, local_tensor
from lightning_3d.runtime.agreement import Ballot

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


def loss_flag(loss: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """1.0 (0-d) where this rank's ``loss`` holds a NaN or an infinity; ``None`` for no loss (a
    step that returned none counts as finite). A vocab-parallel loss: its local part."""
    if loss is None:
        return None
    return (~torch.isfinite(local_tensor(loss).detach())).any().float()


@torch.no_grad()
def _any_nonfinite(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 (a 0-d tensor on ``device``) if any element of ``grads`` is NaN or infinite. One
    fused 2-norm (``_foreach_norm``, accumulated in float32) per device and dtype, not a few
    kernels per tensor: a NaN or an infinity makes it non-finite. The 2-norm, not the max-abs:
    on CPU the order-inf norm is not vectorised (8 ms against 0.5 ms for 1.65 M floats, measured
    here), and a float32 sum of squares overflows only for gradients beyond ~1e19, which count
    as diverged anyway."""
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for (_, dtype), tensors in by_device_and_dtype(
        g for g in grads if local_tensor(g).numel()
    ).items():
        low = dtype in (torch.float16, torch.bfloat16)
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32 if low else None)
        flag = torch.maximum(flag, (~torch.isfinite(torch.stack(norms))).any().float().to(device))
    return flag


class NonFiniteGuard:
    """Per-run state of the check: the options, the step under way and the steps skipped so far
    (one per process; a resumed run starts counting again).

    The check and every other per-step agreement travel in one :class:`Ballot` per step (see
    :mod:`lightning_3d.runtime.agreement`): ``signals``, when given, is asked for the signal this
    rank received (``signals.received``) and told what the ranks agreed
    (``signals.note_agreed(signum)``), so that stopping on SIGTERM costs no collective of its own.
    """

    def __init__(
        self, options: NonFiniteOptions = NonFiniteOptions(), signals: Optional[Any] = None
    ) -> None:
        self.options = options
        self.signals = signals
        self.step = 0
        self.skipped: list[int] = []
        self._ballot: Optional[Ballot] = None  # this step's, from the first flag on
        self._grads: Sequence[torch.Tensor] = ()  # noted by flag_step, read by resolve
        self._grads_device: Optional[torch.device] = None
        self._norm: Optional[torch.Tensor] = None  # a global norm noted by flag_norm
        self._folded = False  # the norm's partial sums ride in this step's ballot
        # Under 16-mixed: the grad scaler's agreed found-inf flag of the step (0-d, on the device).
        self.scaler_overflow: Optional[torch.Tensor] = None

    @property
    def skipped_step(self) -> bool:
        """Whether the step numbered :attr:`step` (the one under way, or the last one) was
        skipped, here or by the grad scaler (an overflow under 16-mixed): what a module moves
        after each applied step (a balancing bias fed by the step's loads) must then stay put,
        as the weights do. Reads the scaler's flag from the device (after the scaler's own read
        of it: no wait of its own)."""
        if self.skipped and self.skipped[-1] == self.step:
            return True
        return self.scaler_overflow is not None and bool(self.scaler_overflow.item())

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
        """:meth:`check_step` without the answer yet: no collective, no host sync. The loss is
        flagged now; the gradients are read at :meth:`resolve` unless a gradient norm noted by
        then stands for them (a norm of a NaN or infinite gradient is not finite)."""
        self._ballot_on(device).vote(
            loss_flag=loss_flag(loss if isinstance(loss, torch.Tensor) else None)
        )
        self._grads, self._grads_device = grads, device

    def flag_norm(self, norm: torch.Tensor) -> None:
        """:meth:`check_norm` without the answer yet (see :meth:`flag_step`); ``norm`` is global
        (agreed already). A norm folded into this step's ballot needs no second note."""
        if not self._folded:
            self._norm = norm

    def fold_norm(self, squares: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The squared global gradient norm, from this rank's part ``squares``, summed over the
        world in this step's ballot (its one collective, run now): the clipping norm and the
        agreement in one call. Its finiteness stands for the gradients' at :meth:`resolve`."""
        ballot = self._ballot_on(device)
        ballot.vote(norm_squares=squares)
        self._folded = True
        return self._cast(ballot).norm_squares()

    def resolve(self) -> None:
        """Agree on everything noted since the last call, in one collective, and read it in one
        host sync; then stop or skip as :meth:`check_step` and :meth:`check_norm` would (the
        loss first, then the gradients, then the norm). Nothing noted: nothing to do."""
        ballot, grads, norm, folded = self._ballot, self._grads, self._norm, self._folded
        self._ballot, self._grads, self._norm, self._folded = None, (), None, False
        if ballot is None and norm is None:
            return
        if ballot is None:
            ballot = Ballot(norm.device)
        if norm is not None:
            ballot.vote(norm_flag=(~torch.isfinite(norm.detach())).float())
        elif grads and not folded:
            ballot.vote(grad_flag=_any_nonfinite(grads, self._grads_device or ballot.votes.device))
        verdict = self._cast(ballot).verdict()  # the one host sync
        if self.signals is not None:
            self.signals.note_agreed(verdict.signal)
        if verdict.loss_ranks:
            self.failed(
                f"non-finite loss at global step {self.step} on rank(s) {verdict.loss_ranks}"
            )
        if verdict.grad_ranks:
            self.failed(
                f"non-finite gradients at global step {self.step} on rank(s) {verdict.grad_ranks}"
            )
        if verdict.norm_nonfinite or not math.isfinite(verdict.norm_squares):
            value = float(norm) if norm is not None else math.sqrt(verdict.norm_squares)
            self.failed(f"non-finite gradient norm ({value}) at global step {self.step}")

    def _ballot_on(self, device: torch.device) -> Ballot:
        if self._ballot is None:
            self._ballot = Ballot(device)
        return self._ballot

    def _cast(self, ballot: Ballot) -> Ballot:
        """The ballot, reduced: this rank's signal is voted last, just before the collective."""
        if not ballot.cast_:
            ballot.vote(signal=self.signals.received if self.signals is not None else 0)
            ballot.cast()
        return ballot

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
