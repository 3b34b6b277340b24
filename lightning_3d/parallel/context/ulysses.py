"""All-to-all attention over the context ranks (DeepSpeed-Ulysses).

Before attention each rank holds all heads of its ``T/cp`` tokens; one all-to-all per tensor
gives it ``H/cp`` heads of all ``T`` tokens, causal attention runs on whole sequences for those
heads, and one all-to-all turns the output back. The all-to-all is its own adjoint (equal
splits), so the backward is the same two exchanges in reverse. Needs ``H`` divisible by ``cp``
(by ``cp × tp`` under tensor parallelism, where each rank holds ``H/tp`` heads). Per rank and
attention call, with ``n = B · H · T/cp · D``: forward sends ``4 n (cp - 1)/cp`` elements (q, k,
v in, the output back), backward the same, less for grouped-query k/v, which travel with the
fewest heads ``cp`` divides (``Hkv`` itself where it does: then ``(2 + 2 Hkv/H) n (cp - 1)/cp``);
attention's own memory is that of ``H/cp`` heads of the whole sequence.

Packed rows pass ``documents`` (each token's document over the whole sequence): attention then
runs under the dense block-causal mask, ``(B, 1, T, T)``, instead of ``is_causal``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_3d.parallel.context.chunks import natural_order


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 (equal splits: slice ``j`` to rank ``j``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def check_heads(heads: int, size: int) -> None:
    """``ValueError`` naming both numbers unless ``size`` divides ``heads``."""
    if heads % size:
        raise ValueError(
            f"context_scheme='alltoall' needs the attention heads on a rank ({heads}) divisible "
            f"by context ({size}); use context_scheme='ring' or another context size"
        )


def _to_heads(x: Tensor, size: int, group: Any) -> Tensor:
    """(B, H, T/cp, D) of this rank's tokens -> (B, H/cp, T, D) in sequence order."""
    B, H, T_local, D = x.shape
    x = x.reshape(B, size, H // size, T_local, D).transpose(0, 1)  # (cp, B, H/cp, T/cp, D)
    x = _AllToAll.apply(x, group)  # slice j: rank j's tokens of this rank's heads
    x = x.permute(1, 2, 0, 3, 4).reshape(B, H // size, 2 * size, T_local // 2, D)
    order = natural_order(size)  # chunk k of the rank-order concatenation is chunk order[k]
    return _chunks_in(x, [order.index(c) for c in range(2 * size)]).flatten(2, 3)  # (B, H/cp, T, D)


def _to_tokens(x: Tensor, size: int, group: Any) -> Tensor:
    """The inverse of :func:`_to_heads`: (B, H/cp, T, D) -> (B, H, T/cp, D)."""
    B, h, T, D = x.shape
    x = _chunks_in(x.reshape(B, h, 2 * size, T // (2 * size), D), natural_order(size))
    x = x.reshape(B, h, size, T // size, D).permute(2, 0, 1, 3, 4)  # (cp, B, H/cp, T/cp, D)
    x = _AllToAll.apply(x, group)  # slice j: head group j of this rank's tokens
    return x.transpose(0, 1).reshape(B, h * size, T // size, D)


def _chunks_in(x: Tensor, order: list[int]) -> Tensor:
    """``x``'s chunks (dim 2) in ``order``, by slicing: indexing with a list would copy the
    list to the device as an index tensor, a wait for the device on a GPU at every call."""
    return torch.stack([x[:, :, i] for i in order], dim=2)


def kv_repeat(heads: int, kv_heads: int, size: int) -> int:
    """How many times each of ``kv_heads`` key/value heads is repeated before the exchange: the
    fewest (a divisor of ``heads / kv_heads``) that leaves a head count ``size`` divides, so
    query head ``h`` still reads k/v head ``h // (heads / kv_heads)`` on the rank holding it."""
    group = heads // kv_heads
    return next(r for r in range(1, group + 1) if group % r == 0 and (kv_heads * r) % size == 0)


def document_causal_mask(documents: Tensor) -> Tensor:
    """(B, 1, T, T), ``True`` where a query may see a key: an earlier or the same position of
    the same document. ``documents``: (B, T), each token's document."""
    T = documents.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return (causal & (documents.unsqueeze(-1) == documents.unsqueeze(-2))).unsqueeze(1)


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Any,
    scale: Optional[float] = None,
    documents: Optional[Tensor] = None,
) -> Tensor:
    """Causal attention of this rank's load-balanced tokens over the whole sequence.

    ``q``: (B, H, T/cp, D), this rank's two chunks (:mod:`.chunks`); ``k``, ``v``: (B, Hkv,
    T/cp, D), ``Hkv`` dividing ``H`` (grouped-query attention, as ``repeat_interleave`` lays the
    heads out). ``documents``: (B, T), each token's document over the whole sequence
    (``None``: one per row); a query sees only earlier keys of its own document. Returns
    (B, H, T/cp, D). A collective over ``group``.
    """
    size = dist.get_world_size(group)
    check_heads(q.shape[1], size)
    # Grouped-query k/v travel with as few heads as split evenly over the ranks, and are
    # repeated to the query heads only after the exchange.
    repeat = kv_repeat(q.shape[1], k.shape[1], size)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    q, k, v = (_to_heads(t, size, group) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:  # each rank's k/v heads serve its query heads in groups
        group_size = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)
    if documents is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:  # the whole sequence is here: the whole block-causal mask
        mask = document_causal_mask(documents)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return _to_tokens(y, size, group)  # from (B, H/cp, T, D)
