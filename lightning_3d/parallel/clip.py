"""Global gradient-norm clipping over any mix of plain tensors and DTensors.

Parameters of one model can be plain tensors (replicated everywhere), tensor-parallel DTensors
(sharded on ``tp``, replicated on ``tp``), ZeRO slices or FSDP2 shards (sharded on ``dp``, and
on ``tp`` too in 2-D). The squared norm is summed locally per group of equal sharding, then
all-reduced over exactly the mesh dimensions that group is sharded on, so every element counts
once. PyTorch's ``clip_grad_norm_`` cannot stack norms of DTensors with different placements.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_3d.parallel.tensor import by_device_and_dtype, local_tensor


@torch.no_grad()
def global_grad_norm(
    parameters: Iterable[Tensor],
    sum_over: Optional[dist.ProcessGroup] = None,
    skip: Collection[int] = (),
) -> Tensor:
    """The 2-norm of all gradients of ``parameters`` across every rank that holds a part of them.

    A collective: every rank of the groups involved must call it with the same parameter order.
    ``sum_over``: a group whose ranks hold disjoint parameters (pipeline stages). ``skip``: ids
    of parameters another rank of ``sum_over`` counts already (a tied weight's second copy).
    """
    groups: dict[
        tuple, list
    ] = {}  # (mesh id, sharded dims) -> [mesh, sharded dims, local gradients]
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
) -> Tensor:
    """Scale gradients in place so their global 2-norm is at most ``max_norm``; return the norm.
    ``skip_in_norm``: ids of parameters scaled but not counted (see :func:`global_grad_norm`)."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(parameters, sum_over, skip_in_norm)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for (device, dtype), grads in by_device_and_dtype(
        p.grad for p in parameters
    ).items():  # one fused multiply each
        torch._foreach_mul_(grads, scale.to(device, dtype))
    return norm
