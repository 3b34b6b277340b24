"""The loss under context parallelism: the token mean over the whole sequence, on every rank.

Each context rank computes cross-entropy over its own tokens. Inside :func:`context_mean_loss`,
``F.cross_entropy`` (``reduction="mean"``) sums over this rank's counted targets, all-reduces
the sum and the count over the context group and returns their ratio: the value one process
would compute on the whole sequence, the same on every context rank, so ``self.log`` and the
run summary mean what they mean without context parallelism. The all-reduce is differentiable
(:class:`_SumOverGroup`): its backward sums the ranks' ``1/count`` into each
rank's own sum, and the gradient average over data × context (ZeRO's axis) divides by ``cp``
again, which leaves the gradient of the whole-sequence mean. Like the vocabulary-parallel loss
(``parallel/loss.py``), a scoped :class:`~torch.overrides.TorchFunctionMode`, not a
reassignment of ``F.cross_entropy``. A ``weight`` or ``label_smoothing`` argument is passed to
this rank's loss unchanged and its token mean taken as it is.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient: every rank's output depends on
    every rank's input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ContextMeanCrossEntropy(TorchFunctionMode):
    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func is not F.cross_entropy
            or kwargs.get("reduction", "mean") != "mean"
            or kwargs.get("weight") is not None
            or len(args) > 2
        ):
            return func(*args, **kwargs)
        target = args[1] if len(args) > 1 else kwargs["target"]
        total = func(*args, **{**kwargs, "reduction": "sum"})  # this rank's counted tokens
        counted = (target != kwargs.get("ignore_index", -100)).sum().to(total.dtype)
        both = _SumOverGroup.apply(torch.stack([total, counted.detach()]), self.group)
        return both[0] / both[1]


@contextmanager
def context_mean_loss(group: Any) -> Generator[None, None, None]:
    """``F.cross_entropy``'s token mean taken over the context ``group``'s tokens together."""
    with _ContextMeanCrossEntropy(group):
        yield
