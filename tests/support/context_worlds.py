"""Rank functions of the context-parallel kernel tests (run_world imports them by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_3d.parallel.context.attention import ContextAttention
from lightning_3d.parallel.context.chunks import shard_sequence


def documents_of(lengths: list[list[int]]) -> torch.Tensor:
    """(B, T) document ids of rows packed with documents of ``lengths`` (one list per row)."""
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])


def kernel_against_full_attention(
    rank: int, scheme: str, shape: tuple, kv_heads: int, lengths: list | None = None
) -> dict:
    """Full causal attention on one process vs ``scheme`` over the world: this rank's outputs
    and gradients (of q, k, v) against the same positions of the full ones; max abs errors.
    ``lengths``: packed rows' document lengths (one list per row); the reference then masks
    by a dense block-causal mask, the kernel is given the document ids."""
    dist.init_process_group("gloo")
    size = dist.get_world_size()
    B, H, T, D = shape
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, T, D, generator=generator, requires_grad=True)
    k = torch.randn(B, kv_heads, T, D, generator=generator, requires_grad=True)
    v = torch.randn(B, kv_heads, T, D, generator=generator, requires_grad=True)
    weight = torch.randn(B, H, T, D, generator=generator)  # loss = sum(out * weight)
    repeat = H // kv_heads
    documents = None if lengths is None else documents_of(lengths)
    allowed = torch.ones(T, T, dtype=torch.bool).tril().expand(B, 1, T, T)
    if documents is not None:  # dense block-causal: earlier keys of the query's own document
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    full = F.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), attn_mask=allowed
    )
    (full * weight).sum().backward()

    def mine(t):
        return shard_sequence(t.detach(), rank, size, dim=2).requires_grad_()

    ql, kl, vl = mine(q), mine(k), mine(v)
    out = ContextAttention(dist.group.WORLD, scheme)(ql, kl, vl, documents=documents)
    (out * shard_sequence(weight, rank, size, dim=2)).sum().backward()
    errors = {
        "out": (out - shard_sequence(full, rank, size, dim=2)).abs().max().item(),
        "dq": (ql.grad - shard_sequence(q.grad, rank, size, dim=2)).abs().max().item(),
        # k/v gradients sum the contributions of every rank's queries: all-reduce to compare.
    }
    for name, local, whole in (("dk", kl, k), ("dv", vl, v)):
        errors[name] = (local.grad - shard_sequence(whole.grad, rank, size, dim=2)).abs().max()
        errors[name] = errors[name].item()
    return errors


def packed_rows_against_their_conversations(rank: int, scheme: str, rows: list) -> float:
    """Rows packed with conversations of ``rows``' lengths (one list per row; positions
    restarting at 0 for each, as ``data=chat`` packs them) cut by
    :func:`~lightning_3d.parallel.context.batch.shard_batch`, and the kernel given the
    ``document_ids`` it keeps (``None`` if it keeps none), against each conversation attended
    alone on one process; max abs error of this rank's outputs."""
    from lightning_3d.parallel.context.batch import shard_batch

    dist.init_process_group("gloo")
    size = dist.get_world_size()
    positions = torch.tensor([[p for n in row for p in range(n)] for row in rows])
    B, T = positions.shape
    mine = shard_batch(
        {"input_ids": torch.zeros(B, T, dtype=torch.long), "position_ids": positions}, rank, size
    )
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, 2, T, 8, generator=generator) for _ in range(3))
    alone = []  # each conversation of each row on its own, causal
    for b, row in enumerate(rows):
        ends = torch.tensor(row).cumsum(0).tolist()
        parts = [
            F.scaled_dot_product_attention(
                *(t[b : b + 1, :, e - n : e] for t in (q, k, v)), is_causal=True
            )
            for n, e in zip(row, ends)
        ]
        alone.append(torch.cat(parts, dim=2))
    expected = shard_sequence(torch.cat(alone), rank, size, dim=2)
    local = (shard_sequence(t, rank, size, dim=2) for t in (q, k, v))
    out = ContextAttention(dist.group.WORLD, scheme)(*local, documents=mine.get("document_ids"))
    return (out - expected).abs().max().item()


def bf16_kernel_runs(rank: int, scheme: str) -> float:
    """The kernel on bf16 inputs: outputs and gradients in bf16, close to fp32 attention."""
    dist.init_process_group("gloo")
    size = dist.get_world_size()
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 8 * size, 8, generator=generator) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    local = [shard_sequence(t, rank, size, dim=2).bfloat16().requires_grad_() for t in (q, k, v)]
    out = ContextAttention(dist.group.WORLD, scheme)(*local)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in local)
    return (out.float() - shard_sequence(full, rank, size, dim=2)).abs().max().item()


def kernel_elements_sent(rank: int, scheme: str, shape: tuple, kv_heads: int) -> int:
    """Elements this rank sends through the kernel's exchanges (ring hand-overs, all-to-alls)
    in one forward and backward of ``shape`` queries against ``kv_heads`` k/v heads."""
    dist.init_process_group("gloo")
    size = dist.get_world_size()
    B, H, T, D = shape
    sent = [0]
    p2p, all_to_all = dist.P2POp, dist.all_to_all_single

    def counted_p2p(op, tensor, *args, **kwargs):
        if op is dist.isend:
            sent[0] += tensor.numel()
        return p2p(op, tensor, *args, **kwargs)

    def counted_all_to_all(output, input, *args, **kwargs):
        sent[0] += input.numel() * (size - 1) // size  # the slices that leave this rank
        return all_to_all(output, input, *args, **kwargs)

    dist.P2POp, dist.all_to_all_single = counted_p2p, counted_all_to_all
    try:
        q = torch.randn(B, H, T // size, D, requires_grad=True)
        k, v = (torch.randn(B, kv_heads, T // size, D, requires_grad=True) for _ in range(2))
        ContextAttention(dist.group.WORLD, scheme)(q, k, v).sum().backward()
    finally:
        dist.P2POp, dist.all_to_all_single = p2p, all_to_all
    return sent[0]


def assert_matches_one_process(
    ranks: list, reference: dict, logged: bool = True, atol: float = 1e-5
) -> None:
    """Context-parallel ranks against one process: rank 0's losses, every rank's every weight
    tensor (each within a relative error of 1e-5 and a largest difference of ``atol``), and
    (``logged``) the loss each rank's ``self.log`` saw, the whole sequence's."""
    import pytest

    from tools.harness.parity import assert_same_run, rank_state_mismatches

    assert_same_run(ranks[0], reference, atol=atol)
    assert rank_state_mismatches(ranks, reference, atol=atol) == []
    if logged:
        for rank in ranks:
            assert rank["local_losses"] == pytest.approx(reference["losses"], rel=1e-5)
