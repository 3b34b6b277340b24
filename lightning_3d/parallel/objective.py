"""One process's objective in every layout: the token mean over the whole global batch.

One process computing ``F.cross_entropy`` on a batch divides the sum of the losses of every
counted target (every target that is not ``ignore_index``) by their number. Split over data
ranks, context chunks, pipeline micro-batches and accumulation steps, each part's own mean is a
different objective as soon as the parts hold different numbers of counted targets (chat data:
only the answers count; 37 and 105 of them on two ranks weigh each of the 37 almost three
times as much). transformers' Trainer has the same trap and answers it with
``num_items_in_batch``; here the answer is a :class:`~torch.overrides.TorchFunctionMode` around
the strategy's steps, so the module's code stays ``F.cross_entropy(logits, targets)``.

How, per call of ``F.cross_entropy`` (``reduction="mean"``, class-index targets, no ``weight``):

* this rank's sum ``S`` and count ``c`` of counted targets; one all-reduce of ``[S, c]`` over the
  ranks whose gradients are averaged (the data axis, or data × context: ZeRO's axis, of size
  ``G``) gives the micro-batch's global sum and count;
* the value returned is the token mean of everything the optimizer step has seen so far (at
  its last micro-batch: the global batch's mean, what one process logs);
* the gradient is that of ``S * G / ref``: the data-parallel average divides by ``G`` again,
  leaving ``sum / ref`` over every rank's tokens. ``ref`` is the first micro-batch's global
  count, a constant for the whole step, so accumulated micro-batches add up to
  ``sum / ref``; :meth:`TokenMean.factor` (``k * ref / count``, ``k`` the number the caller
  divided each loss by) turns that into ``sum / count`` at the step, before clipping.

A step with one micro-batch needs no factor (``ref`` is its count). A training step that calls
``F.cross_entropy`` more than once (two losses, each with its own tokens) cannot share one
factor: from then on each call is its own micro-batch's global mean (as under ddp across
accumulation steps). Evaluation takes the mean over the context group only (the whole
sequence's; the module weighs its data ranks' values itself).

A loss that never calls ``F.cross_entropy`` on whole logits (the chunked head and loss of
:mod:`lightning_3d.parallel.chunked_loss`) hands its sum and count to :func:`token_mean`, which
the same mode routes to the same :meth:`TokenMean.loss`: one objective, whichever way the
per-token losses were computed.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function

from lightning_3d.data.labels import IGNORE_INDEX


class TokenMean:
    """The running sums of one optimizer step's ``F.cross_entropy`` calls, on the device.

    ``group``: the ranks whose gradients are averaged (``None`` or a group of one: this rank
    alone). Call :meth:`begin` at every training step (``window=True`` at the first of an
    accumulation window), run the step inside :meth:`training`, and scale the gradients by
    :meth:`factor` before clipping."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.per_call = False  # sticky: a step with several losses was seen
        self._calls_per_step = 1
        self._aside = False
        self._reset()

    def _reset(self) -> None:
        self.calls = 0
        self.sum: Optional[torch.Tensor] = None  # fp64: counts stay exact past 2**24 tokens
        self.count: Optional[torch.Tensor] = None
        self.ref: Optional[torch.Tensor] = None
        self.adopted: Optional[torch.Tensor] = None  # a pipeline peer's [value, factor]
        self._calls_here = 0

    def begin(self, window: bool, calls_per_step: int = 1) -> None:
        """A training step starts; ``window``: the first of an accumulation window (forget the
        last window). ``calls_per_step``: the loss calls one step makes (a pipeline's
        micro-batches); more than that means several losses."""
        if window:
            self._reset()
        self._calls_here = 0
        self._calls_per_step = calls_per_step

    def reduced(self, total: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        """``[sum, count]`` of this micro-batch over the group (fp64, on ``total``'s device)."""
        both = torch.stack([total.detach().double(), counted.double()])
        if self.size > 1:
            dist.all_reduce(both, group=self.group)
        return both

    def loss(self, total: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        """The value and gradient the module's ``F.cross_entropy`` returns (see the module)."""
        if self._aside:  # not a step's loss: this rank's own mean, no collective
            return total / counted.clamp(min=1).to(total.dtype)
        both = self.reduced(total, counted)
        self.calls += 1
        self._calls_here += 1
        if self._calls_here > self._calls_per_step:
            self.per_call = True
        if self.sum is None or self.per_call:
            self.sum, self.count = both[0], both[1]
            self.ref = both[1].clamp(min=1)
        else:
            self.sum, self.count = self.sum + both[0], self.count + both[1]
        value = (self.sum / self.count.clamp(min=1)).to(total.dtype)
        weighted = total * (self.size / self.ref).to(total.dtype)
        return weighted + (value - weighted).detach()

    def value(self) -> Optional[torch.Tensor]:
        """The step's token mean so far (fp64, the same on every rank), or ``None`` before any
        call, or where a step holds several losses."""
        if self.adopted is not None:
            return self.adopted[0]
        if self.sum is None or self.per_call:
            return None
        return self.sum / self.count.clamp(min=1)

    def factor(self, divisor: int) -> Optional[torch.Tensor]:
        """What the step's accumulated gradients are multiplied by to become the gradient of
        the step's token mean: ``divisor * ref / count``, where ``divisor`` is what the caller
        divided each call's loss by (Lightning's ``k``; a pipeline's ``micro_batches * k``).
        ``None`` where nothing is to be done (one call, or several losses per step)."""
        if divisor == 1:
            return None
        if self.adopted is not None:
            return self.adopted[1]
        if self.per_call or self.count is None:
            return None
        return divisor * self.ref / self.count.clamp(min=1)

    def weigh(self, grads: list[torch.Tensor], divisor: int) -> None:
        """Multiply the step's local gradient tensors in place by :meth:`factor` (one multiply
        per device), if there is one."""
        factor = self.factor(divisor)
        if factor is None:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        for device, tensors in by_device.items():
            torch._foreach_mul_(tensors, factor.to(device))

    def adopt(self, told: torch.Tensor) -> None:
        """``[value, factor]`` of this step as another rank (a pipeline's last stage, which
        holds the loss) computed them."""
        self.adopted = told

    @contextmanager
    def aside(self) -> Generator[None, None, None]:
        """Calls that are no part of the step (a pipeline schedule's first run of the loss, to
        infer gradient shapes): this rank's own mean, counted nowhere."""
        self._aside = True
        try:
            yield
        finally:
            self._aside = False

    @contextmanager
    def training(self) -> Generator[None, None, None]:
        """``F.cross_entropy`` as :class:`TokenMean` describes, for a training step."""
        with _TokenMeanCrossEntropy(self.loss, self.summed):
            yield

    def summed(self, stats: torch.Tensor) -> tuple[torch.Tensor, int]:
        """:func:`batch_sum` inside a training step: ``stats`` summed over the group (this
        rank's alone for calls that are no part of the step), and the group's size."""
        total = stats.detach().clone()
        if self._aside or self.size == 1:
            return total, 1 if self._aside else self.size
        dist.all_reduce(total, group=self.group)
        return total, self.size


def group_mean(group: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The token mean over ``group``'s ranks together, value only (evaluation under context
    parallelism: a sequence's chunks on several ranks); a training loss needs :class:`TokenMean`."""
    one = TokenMean(group)

    def mean(total: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        both = one.reduced(total, counted)
        return (both[0] / both[1].clamp(min=1)).to(total.dtype)

    return mean


def token_mean(total: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """The mean of a loss given as ``total`` (the differentiable sum of this rank's per-token
    losses) over ``counted`` targets: ``total / counted`` on its own, and inside a strategy's
    step what ``F.cross_entropy`` returns there (:class:`TokenMean`: the global batch's token
    mean). Why an overridable function rather than a call to the strategy's objective: the
    module's code then needs no handle on the strategy, exactly as with ``F.cross_entropy``.

    Example::

        >>> token_mean(torch.tensor(6.0), torch.tensor(3))
        tensor(2.)
    """
    if has_torch_function((total, counted)):
        return handle_torch_function(token_mean, (total, counted), total, counted)
    return total / counted.clamp(min=1).to(total.dtype)


def batch_sum(stats: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``stats`` (no gradient) summed over the ranks whose gradients are averaged, and their
    number ``G``: inside a strategy's training step the data (or data × context) ranks', where
    :func:`token_mean` takes its counts from; on its own this rank's (``G`` = 1). For a loss
    that must see the global batch's statistics (a router's load balance) and, like the token
    mean, give ``G`` times this rank's share of the gradient.

    Example::

        >>> batch_sum(torch.tensor([1.0, 2.0]))
        (tensor([1., 2.]), 1)
    """
    if has_torch_function((stats,)):
        return handle_torch_function(batch_sum, (stats,), stats)
    return stats.detach().clone(), 1


class _TokenMeanCrossEntropy(TorchFunctionMode):
    """Hands a mean ``F.cross_entropy`` of class-index targets, and :func:`token_mean`, to
    ``loss(sum, count)``; every other torch call (and any other cross-entropy) runs as is."""

    def __init__(
        self,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        summed: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, int]]] = None,
    ) -> None:
        super().__init__()
        self._loss = loss
        self._summed = summed

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is token_mean:
            return self._loss(*args, **kwargs)
        if func is batch_sum:
            return self._summed(*args) if self._summed is not None else func(*args, **kwargs)
        if (
            func is not F.cross_entropy
            or kwargs.get("reduction", "mean") != "mean"
            or kwargs.get("weight") is not None
            or len(args) > 2
        ):
            return func(*args, **kwargs)
        target = args[1] if len(args) > 1 else kwargs["target"]
        if target.is_floating_point():  # class probabilities: no targets to count
            return func(*args, **kwargs)
        total = func(*args, **{**kwargs, "reduction": "sum"})  # this rank's counted tokens
        counted = (target != kwargs.get("ignore_index", IGNORE_INDEX)).sum()
        return self._loss(total, counted)


@contextmanager
def evaluation_mean(group: Any) -> Generator[None, None, None]:
    """``F.cross_entropy``'s token mean over ``group``'s tokens together (no gradient role)."""
    with _TokenMeanCrossEntropy(group_mean(group)):
        yield
