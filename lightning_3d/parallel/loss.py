"""Cross-entropy on vocab-sharded logits, returning a plain tensor the user's code can use.

With a loss-parallel LM head the logits are a ``DTensor`` sharded on the vocabulary, so full
logits never exist on one rank. PyTorch's ``loss_parallel()`` makes ``F.cross_entropy`` work on
them (a max and a sum-exp all-reduced across ``tp`` instead of gathering logits), but returns a
replicated ``DTensor``, which torchmetrics and other plain-tensor code refuse to mix with. Inside
:func:`vocab_parallel_loss`, ``F.cross_entropy`` of a ``DTensor`` returns the local (identical on
every tp rank) value as a plain, differentiable tensor. The loss's backward must run inside the
context too.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


@contextmanager
def vocab_parallel_loss() -> Generator[None, None, None]:
    original = F.cross_entropy

    def cross_entropy(input, target, *args, **kwargs):
        loss = original(input, target, *args, **kwargs)
        return loss.to_local() if isinstance(loss, DTensor) else loss

    with loss_parallel():
        F.cross_entropy = cross_entropy
        try:
            yield
        finally:
            F.cross_entropy = original
