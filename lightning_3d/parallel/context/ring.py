"""Ring attention over the context ranks, forward and backward, on any backend (gloo included).

Each rank keeps its queries and passes its keys and values round the ring: at step ``s`` rank
``r`` holds the k/v of rank ``r - s`` and attends its two query chunks to that rank's two key
chunks where the causal mask allows (a key chunk before the query chunk: in full; the same
chunk: under the triangle; a later chunk: not at all — with the load-balanced chunks that is
two of the four pairs at every step but the first). Partial results merge by their
log-sum-exp, as FlashAttention merges tiles. The next k/v block is on the wire while this one is
computed.

The backward passes k/v round again with their gradients following them: each rank adds what
its queries contribute to the block it holds, then hands block and gradient on; after ``cp``
hand-overs every gradient is home. Per rank and attention call, with ``n = B · Hkv · T/cp · D``
elements of each of k and v (``Hkv`` key/value heads: fewer than the query heads under
grouped-query attention, whose k/v travel unrepeated): forward sends ``2 n (cp - 1)`` elements, backward
``2 n (cp - 1) + 2 n cp``. Memory: one extra k/v block in flight, the saved output and the
log-sum-exp per query (``T/cp`` scores per head), not the ``T × T`` score matrix.

Packed rows (several documents per row) pass ``documents``, each token's document id over the
whole sequence (every rank has it): a query then sees a key only where the causal mask allows
and both are of the same document; a pair of chunks with no such key is computed all the same
(skipping it would read the pair's mask on the host, a device sync on a GPU). A query with no
key in a block gets nothing from it (the merge keeps
``-inf`` out of its exponents); every query sees itself, so none is left with no key at all.

(``torch.distributed.tensor.experimental.context_parallel`` does this on CUDA devices with NCCL
through SDPA's flash / efficient kernels; it does not run on CPU tensors, hence this one.)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_3d.parallel.context.chunks import chunk_ids


class _Pass:
    """One hand-over round the ring: ``tensor`` to the next rank, the previous rank's in."""

    def __init__(self, tensor: Tensor, group: Any) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.received = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        ops = [
            dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group),
            dist.P2POp(
                dist.irecv, self.received, dist.get_global_rank(group, (rank - 1) % size), group
            ),
        ]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        return self.received


def _scores(
    q: Tensor, k: Tensor, scale: float, causal: bool, apart: Optional[Tensor] = None
) -> Tensor:
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, c, c)
    if causal:  # the same chunk: a query sees the keys up to its own position
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    if apart is not None:  # (B, 1, c, c): query and key of different documents
        batch, pairs = apart.shape[0], apart.shape[-2:]
        s = s.masked_fill(apart.view(batch, *[1] * (s.dim() - 3), *pairs), float("-inf"))
    return s


def _apart(documents: Optional[Tensor], a: int, b: int, chunk: int) -> Optional[Tensor]:
    """(B, 1, c, c): where query chunk ``a``'s tokens and key chunk ``b``'s are of different
    documents (``None`` without documents)."""
    if documents is None:
        return None
    qd, kd = documents[:, a * chunk : (a + 1) * chunk], documents[:, b * chunk : (b + 1) * chunk]
    return (qd.unsqueeze(-1) != kd.unsqueeze(-2)).unsqueeze(1)


def _blocks(
    rank: int, source: int, size: int, documents: Optional[Tensor], chunk: int
) -> list[tuple[int, int, bool, Optional[Tensor]]]:
    """:func:`_pairs` with each pair's document mask. A pair the mask hides whole is computed
    too (its queries gain nothing: their rows stay -inf): skipping it would mean reading the
    mask on the host, on a GPU a wait for the device at every pair of every layer."""
    a, b = chunk_ids(rank, size), chunk_ids(source, size)
    return [
        (i, j, causal, _apart(documents, a[i], b[j], chunk))
        for i, j, causal in _pairs(rank, source, size)
    ]


