"""Reduce-scatter and all-gather as point-to-point exchanges, for gloo.

gloo's collectives are slow where the ring algorithms of NCCL are not: its all-gather gathers
into a buffer of its own and copies out of it (8.4 ms for 13 MB at N = 2, 19 ms where fresh
memory is mapped per call, against 4.3 / 5.5 ms point to point, received in place), and its
reduce-scatter takes ~1.7x its all-reduce of the same buffer. Sending row ``j`` of a buffer
to rank ``j`` (and adding the rows received to one's own), or one's slice to every peer,
moves the same (N-1)/N bytes per rank as a ring collective.

ZeRO 1-2 (``zero.py``) and ZeRO-3 (FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``, ``fsdp.py``) use them on gloo; NCCL keeps its collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_3d.compat import reduce_scatter_single

SCATTER_MODES = ("auto", "reduce_scatter", "point_to_point")


def use_point_to_point(group: Any, scatter: str) -> bool:
    """Whether ``scatter`` (one of :data:`SCATTER_MODES`) means point to point on ``group``:
    ``"auto"`` chooses it on gloo, the collectives elsewhere (and nothing to exchange alone)."""
    if scatter not in SCATTER_MODES:
        raise ValueError(f"scatter must be one of {list(SCATTER_MODES)}, got {scatter!r}")
    if dist.get_world_size(group) == 1:
        return False
    return scatter == "point_to_point" or (scatter == "auto" and dist.get_backend(group) == "gloo")


def exchange(
    group: Any, send: Callable[[int], Tensor], receive: Callable[[int], Tensor]
) -> _Exchange:
    """Point-to-point over ``group``, with every other rank ``peer`` (group ranks): ``send(peer)``
    to it and its message into ``receive(peer)``, started together (every rank posts them in
    the same order, so each send meets its receive); the returned handle's ``wait()`` ends them."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ops = []
    for peer in range(size):
        if peer != rank:
            where = dist.get_global_rank(group, peer) if group is not None else peer
            ops.append(dist.P2POp(dist.isend, send(peer), where, group))
            ops.append(dist.P2POp(dist.irecv, receive(peer), where, group))
    return _Exchange(dist.batch_isend_irecv(ops))


@dataclass(frozen=True)
class _Exchange:
    """The works of one batch of point-to-point operations, waited for together."""

    works: list

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def scatter_rows(group: Any, rows: Tensor) -> tuple[_Exchange, Tensor]:
    """Start sending row ``j`` of ``rows`` (one row per group rank) to rank ``j``. Returns the
    handle and the buffer the other ranks' rows for this rank land in (one row per peer, in
    rank order); :func:`add_rows` sums them with this rank's own row once the handle is waited."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = rows.new_empty((size - 1, rows.shape[1]))
    handle = exchange(
        group,
        lambda peer: rows[peer],
        lambda peer: received[peer if peer < rank else peer - 1],
    )
    return handle, received


def gather_rows(group: Any, rows: Tensor) -> _Exchange:
    """Start sending this rank's row of ``rows`` to every peer, theirs received in place."""
    rank = dist.get_rank(group)
    return exchange(group, lambda peer: rows[rank], lambda peer: rows[peer])


def add_rows(own: Tensor, received: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``own`` plus every row of ``received`` (:func:`scatter_rows`), into ``out`` (default:
    ``own``, in place); one pass where there is one peer."""
    out = own if out is None else out
    torch.add(own, received[0], out=out)
    for row in received[1:]:
        out.add_(row)
    return out


class _PlainBuffers:
    """FSDP2's buffers for a custom exchange: plain tensors (no backend-allocated memory)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class GatherInPlace(_PlainBuffers):
    """FSDP2's all-gather as an exchange (``FSDPModule.set_custom_all_gather``).

    FSDP2 copies each rank's shards into that rank's row of the output and passes the row as the
    input: the row goes to every peer, and the peers' rows land in their places. The exchange
    has finished when the call returns (FSDP2 waits only for a ``Work`` it is given)."""

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False
    ) -> None:
        gather_rows(group, output_tensor.view(-1, input_tensor.numel())).wait()


class ScatterToOwners(_PlainBuffers):
    """FSDP2's reduce-scatter as an exchange (``FSDPModule.set_custom_reduce_scatter``).

    Row ``j`` of the input goes to rank ``j``; the rows received are added to this rank's own.
    Sums, and averages (FSDP2 asks for one in fp32 and bf16: the sum divided on the 1/N this
    rank holds); any other operation goes to the collective."""

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        average = op == dist.ReduceOp.AVG
        if not (average or op == dist.ReduceOp.SUM):
            reduce_scatter_single(output_tensor, input_tensor, group=group, op=op)
            return
        size = dist.get_world_size(group)
        rows = input_tensor.view(size, -1)
        handle, received = scatter_rows(group, rows)
        handle.wait()
        add_rows(rows[dist.get_rank(group)], received, out=output_tensor)
        if average:
            output_tensor.div_(size)
