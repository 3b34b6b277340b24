"""What the ranks must agree on at an optimizer step, in one small all-reduce and one host read.

Before the optimizer applies a step every rank must reach the same verdicts, or some ranks step
while others stop and the next collective hangs: was any loss or gradient non-finite (and on
which ranks), is the global gradient norm finite, did any rank receive SIGTERM / SIGINT. Each of
these used to be a collective with a host read of its own; here they are one vector:

    [norm², norm non-finite, (loss, gradients, signal) for rank 0, for rank 1, ...]

Every rank writes its own slots (and its part of the squared gradient norm, when the norm's
sum runs over exactly the ranks of the world), the vector is all-reduced with SUM once, and read
to the host once. A sum of one-hot slots says which ranks raised a flag, as a MAX would, and
lets the norm's partial sums travel in the same call. In a world of one nothing is reduced.

On a GPU the read waits for the device's queue, so the vector is read once, just before the
optimizer steps, where the step must wait for the answer anyway.

Setup has an agreement of its own (:func:`agree_on_setup`): a step that may fail on some ranks
only (the module's optimizers) ends with one flag per rank, all-reduced, so every rank raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

HEAD = 2  # the squared norm's sum and the norm's non-finite flag
PER_RANK = 3  # loss flag, gradient flag, signal number


@dataclass(frozen=True)
class Verdict:
    """What the ranks agreed on (the same on every rank)."""

    loss_ranks: list[int]  # ranks whose loss was not finite
    grad_ranks: list[int]  # ranks whose gradients held a NaN or an infinity
    norm_nonfinite: bool  # the global gradient norm was not finite
    norm_squares: float  # the squared norm summed in the ballot (0.0 when none was)
    signal: int  # the largest signal number any rank received (0: none)


def world_and_rank() -> tuple[int, int]:
    """The default group's size and this process's rank in it; (1, 0) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class Ballot:
    """One step's vector: fill it (:meth:`vote`), reduce it (:meth:`cast`, a collective), read
    it (:meth:`verdict`, the one host read)."""

    def __init__(self, device: torch.device) -> None:
        self.world, self.rank = world_and_rank()
        self.votes = torch.zeros(HEAD + PER_RANK * self.world, device=device)
        self.cast_ = False

    def vote(
        self,
        loss_flag: Optional[torch.Tensor] = None,
        grad_flag: Optional[torch.Tensor] = None,
        signal: int = 0,
        norm_flag: Optional[torch.Tensor] = None,
        norm_squares: Optional[torch.Tensor] = None,
    ) -> None:
        """This rank's entries: 0-d flags (1.0: non-finite), the signal it received, and its
        part of the squared norm (summed over the world by :meth:`cast`)."""
        own = HEAD + PER_RANK * self.rank
        for index, value in (
            (0, norm_squares),
            (1, norm_flag),
            (own, loss_flag),
            (own + 1, grad_flag),
        ):
            if value is not None:
                self.votes[index] = value.reshape(()).to(self.votes.device, torch.float32)
        if signal:
            self.votes[own + 2] = float(signal)

    def cast(self) -> torch.Tensor:
        """All-reduce (SUM) the vector over the default group, once; returns it (on the device)."""
        if not self.cast_ and self.world > 1:
            dist.all_reduce(self.votes)
        self.cast_ = True
        return self.votes

    def norm_squares(self) -> torch.Tensor:
        """The squared global gradient norm (0-d, on the device), after :meth:`cast`."""
        return self.cast()[0]

    def verdict(self) -> Verdict:
        """Cast if not yet, then read the vector to the host: the one host sync."""
        read = self.cast().tolist()
        ranks = [read[HEAD + PER_RANK * r : HEAD + PER_RANK * (r + 1)] for r in range(self.world)]
        return Verdict(
            loss_ranks=[r for r, row in enumerate(ranks) if row[0]],
            grad_ranks=[r for r, row in enumerate(ranks) if row[1]],
            norm_nonfinite=bool(read[1]),
            norm_squares=read[0],
            signal=int(max(row[2] for row in ranks)),
        )


class PeerSetupError(RuntimeError):
    """Raised on a rank whose own setup step went well when another rank's failed: every rank
    stops together instead of waiting in the next collective for the process group's timeout.
    ``ranks``: the ranks that failed; ``causes``: each one's error in a line, by rank."""

    peer_setup_failure = True  # the line describe_failure prints names the peers' causes

    def __init__(self, step: str, causes: dict[int, str]) -> None:
        self.step, self.ranks, self.causes = step, sorted(causes), causes
        said = "; ".join(f"rank {r} failed during {step}: {causes[r]}" for r in self.ranks)
        super().__init__(said)


def agree_on_setup(step: str, error: Optional[BaseException], device: torch.device) -> None:
    """End a setup step that may fail on some ranks only, on every rank of the default group: a
    collective. Each rank says whether ``step`` failed on it (``error``, or ``None``) in one
    all-reduce of one flag per rank; if any failed, every rank raises: a failed rank its own
    ``error``, the others :class:`PeerSetupError` naming the failed ranks and their causes
    (gathered in a second collective, on failure only). In a world of one, ``error`` is raised
    as is. Should the agreement itself fail (a peer that is gone), a failed rank raises its
    own ``error``, chained to that failure."""
    world, rank = world_and_rank()
    if world == 1:
        if error is not None:
            raise error
        return
    try:
        flags = torch.zeros(world, device=device)
        flags[rank] = 0.0 if error is None else 1.0
        dist.all_reduce(flags)
        failed = [r for r, flag in enumerate(flags.tolist()) if flag]
        if not failed:
            return
        line = None if error is None else _one_line(error)
        lines: list[Optional[str]] = [None] * world
        dist.all_gather_object(lines, line)
    except Exception as agreement_failed:
        if error is None:
            raise
        raise error from agreement_failed
    if error is not None:
        raise error
    raise PeerSetupError(step, {r: lines[r] or "an error" for r in failed})


def _one_line(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:300]}"
