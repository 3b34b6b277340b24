"""Routing a model's attention through context parallelism, and splitting its batches.

:func:`apply_context_parallel` gives every attention layer that accepts it (an attribute
``context_attention``, which the reference GPT's layers and embedding carry, and the Hugging Face
attention modules through transformers' attention interface) the same
:class:`~lightning_3d.parallel.context.attention.ContextAttention`; a model with no such layer is
refused with its name. :func:`shard_batch` keeps this rank's tokens of every sequence tensor of a
batch.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_3d.parallel.context.attention import ATTR, ContextAttention
from lightning_3d.parallel.context.chunks import shard_sequence


def apply_context_parallel(module: nn.Module, group: Any, scheme: str) -> ContextAttention:
    """Set ``module``'s attention layers (and its embedding's positions) to run across the
    context ``group`` by ``scheme``, in place; returns the attention object they share."""
    attend = ContextAttention(group, scheme)
    routed = []
    for name, sub in module.named_modules():
        if not hasattr(sub, ATTR):
            continue
        dropout = getattr(sub, "dropout", 0.0)
        if isinstance(dropout, float) and dropout > 0:
            raise ValueError(
                f"{name}: attention dropout {dropout} under context parallelism (the kernels "
                f"run attention without dropout); set attn_dropout=0"
            )
        setattr(sub, ATTR, attend)
        routed.append(name)
    if not routed:
        raise ValueError(
            f"{type(module).__name__} has no attention layer context parallelism can route "
            f"(the reference GPT's, or a Hugging Face model's); context must be 1 for it"
        )
    return attend


def shard_batch(batch: Any, rank: int, size: int) -> Any:
    """This rank's tokens of every tensor of ``batch`` with a sequence dim (dim 1 of each tensor
    of two or more dims, the same length as the first such tensor's), the rest as it is."""
    lengths = []
    apply_to_collection(batch, Tensor, lambda t: lengths.append(t.shape[1]) if t.dim() > 1 else 0)
    if not lengths:
        return batch

    def shard(t: Tensor) -> Tensor:
        return shard_sequence(t, rank, size) if t.dim() > 1 and t.shape[1] == lengths[0] else t

    return apply_to_collection(batch, Tensor, shard)
