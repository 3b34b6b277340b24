"""Materialise a model built on ``meta`` straight into its final place, one parameter at a time.

A model of billions of parameters built eagerly exists whole in fp32 on the host (4 bytes per
parameter, and a single-threaded random fill of all of it) before the strategy casts it to
bf16, moves it to the device and shards it, each step another full copy. Built on ``meta``
instead, the recipe's rewrites (precision cast, tensor parallelism, FSDP2 sharding, CPU
offload) cost nothing, and this module then gives every parameter its storage in its final
dtype, device and shard and fills it once.

Same weights as the eager build, bit for bit: a model that defers its init records a
:class:`DeferredInit` when it is built: the CPU generator's state at that moment and, in the
order the eager init consumes random numbers, each parameter's fill (``normal_(0, std)``,
``zeros_``, ...). :func:`materialize` replays the fills on a private generator started from
that state, each into an fp32 CPU tensor of the parameter's full shape (what the eager init
wrote), then copies this rank's part of it into the parameter, casting to its dtype as
``module.to(dtype)`` would. So the transient fp32 memory is one parameter, never the model;
every rank replays every fill (the random stream is sequential) and keeps only its shard;
parameters another pipeline stage holds are generated and dropped.

The global RNG is not advanced by a deferred build (the eager one advances it by the init's
draws); Lightning's ``seed_everything`` re-seeds every rank before training anyway.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_3d.parallel.tensor import FUSED_ROWS_ATTR, local_tensor, regroup_fused_rows

AHEAD = 2  # parameters filled ahead of the one being copied (at least 1)

# fill(tensor, generator): writes a parameter's initial values into ``tensor`` in place.
Fill = Callable[[Tensor, Optional[torch.Generator]], None]


@dataclass(frozen=True)
class ParamInit:
    """How one parameter starts: its name (in the module that records the plan), its full
    shape, and the in-place fill the eager init applies to it."""

    name: str
    shape: tuple[int, ...]
    fill: Fill


@dataclass(frozen=True)
class DeferredInit:
    """A model's pending initialisation: the CPU generator's state when it was built on
    ``meta``, and its parameters' fills in the order the eager init draws random numbers."""

    rng_state: Tensor
    inits: tuple[ParamInit, ...]

    @classmethod
    def capture(cls, inits: Sequence[ParamInit]) -> "DeferredInit":
        """The plan, with the default CPU generator's state now (where the eager init would start)."""
        return cls(torch.random.get_rng_state(), tuple(inits))


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is still on ``meta``."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def to_device_keeping_meta(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)``, except that tensors on ``meta`` stay there (for :func:`materialize`
    to place later); a ``LightningModule`` records ``device`` as its device as ``to`` would."""
    if not has_meta(module):
        module.to(device)
        return
    module._apply(lambda t: t if t.is_meta else t.to(device))
    if hasattr(module, "_device"):  # Lightning's DeviceDtypeModuleMixin (what `module.device` reports)
        module._device = torch.device(device)


def materialize(module: nn.Module, device: torch.device) -> int:
    """Give every ``meta`` parameter and buffer of ``module`` storage on ``device`` (keeping its
    dtype and sharding), and fill the parameters of each submodule that recorded a
    :class:`DeferredInit` (its ``deferred_init`` attribute, cleared afterwards). Returns the
    number of parameters filled. ``ValueError`` naming them if any ``meta`` tensor has no fill
    (raised before any storage is allocated)."""
    records = [(f"{prefix}." if prefix else "", m) for prefix, m in module.named_modules()
               if getattr(m, "deferred_init", None) is not None]
    planned = {prefix + init.name for prefix, m in records for init in m.deferred_init.inits}
    unfilled = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta and n not in planned]
    if unfilled:
        raise ValueError(f"cannot materialise {unfilled[:8]}{' ...' if len(unfilled) > 8 else ''}: they are on "
                         "meta but no deferred init of the model covers them (build the model eagerly instead)")
    for _, owner in records:
        params = dict(owner.named_parameters(remove_duplicate=False))  # a tied weight under each name
        for init in owner.deferred_init.inits:
            param = params.get(init.name)
            if param is not None and tuple(param.shape) != init.shape:
                raise ValueError(f"{init.name}: recorded shape {init.shape}, the model now has {tuple(param.shape)}")
    if not has_meta(module):
        return 0
    device = torch.device(device)
    # Storage in the final dtype, device and shard; FSDP2 units re-point their shards (their _apply).
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    filled = 0
    with torch.no_grad():
        for _, owner in records:
            filled += _replay(owner, owner.deferred_init)
            owner.deferred_init = None
    return filled


def _replay(owner: nn.Module, record: DeferredInit) -> int:
    """Every fill of ``record`` in order on a generator started from its state; each parameter
    of ``owner`` gets its part of the result. The fills run on a worker thread ``AHEAD``
    parameters ahead of the copies (both release the GIL), so the random fill, which is serial,
    hides the cast and the copy to the device; ``AHEAD + 1`` parameter-sized fp32 buffers exist."""
    generator = torch.Generator(device="cpu")
    generator.set_state(record.rng_state)
    params = dict(owner.named_parameters(remove_duplicate=False))  # a tied weight under each name
    # Fused projections under tensor parallelism hold their rows regrouped ([q_r; k_r; v_r] per rank).
    fused = {id(p): getattr(m, FUSED_ROWS_ATTR) for m in owner.modules() if hasattr(m, FUSED_ROWS_ATTR)
             for p in m.parameters(recurse=False)}
    filled = 0
    todo = iter(enumerate(record.inits))
    pending: deque[tuple[ParamInit, Future]] = deque()
    # Reused fp32 buffers, one per parameter in flight: fresh ones would cost a page fault per
    # 4 KiB of every parameter (large allocations are fresh mmaps), as much as the fill itself.
    largest = max((math.prod(init.shape) for init in record.inits), default=0)
    scratch = [torch.empty(largest, dtype=torch.float32) for _ in range(AHEAD + 1)]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="materialize") as pool:  # one: draws stay in order

        def submit() -> None:
            index, init = next(todo, (None, None))
            if init is not None:  # buffer index % (AHEAD + 1): not the one being copied from
                pending.append((init, pool.submit(_generate, init, generator, scratch[index % len(scratch)])))

        for _ in range(AHEAD):
            submit()
        while pending:
            init, future = pending.popleft()
            full = future.result()
            submit()
            param = params.get(init.name)
            if param is None:  # held by another pipeline stage: its draws still count
                continue
            local = local_tensor(param)
            rows = regroup_fused_rows(full, *fused[id(param)]) if id(param) in fused else full
            part = _local_part(rows, param)
            if local.device.type != "cpu" and part.dtype != local.dtype:
                part = part.to(local.dtype)  # cast on the host: half the bytes cross to the device
            local.copy_(part)  # casts as module.to(dtype) does (round to nearest even)
            filled += 1
    return filled


def _generate(init: ParamInit, generator: torch.Generator, buffer: Tensor) -> Tensor:
    full = buffer[: math.prod(init.shape)].view(init.shape)  # what the eager init wrote: fp32 on CPU
    with torch.no_grad():  # grad mode is per thread
        init.fill(full, generator)
    return full


def _local_part(full: Tensor, param: Tensor) -> Tensor:
    """This rank's part of ``full`` for a parameter laid out like ``param`` (a view, on CPU)."""
    if not isinstance(param, DTensor):
        return full
    placements = param.placements
    if all(type(p) in (Shard, Replicate) for p in placements):  # plain dim-splits: a slice, computed here
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, placements)
        return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    # Strided shards (tensor parallelism inside FSDP2) and the rest: DTensor's own split, locally.
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, placements, src_data_rank=None).to_local()


__all__ = ["DeferredInit", "ParamInit", "has_meta", "materialize", "to_device_keeping_meta"]
