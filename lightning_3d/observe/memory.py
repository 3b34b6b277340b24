"""Count the bytes of model state actually resident on this rank.

Peak RSS on CPU hides most of what sharding saves (glibc keeps freed memory in its arenas), so
the ZeRO figures are counted from the tensors themselves: every distinct storage reachable from
parameters, gradients and optimizer state, counted once. A parameter that is a view into a flat
bucket counts the whole bucket (padding included); a ``DTensor`` counts its local shard.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_3d.parallel.tensor import local_tensor as _local
from lightning_3d.parallel.tensor import plain_parts


def _storage_bytes(tensors: Iterable[Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        for part in plain_parts(t):  # an NF4Tensor's codes and scales too
            storage = part.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _optimizer_params(optimizers: Iterable[torch.optim.Optimizer]) -> list[Tensor]:
    return [p for opt in optimizers for g in opt.param_groups for p in g["params"]]


def model_state_bytes(
    module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state resident on this rank.

    ``unsharded_param_bytes`` is the part of ``param_bytes`` held by parameters that are plain
    (non-``DTensor``) tensors: everything under ZeRO 0–2, and whatever FSDP2 did not shard.
    ``tp_split_param_bytes`` / ``tp_split_dense_bytes``: local and full bytes of the parameters
    that tensor parallelism split (ZeRO 0–2; under ZeRO-3 they are also split on ``dp``).
    ``offloaded_param_bytes``: the part of ``param_bytes`` that FSDP2 keeps in CPU memory under a
    ``CPUOffloadPolicy`` (``ThreeDStrategy(offload_params=True)``). ``host_grad_bytes``: the
    gradients of the masters an offloaded optimizer steps in host memory (ZeRO-Offload's split,
    ``offload/split.py``: fp32 accumulators), left out of ``grad_bytes``, which is the device's.
    """
    # Unwrap LightningOptimizer.
    optimizers = [getattr(opt, "_optimizer", opt) for opt in optimizers]
    params = list(module.parameters())
    seen: set[int] = set()
    param_bytes = _storage_bytes(params, seen)
    plain = [p for p in params if not isinstance(p, DTensor)]
    unsharded = _storage_bytes(plain, set())
    # An offloaded optimizer's state lives off this device (CPU buffers or NVMe files): count
    # what it keeps resident here (its streaming window), not the whole state it can read back.
    offloaded = [opt for opt in optimizers if hasattr(opt, "resident_state_bytes_peak")]
    hosted = _host_masters(offloaded, params)
    on_host = {id(p) for p in hosted}
    grads = [p.grad for p in params + _optimizer_params(optimizers) if id(p) not in on_host]
    grad_bytes = _storage_bytes(grads, seen)
    host_grad_bytes = _storage_bytes([p.grad for p in hosted], seen)
    state = [
        v
        for opt in optimizers
        if opt not in offloaded
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, Tensor)
    ]
    state_bytes = _storage_bytes(state, seen) + sum(
        opt.resident_state_bytes_peak for opt in offloaded
    )
    split = [p for p in params if _tp_sharded(p)]
    return {
        "tp_split_param_bytes": sum(_local(p).numel() * p.element_size() for p in split),
        "tp_split_dense_bytes": sum(p.numel() * p.element_size() for p in split),
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "host_grad_bytes": host_grad_bytes,
        "optimizer_state_bytes": state_bytes,
        "unsharded_param_bytes": unsharded,
        "offloaded_param_bytes": _storage_bytes(_cpu_offloaded_params(module), set()),
    }


def _host_masters(
    offloaded: Iterable[torch.optim.Optimizer], params: Iterable[Tensor]
) -> list[Tensor]:
    """The parameters offloaded optimizers step that share no storage with the module's: the
    ZeRO engine's masters in host memory (``master_device="cpu"``), whose gradients are host
    accumulators. Counted by role, not by ``tensor.device``: on a CPU-only machine device and
    host are the same RAM. A slice that is a view of the module's flat bucket (no masters) is
    the device's."""
    held = {part.untyped_storage().data_ptr() for p in params for part in plain_parts(p)}
    return [
        p
        for p in _optimizer_params(offloaded)
        if not any(part.untyped_storage().data_ptr() in held for part in plain_parts(p))
    ]


def _cpu_offloaded_params(module: nn.Module) -> list[Tensor]:
    """The sharded parameters FSDP2 was told to keep in CPU memory (``CPUOffloadPolicy``)."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for m in module.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None  # noqa: SLF001
        found += [
            fp.sharded_param for fp in (group.fsdp_params if group else ()) if fp.offload_to_cpu
        ]
    return found


def _tp_sharded(p: Tensor) -> bool:
    """A parameter split by tensor parallelism alone (a 1-D ``tp`` mesh, sharded)."""
    if not isinstance(p, DTensor) or p.device_mesh.mesh_dim_names != ("tp",):
        return False
    return any(not pl.is_replicate() for pl in p.placements)


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def zero_formula_bytes(num_params: int, stage: int, data: int) -> int:
    """Model-state bytes per rank for fp32 Adam under ZeRO, from the paper (Ψ = ``num_params``)."""
    psi, n = num_params, data
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[
        stage
    ]
