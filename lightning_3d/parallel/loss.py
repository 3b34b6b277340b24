"""Cross-entropy on vocab-sharded logits, returning a plain tensor the user's code can use.

With a loss-parallel LM head the logits are a ``DTensor`` sharded on the vocabulary, so full
logits never exist on one rank. PyTorch's ``loss_parallel()`` makes ``F.cross_entropy`` work on
them (a max and a sum-exp all-reduced across ``tp`` instead of gathering logits), but returns a
replicated ``DTensor``, which torchmetrics and other plain-tensor code refuse to mix with. Inside
:func:`vocab_parallel_loss`, ``F.cross_entropy`` of a ``DTensor`` returns the local (identical on
every tp rank) value as a plain, differentiable tensor. The loss's backward must run inside the
context too.

How: a :class:`~torch.overrides.TorchFunctionMode`, torch's scoped extension point, not a
reassignment of ``F.cross_entropy``. ``F.cross_entropy`` asks ``has_torch_function_variadic``
first, which is true whenever a mode is active (a ``DTensor`` alone would not do: it disables
``__torch_function__``), and then hands the call to the innermost mode. The mode is per thread
and popped on exit, so no other thread or later code sees it, and ``F.cross_entropy`` stays the
very function torch defines (``nn.CrossEntropyLoss`` calls it, so it is covered too). The cost:
every torch call inside the context passes through one Python method that forwards it unchanged.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.overrides import TorchFunctionMode


class _LocalCrossEntropy(TorchFunctionMode):
    """Runs every torch call as is; a ``DTensor`` result of ``F.cross_entropy`` comes back as
    its local tensor (``to_local`` is differentiable: gradients flow back into the DTensor)."""

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        # While this runs, torch has popped the mode: calls made here dispatch normally.
        out = func(*args, **(kwargs or {}))
        if func is F.cross_entropy and isinstance(out, DTensor):
            return out.to_local()
        return out


@contextmanager
def vocab_parallel_loss() -> Generator[None, None, None]:
    """``loss_parallel()``, with ``F.cross_entropy`` of a ``DTensor`` returning a plain tensor."""
    with loss_parallel(), _LocalCrossEntropy():
        yield


def plain_loss(output: Any) -> Any:
    """A replicated DTensor loss (from ``loss_parallel``) as a plain tensor, keeping its graph."""
    if isinstance(output, DTensor):
        return output.full_tensor()
    if isinstance(output, dict) and isinstance(output.get("loss"), DTensor):
        return {**output, "loss": output["loss"].full_tensor()}
    return output
