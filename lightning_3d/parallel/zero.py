"""ZeRO stages 0, 1 and 2 on the data-parallel axis, built on flat gradient buckets.

FSDP2 gives ZeRO-3 (see ``fsdp.py``) but not the replicated-parameter stages: with
``reshard_after_forward=False`` it still keeps a separate sharded copy of every parameter, so
stage 2 would cost 4Ψ + 16Ψ/N instead of the paper's 4Ψ + 12Ψ/N. Here every parameter of an
optimizer param group becomes a view into one flat, padded buffer per bucket; rank ``r`` owns
the ``r``-th equal slice of each bucket. The optimizer is rewritten in place to step only those
slices, each wrapped as a ``DTensor`` sharded on the data axis — so gradient clipping, DCP and
any elementwise optimizer (SGD, Adam, AdamW, ...) see one correctly-sharded tensor and compute
global norms by themselves.

    stage 0: grads all-reduced, every rank steps everything      16Ψ per rank
    stage 1: grads reduce-scattered into full-size buffers,     8Ψ + 8Ψ/N
             optimizer state for own slice only
    stage 2: each bucket's grads are reduce-scattered as soon   4Ψ + 12Ψ/N
             as backward has produced them, then dropped

After the optimizer step, stages 1 and 2 all-gather the updated slices back into the flat
parameter buffers (in place, since the slice is a view of the buffer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(eq=False)
class _Bucket:
    """A contiguous run of same-dtype parameters from one optimizer param group."""

    params: list[nn.Parameter]
    offsets: list[int]
    flat: Tensor  # (padded,) every parameter of the bucket, replicated; params are views of it
    shard_numel: int  # padded / data-parallel size
    grad: Optional[Tensor] = None  # (padded,) stages 0-1: parameter grads are views of it
    grad_views: list[Tensor] = field(default_factory=list)
    shard_grad: Optional[Tensor] = None  # (padded / N,) stage 2: this rank's reduced grads
    staging: Optional[Tensor] = None  # (padded,) stage 2: grads of one backward, then freed
    slice: Optional[nn.Parameter] = None  # stages 1-2: DTensor view of this rank's slice
    ready: int = 0  # parameters whose gradient this backward has produced
    work: Optional[dist.Work] = None
    reduced: Optional[Tensor] = None  # reduce-scatter output, waiting for ``work``


class ZeroDataParallel:
    """Gradient synchronisation and optimizer sharding for ZeRO stages 0–2.

    Example::

        engine = ZeroDataParallel(mesh["dp"], stage=2)
        engine.attach(optimizer)          # after the optimizer exists, before the first step
        for batch in loader:
            engine.prepare_backward(sync=True)
            loss(batch).backward()
            engine.finish_backward()
            optimizer.step()
            engine.after_step()
    """

    def __init__(self, dp_mesh: DeviceMesh, stage: int, bucket_numel: int = 2**23) -> None:
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroDataParallel handles zero_stage 0, 1 and 2, got {stage}")
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
        self.mesh = dp_mesh
        self.stage = stage
        self.bucket_numel = bucket_numel
        self.group = dp_mesh.get_group()
        self.size = dp_mesh.size()
        self.rank = dp_mesh.get_local_rank()
        self.buckets: list[_Bucket] = []
        self._hooks: list = []
        self._sync = True

    # ---------------------------------------------------------------- setup
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Flatten the optimizer's parameters into buckets and (stages 1–2) shard its groups."""
        if optimizer.state:
            raise ValueError("attach the ZeRO engine before the optimizer's first step (its state is not empty)")
        owned = {id(p) for b in self.buckets for p in b.params}
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            if any(id(p) in owned for p in params):
                raise ValueError("a parameter appears in more than one optimizer param group")
            # Reverse registration order approximates the order backward produces gradients,
            # so the first buckets fill (and can be reduced) while backward is still running.
            buckets = [self._make_bucket(chunk) for chunk in self._chunks(params[::-1])]
            self.buckets.extend(buckets)
            if self.stage >= 1:
                group["params"] = [b.slice for b in buckets]

    def _chunks(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        chunks: list[list[nn.Parameter]] = []
        numel = 0
        for p in params:
            same_kind = chunks and chunks[-1][0].dtype == p.dtype and chunks[-1][0].device == p.device
            if not same_kind or numel + p.numel() > self.bucket_numel:
                chunks.append([])
                numel = 0
            chunks[-1].append(p)
            numel += p.numel()
        return chunks

    def _make_bucket(self, params: list[nn.Parameter]) -> _Bucket:
        numel = sum(p.numel() for p in params)
        padded = -(-numel // self.size) * self.size  # ceil to a multiple of N: equal slices
        ref = params[0]
        flat = torch.zeros(padded, dtype=ref.dtype, device=ref.device)
        offsets = []
        offset = 0
        for p in params:
            flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[offset : offset + p.numel()].view_as(p)
            offsets.append(offset)
            offset += p.numel()
        # Identical start on every rank, whatever the seeding: data-parallel rank 0 wins.
        dist.broadcast(flat, src=dist.get_global_rank(self.group, 0), group=self.group)
        bucket = _Bucket(params=params, offsets=offsets, flat=flat, shard_numel=padded // self.size)
        if self.stage <= 1:
            bucket.grad = torch.zeros_like(flat)
            bucket.grad_views = [bucket.grad[o : o + p.numel()].view_as(p) for p, o in zip(params, offsets)]
        else:
            bucket.shard_grad = torch.zeros(bucket.shard_numel, dtype=flat.dtype, device=flat.device)
        if self.stage >= 1:
            bucket.slice = nn.Parameter(self._as_dtensor(self._own(flat, bucket)))
        for index, p in enumerate(params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(bucket, index)))
        return bucket

    def _own(self, full: Tensor, bucket: _Bucket) -> Tensor:
        return full[self.rank * bucket.shard_numel : (self.rank + 1) * bucket.shard_numel]

    def _as_dtensor(self, local: Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False)

    def detach(self) -> None:
        """Remove the gradient hooks (parameters stay views of the flat buffers)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # ---------------------------------------------------------------- backward
    def prepare_backward(self, sync: bool) -> None:
        """Call before each backward. ``sync=False`` accumulates locally (stages 0–1 only)."""
        # Stage 2 keeps no full-size gradient, so it must reduce on every backward.
        self._sync = sync or self.stage == 2
        for bucket in self.buckets:
            bucket.ready = 0
            for p, view in zip(bucket.params, bucket.grad_views):
                if p.grad is not view:  # optimizer.zero_grad() set it to None: point it back
                    p.grad = view

    def _grad_hook(self, bucket: _Bucket, index: int):
        def hook(p: nn.Parameter) -> None:
            if self.stage <= 1:
                view = bucket.grad_views[index]
                if p.grad is not view:  # autograd replaced rather than accumulated: keep ours
                    view.add_(p.grad)
                    p.grad = view
            else:
                if bucket.staging is None:
                    bucket.staging = torch.zeros_like(bucket.flat)
                offset = bucket.offsets[index]
                bucket.staging[offset : offset + p.numel()].add_(p.grad.reshape(-1))
                p.grad = None  # the staging buffer holds it now; free the per-parameter copy
            bucket.ready += 1
            if bucket.ready == len(bucket.params) and self._sync:
                self._launch(bucket)

        return hook

    def _launch(self, bucket: _Bucket) -> None:
        # Collectives must start in the same order on every rank; buckets fill in backward order,
        # which is the same on every rank for the same model, so this holds without a barrier.
        full = bucket.grad if self.stage <= 1 else bucket.staging
        if full is None:  # stage 2 bucket whose parameters got no gradient this backward
            full = bucket.staging = torch.zeros_like(bucket.flat)
        full.div_(self.size)  # SUM then mean: gloo has no AVG
        if self.stage == 0:
            bucket.work = dist.all_reduce(full, group=self.group, async_op=True)
        else:
            bucket.reduced = torch.empty(bucket.shard_numel, dtype=full.dtype, device=full.device)
            bucket.work = dist.reduce_scatter_tensor(bucket.reduced, full, group=self.group, async_op=True)

    def finish_backward(self) -> None:
        """Call after each backward: completes the reductions of a synchronising backward."""
        if not self._sync:
            return
        for bucket in self.buckets:  # buckets with unused parameters never fired their hook
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
            if self.stage == 1:
                self._own(bucket.grad, bucket).copy_(bucket.reduced)
            elif self.stage == 2:
                bucket.shard_grad.add_(bucket.reduced)
                bucket.staging = None
            bucket.reduced = None
            if self.stage >= 1:
                own = self._own(bucket.grad, bucket) if self.stage == 1 else bucket.shard_grad
                bucket.slice.grad = self._as_dtensor(own)

    # ---------------------------------------------------------------- step
    def after_step(self) -> None:
        """Call after ``optimizer.step()``: re-replicate parameters, clear gradients."""
        if self.stage >= 1:
            works = [
                dist.all_gather_into_tensor(b.flat, self._own(b.flat, b), group=self.group, async_op=True)
                for b in self.buckets
            ]
            for work in works:
                work.wait()
        for bucket in self.buckets:
            if bucket.grad is not None:
                bucket.grad.zero_()
            if bucket.shard_grad is not None:
                bucket.shard_grad.zero_()
            if bucket.slice is not None:
                bucket.slice.grad = None

    def parameters(self) -> list[nn.Parameter]:
        return [p for b in self.buckets for p in b.params]
