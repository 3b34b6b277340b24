"""Which tokens of a sequence each context rank holds: the load-balanced split.

With ``cp`` ranks the sequence is cut into ``2 × cp`` equal chunks and rank ``r`` holds chunks
``r`` and ``2 cp - 1 - r``, in that order. Under a causal mask a chunk's attention costs grow
with its index; pairing a chunk from each end gives every rank the same work (a plain split in
``cp`` pieces would leave the last rank ``2 cp - 1`` times the first's). For ``cp=2`` and eight
tokens: rank 0 holds positions 0 1 6 7, rank 1 holds 2 3 4 5.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def check_sequence(length: int, size: int) -> None:
    """``ValueError`` naming both numbers unless ``2 × size`` divides ``length``."""
    if length % (2 * size):
        raise ValueError(
            f"sequence length {length} is not divisible by 2 * context ({2 * size}): context "
            f"parallelism cuts each sequence into {2 * size} equal chunks"
        )


def chunk_ids(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of ``2 × size``) that context rank ``rank`` holds, in its order."""
    return rank, 2 * size - 1 - rank


def local_positions(length: int, rank: int, size: int, device=None) -> Tensor:
    """Where the ``length // size`` tokens ``rank`` holds sit in the sequence, (T_local,)."""
    check_sequence(length, size)
    chunk = length // (2 * size)
    return torch.cat(
        [torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(rank, size)]
    )


def shard_sequence(tensor: Tensor, rank: int, size: int, dim: int = 1) -> Tensor:
    """This rank's tokens of ``tensor`` along ``dim`` (its two chunks, concatenated)."""
    check_sequence(tensor.shape[dim], size)
    chunks = tensor.chunk(2 * size, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, size)], dim=dim)


def natural_order(size: int) -> list[int]:
    """Chunks as every rank's two, concatenated in rank order, ``[0, 2N-1, 1, 2N-2, ...]``: the
    ``k``-th chunk of the concatenation is chunk ``natural_order(size)[k]`` of the sequence."""
    return [c for rank in range(size) for c in chunk_ids(rank, size)]


def unshard_sequence(shards: list[Tensor], dim: int = 1) -> Tensor:
    """The whole sequence from every rank's :func:`shard_sequence` (in rank order)."""
    size = len(shards)
    pieces = [piece for shard in shards for piece in shard.chunk(2, dim=dim)]
    order = natural_order(size)
    return torch.cat([pieces[order.index(c)] for c in range(2 * size)], dim=dim)


def gather_sequence(local: Tensor, group: Any, dim: int = 1) -> Tensor:
    """The whole sequence on every rank of ``group`` from each rank's :func:`shard_sequence`
    (not differentiable: for outputs such as predictions)."""
    import torch.distributed as dist

    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    return unshard_sequence(shards, dim)
