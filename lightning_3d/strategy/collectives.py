"""The collectives Lightning asks a strategy for.

A mixin for :class:`~lightning_3d.strategy.three_d.ThreeDStrategy`; it uses only the strategy's public
``root_device`` and ``sample_group``.

**Which ranks a value is reduced over.** Only the data-parallel ranks hold different samples:
tensor and context ranks hold copies of their data rank's samples, and under a pipeline every
stage runs the module's evaluation step on the same outputs (and is handed the same training
loss). A reduction over the whole world would count every sample once per copy (a logged
``reduce_fx="sum"`` doubled under ``tensor=2``); so :meth:`Collectives.reduce`, which
``self.log(..., sync_dist=True)`` calls, reduces over ``sample_group`` (the mesh's ``dp`` axis)
unless given a group, and :func:`sync_metrics_over` gives the module's torchmetrics the same
group. A per-rank decision (:meth:`Collectives.reduce_boolean_decision`) is still taken over
every rank.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch import Tensor


class Collectives:
    root_device: Any
    sample_group: Optional[Any]  # the ranks holding different samples; None: every rank

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
        """Reduce ``tensor`` (in place) over ``group``; ``None``: the ranks holding different
        samples (``sample_group``), so that a sum counts each sample once and a mean, max or min
        is ddp's, whatever the tensor, context and pipeline sizes (module docstring)."""
        if isinstance(tensor, Tensor) and _distributed_is_initialized():
            group = self.sample_group if group is None else group
            if dist.get_world_size(group) == 1:
                # Lightning's reduce would still barrier and all-reduce (a device sync on NCCL). It
                # reduces in place and returns its input too, so callers see the same object either way.
                return tensor
            return _all_reduce(tensor, group, reduce_op)
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's: ``all`` (or any) of every rank's ``decision``, over the whole world (each
        rank decides for itself: a checkpoint's path, a stop), not over ``sample_group``."""
        if not _distributed_is_initialized() or dist.get_world_size() == 1:
            return bool(decision)
        votes = _all_reduce(
            torch.tensor(int(decision), device=self.root_device), None, dist.ReduceOp.SUM
        )
        return bool(votes == dist.get_world_size()) if all else bool(votes)


def sync_metrics_over(module: Any, group: Optional[Any]) -> None:
    """Give every torchmetrics ``Metric`` in ``module`` (``module.modules()``) ``group`` as its
    ``process_group`` (``None``: every rank), so that its ``compute()`` syncs over the ranks
    holding different samples only; a metric whose ``process_group`` the user set is left as it
    is. One set here before (an earlier ``Trainer``'s mesh) is replaced."""
    torchmetrics = sys.modules.get("torchmetrics")  # not imported: the module holds no metric
    if torchmetrics is None:
        return
    for metric in module.modules():
        if not isinstance(metric, torchmetrics.Metric):
            continue
        ours = metric.__dict__.get(_GROUP_SET, _UNSET)
        if metric.process_group is None or metric.process_group is ours:
            metric.process_group = group
            metric.__dict__[_GROUP_SET] = group


_GROUP_SET = "_lightning_3d_process_group"  # the process_group sync_metrics_over gave a metric
_UNSET = object()


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