def _pairs(rank: int, source: int, size: int) -> list[tuple[int, int, bool]]:
    """``(query chunk, key chunk, causal)`` local indices of the pairs the mask lets through."""
    return [
        (i, j, a == b)
        for i, a in enumerate(chunk_ids(rank, size))
        for j, b in enumerate(chunk_ids(source, size))
        if b <= a
    ]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        group: Any,
        scale: float,
        documents: Optional[Tensor],
    ) -> Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        chunk = q.shape[-2] // 2
        dtype = q.dtype
        # fp32 at least (bf16/fp16 inputs), fp64 kept (the family matrix's fp64 judgement).
        work = torch.promote_types(dtype, torch.float32)
        q32 = q.to(work)
        queries = q32.chunk(2, dim=-2)  # (B, H, c, D) each: this rank's two chunks
        out = [torch.zeros_like(c) for c in queries]
        lse = [
            torch.full(c.shape[:-1], float("-inf"), device=q.device, dtype=work) for c in queries
        ]
        kv = torch.stack([k.to(work), v.to(work)])  # (2, B, H, 2c, D): one message per step
        for step in range(size):
            sending = _Pass(kv, group) if step < size - 1 else None
            keys, values = kv[0].chunk(2, dim=-2), kv[1].chunk(2, dim=-2)
            for i, j, causal, apart in _blocks(rank, (rank - step) % size, size, documents, chunk):
                s = _scores(queries[i], keys[j], scale, causal, apart)
                block_lse = s.logsumexp(-1)  # (B, H, c); -inf for a query no key is left to
                block = torch.exp(s - _finite(block_lse).unsqueeze(-1)) @ values[j]
                merged = torch.logaddexp(lse[i], block_lse)
                base = _finite(merged)  # both -inf: the query has seen no key yet
                out[i] = out[i] * torch.exp(lse[i] - base).unsqueeze(-1) + block * torch.exp(
                    block_lse - base
                ).unsqueeze(-1)
                lse[i] = merged
            if sending is not None:
                kv = sending.wait()
        output = torch.cat(out, dim=-2)
        ctx.save_for_backward(q, k, v, output, torch.cat(lse, dim=-1))  # q as given: no fp32 copy
        ctx.group, ctx.scale, ctx.dtype, ctx.documents = group, scale, dtype, documents
        return output.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, output, lse = ctx.saved_tensors
        work = output.dtype  # the forward's working precision
        q32 = q.to(work)
        group, scale = ctx.group, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        grad = grad.to(work)
        delta = (grad * output).sum(-1)  # (B, H, 2c): rowsum(dO ∘ O), softmax's backward term
        queries, grads = q32.chunk(2, dim=-2), grad.chunk(2, dim=-2)
        lses, deltas = lse.chunk(2, dim=-1), delta.chunk(2, dim=-1)
        dq = [torch.zeros_like(c) for c in queries]
        kv = torch.stack([k.to(work), v.to(work)])
        dkv = torch.zeros_like(kv)  # the gradient of the block held now; travels with it
        for step in range(size):
            sending = _Pass(kv, group) if step < size - 1 else None
            keys, values = kv[0].chunk(2, dim=-2), kv[1].chunk(2, dim=-2)
            dk, dv = list(dkv[0].chunk(2, dim=-2)), list(dkv[1].chunk(2, dim=-2))
            for i, j, causal, apart in _blocks(
                rank, (rank - step) % size, size, ctx.documents, q.shape[-2] // 2
            ):
                s = _scores(queries[i], keys[j], scale, causal, apart)
                p = torch.exp(s - lses[i].unsqueeze(-1))  # every query saw itself: lse finite
                # A k/v head's gradient sums over the query heads of its group (sum_to_size).
                dv[j] = dv[j] + (p.transpose(-2, -1) @ grads[i]).sum_to_size(dv[j].shape)
                ds = p * (grads[i] @ values[j].transpose(-2, -1) - deltas[i].unsqueeze(-1))
                dq[i] = dq[i] + (ds @ keys[j]) * scale
                dk[j] = dk[j] + ((ds.transpose(-2, -1) @ queries[i]) * scale).sum_to_size(
                    dk[j].shape
                )
            # After the last step's hand-over, each rank holds its own block's gradient.
            dkv = _Pass(torch.stack([torch.cat(dk, dim=-2), torch.cat(dv, dim=-2)]), group).wait()
            if sending is not None:
                kv = sending.wait()
        dq_all = torch.cat(dq, dim=-2).to(ctx.dtype)
        return dq_all, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _finite(x: Tensor) -> Tensor:
    """``x`` with ``-inf`` as 0: an exponent's base where no key has been seen."""
    return x.masked_fill(x == float("-inf"), 0.0)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Any,
    scale: Optional[float] = None,
    documents: Optional[Tensor] = None,
) -> Tensor:
    """Causal attention of this rank's load-balanced tokens over the whole sequence.

    ``q``: (B, H, T/cp, D), this rank's two chunks (:mod:`.chunks`); ``k``, ``v``: (B, Hkv,
    T/cp, D), ``Hkv`` dividing ``H`` (grouped-query attention: query head ``h`` reads k/v head
    ``h // (H/Hkv)``, as ``repeat_interleave`` lays them out). Only the ``Hkv`` heads travel
    round the ring. ``documents``: (B, T), each token's document over the whole sequence
    (``None``: one per row); a query sees only earlier keys of its own document. Returns
    (B, H, T/cp, D): what full attention under that mask gives at these positions. A
    collective over ``group``: every context rank calls it.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, T, D = q.shape
    kv_heads = k.shape[1]
    if H % kv_heads:
        raise ValueError(f"{H} query heads do not divide into {kv_heads} key/value heads")
    # Grouped: (B, Hkv, H/Hkv, T, D) queries against (B, Hkv, 1, T, D) k/v, by broadcasting.
    grouped = q.reshape(B, kv_heads, H // kv_heads, T, D)
    out = _RingAttention.apply(grouped, k.unsqueeze(2), v.unsqueeze(2), group, scale, documents)
    return out.reshape(B, H, T, D)
