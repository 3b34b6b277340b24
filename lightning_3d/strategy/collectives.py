"""The collectives Lightning asks a strategy for, over ``torch.distributed``'s default group.

A mixin for :class:`~lightning_3d.strategy.three_d.ThreeDStrategy`; it uses only the strategy's public
``root_device``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch import Tensor


class Collectives:
    root_device: Any

    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(
        self,
        tensor: Any,
        group: Optional[Any] = None,
        reduce_op: Optional[Union[str, Any]] = "mean",
    ) -> Any:
        if isinstance(tensor, Tensor):
            if _distributed_is_initialized() and dist.get_world_size(group) == 1:
                # Lightning's reduce would still barrier and all-reduce (a device sync on NCCL). It
                # reduces in place and returns its input too, so callers see the same object either way.
                return tensor
            if _distributed_is_initialized():
                return _all_reduce(tensor, group, reduce_op)
        return tensor


def _all_reduce(
    tensor: Tensor, group: Optional[Any], reduce_op: Optional[Union[str, Any]]
) -> Tensor:
    """Lightning's ``_sync_ddp`` (in place; "mean"/"avg" as SUM and a division on gloo) without
    its barrier before the all-reduce: collectives on one group start in the same order on
    every rank anyway, so the barrier only adds a round trip to every reduction."""
    group = dist.group.WORLD if group is None else group
    mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
    if mean and dist.get_backend(group) == "gloo":  # gloo has no AVG
        op = dist.ReduceOp.SUM
    elif isinstance(reduce_op, str):
        op = dist.ReduceOp.AVG if mean else getattr(dist.ReduceOp, reduce_op.upper())
    else:
        op = reduce_op if reduce_op is not None else dist.ReduceOp.SUM
    dist.all_reduce(tensor, op=op, group=group)
    if not (mean and op == dist.ReduceOp.SUM):
        return tensor
    size = dist.get_world_size(group)
    return tensor.copy_(tensor / size) if not torch.is_floating_point(tensor) else tensor.div_(size)
