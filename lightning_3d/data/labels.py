"""The label convention every batch follows: Hugging Face's unshifted ``labels``, ``-100`` where a
position has no target, shifted by one where the loss is taken.

The chat rows (:mod:`.chat_layout`) write it, the Hugging Face module's loss
(:mod:`lightning_3d.models.hf`) and the context-parallel split
(:mod:`lightning_3d.parallel.context.batch`) read it, so it lives here, below both.

Example::

    shifted_targets(torch.tensor([[5, 6, 7]]), None)  # tensor([[6, 7, -100]])
"""

from __future__ import annotations

from typing import Optional

import torch

IGNORE_INDEX = -100  # Hugging Face's (and F.cross_entropy's) "no target here"


def shifted_targets(labels: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Hugging Face-style ``labels`` (B, T) as targets: padding (``mask == 0``) unlabelled, then
    shifted by one (position ``t`` predicts ``t + 1``; the last has no target)."""
    if mask is not None:
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)
