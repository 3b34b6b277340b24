"""Gradient clipping (by the global norm, by value) over any mix of plain tensors and DTensors.

Parameters of one model can be plain tensors (replicated everywhere), tensor-parallel DTensors
(sharded on ``tp``, replicated on ``tp``), ZeRO slices or FSDP2 shards (sharded on ``dp``, and
on ``tp`` too in 2-D). The squared norm is summed locally per group of equal sharding, then
all-reduced over exactly the mesh dimensions that group is sharded on, so every element counts
once. PyTorch's ``clip_grad_norm_`` cannot stack norms of DTensors with different placements.
Clipping by value is elementwise: :func:`clip_grad_value_` clamps each rank's local elements.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_3d.parallel.tensor import by_device_and_dtype, local_tensor

WorldSum = Callable[[Tensor], Tensor]
"""Sums a 0-d tensor over every rank of the default group, returning the sum (a collective)."""


@torch.no_grad()
def global_grad_norm(
    parameters: Iterable[Tensor],
    sum_over: Optional[dist.ProcessGroup] = None,
    skip: Collection[int] = (),
    world_sum: Optional[WorldSum] = None,
) -> Tensor:
    """The 2-norm of all gradients of ``parameters`` across every rank that holds a part of them.

    A collective: every rank of the groups involved must call it with the same parameter order.
    ``sum_over``: a group whose ranks hold disjoint parameters (pipeline stages). ``skip``: ids
    of parameters another rank of ``sum_over`` counts already (a tied weight's second copy).
    ``world_sum``: when every group of gradients is summed over exactly the world's ranks (pure
    data parallelism under ZeRO 1-3, or a world of one), this rank's squares go to it instead of
    collectives of their own: the step's agreement carries them
    (:mod:`lightning_3d.runtime.agreement`).
    """
    # (mesh id, sharded dims) -> [mesh, sharded dims, local gradients]
    groups: dict[tuple, list] = {}
    device = None
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        if id(p) in skip:
            device = local_tensor(grad).device
            continue
        if isinstance(grad, DTensor):
            if any(pl.is_partial() for pl in grad.placements):  # squares of partial sums are no use
                grad = grad.redistribute(
                    placements=[Replicate() if pl.is_partial() else pl for pl in grad.placements]
                )
            mesh = grad.device_mesh
            # Every non-replicated placement splits elements across that mesh dimension
            # (Shard, and FSDP2's _StridedShard, which does not report is_shard()).
            dims = tuple(i for i, pl in enumerate(grad.placements) if not pl.is_replicate())
            local = grad._local_tensor
        else:
            mesh, dims, local = None, (), grad
        device = local.device
        groups.setdefault((id(mesh), dims), [mesh, dims, []])[2].append(local)
    total = torch.zeros((), device=device or "cpu")
    if world_sum is not None and _spans_the_world(groups.values(), sum_over):
        for _, _, locals_ in groups.values():
            total += _sum_of_squares(locals_, device).to(total.device)
        return world_sum(total).to(total.device).sqrt()
    for mesh, dims, locals_ in groups.values():
        squares = _sum_of_squares(locals_, device)
        if dims:
            # Gradients may live in CPU memory (ZeRO-3 with offload_params) while the mesh's
            # groups are NCCL's: reduce on the mesh's own device, then come back.
            squares = squares.to(collective_device(mesh.device_type))
            for dim in dims:
                dist.all_reduce(squares, group=mesh.get_group(dim))
        total += squares.to(total.device)
    if sum_over is not None:
        reduced = total.to(collective_device(None, sum_over))
        dist.all_reduce(reduced, group=sum_over)
        total = reduced.to(total.device)
    return total.sqrt()


def _spans_the_world(groups: Iterable[list], sum_over: Optional[dist.ProcessGroup]) -> bool:
    """Whether every group's sum (over its sharded mesh dims, then ``sum_over``) runs over as
    many ranks as the world has: then one sum over the world counts every element once."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    across = sum_over.size() if sum_over is not None else 1
    for mesh, dims, _ in groups:
        span = across
        for dim in dims:
            span *= mesh.size(dim)
        if span != world:
            return False
    return True


def _sum_of_squares(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The sum of squares of every element, in float32 on ``device``: one fused norm per device
    and dtype (``_foreach_norm``, as ``torch.nn.utils.clip_grad_norm_`` does), not a few kernels
    per tensor."""
    squares = torch.zeros((), device=device)
    for (_, dtype), group in by_device_and_dtype(tensors).items():
        low = dtype in (torch.float16, torch.bfloat16)  # accumulate in float32
        norms = (
            torch._foreach_norm(group, 2.0, dtype=torch.float32)
            if low
            else torch._foreach_norm(group, 2.0)
        )
        squares = squares + torch.stack(norms).float().pow(2).sum().to(device)
    return squares


def collective_device(
    device_type: Optional[str], group: Optional[dist.ProcessGroup] = None
) -> torch.device:
    """A device whose tensors the group's backend can reduce: the mesh's device type, or for a
    plain group, the current accelerator when its backend is NCCL and the CPU otherwise."""
    if device_type is None:
        device_type = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type)
    return torch.device(device_type, module.current_device())


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    sum_over: Optional[dist.ProcessGroup] = None,
    skip_in_norm: Collection[int] = (),
    world_sum: Optional[WorldSum] = None,
) -> Tensor:
    """Scale gradients in place so their global 2-norm is at most ``max_norm``; return the norm.
    ``skip_in_norm``, ``world_sum``: see :func:`global_grad_norm`."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(parameters, sum_over, skip_in_norm, world_sum)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    # One fused multiply each.
    for (device, dtype), grads in by_device_and_dtype(p.grad for p in parameters).items():
        torch._foreach_mul_(grads, scale.to(device, dtype))
    return norm


@torch.no_grad()
def clip_grad_value_(parameters: Iterable[Tensor], clip_value: float) -> None:
    """Clamp every gradient of ``parameters`` to ``[-clip_value, clip_value]`` in place, whatever
    mix of plain tensors and DTensors they are. Clamping is elementwise, so each rank clamps the
    elements it holds (a DTensor's local shard or replica) without talking to another; only a
    gradient still holding partial sums is summed first (a collective: the parts' clamps would
    not add up to the sum's).
    Torch's ``clip_grad_value_`` cannot mix plain tensors and DTensors in one fused call."""
    clip_value = float(clip_value)
    grads = []
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            grad = grad.redistribute(
                placements=[Replicate() if pl.is_partial() else pl for pl in grad.placements]
            )
            p.grad = grad
        grads.append(grad)
    for group in by_device_and_dtype(grads).values():  # one fused clamp each way per group
        torch._foreach_clamp_min_(group, -clip_value)
        torch._foreach_clamp_max_(group, clip_value)
