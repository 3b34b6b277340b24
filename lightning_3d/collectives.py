"""The collectives Lightning asks a strategy for, over ``torch.distributed``'s default group.

A mixin for :class:`~lightning_3d.strategy.three_d.ThreeDStrategy`; it uses only the strategy's public
``root_device``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _sync_ddp_if_available,
)
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
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
