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

    # The record protocol materialize() drives (also followed by pretrained-weight sources):
    def planned(self) -> list[str]:
        """Names (relative to the module holding the record) of the tensors this record fills."""
        return [init.name for init in self.inits]

    def check(self, owner: nn.Module) -> None:
        """``ValueError`` if the module no longer has the shapes recorded (before any storage)."""
        # A tied weight under each name.
        params = dict(owner.named_parameters(remove_duplicate=False))
        for init in self.inits:
            param = params.get(init.name)
            if param is not None and tuple(param.shape) != init.shape:
                raise ValueError(
                    f"{init.name}: recorded shape {init.shape}, the model now has {tuple(param.shape)}"
                )

    def fill(self, owner: nn.Module) -> int:
        """Fill ``owner``'s parameters (their storage exists, on meta no more); the count filled."""
        return _replay(owner, self)


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
    # Lightning's DeviceDtypeModuleMixin (what `module.device` reports).
    if hasattr(module, "_device"):
        module._device = torch.device(device)


def materialize(module: nn.Module, device: torch.device) -> int:
    """Give every ``meta`` parameter and buffer of ``module`` storage on ``device`` (keeping its
    dtype and sharding), and fill them from the record each submodule holds as its
    ``deferred_init`` attribute (cleared afterwards): a :class:`DeferredInit` (random init
    replayed), or any object with the same ``planned`` / ``check`` / ``fill`` methods (weights
    read from files: :class:`lightning_3d.checkpoint.pretrained.PretrainedWeights`). Returns
    the number of tensors filled. ``ValueError`` naming them if any ``meta`` tensor has no fill
    (raised before any storage is allocated)."""
    records = [
        (f"{prefix}." if prefix else "", m)
        for prefix, m in module.named_modules()
        if getattr(m, "deferred_init", None) is not None
    ]
    planned = {prefix + name for prefix, m in records for name in m.deferred_init.planned()}
    unfilled = [
        n
        for n, t in (*module.named_parameters(), *module.named_buffers())
        if t.is_meta and n not in planned
    ]
    if unfilled:
        raise ValueError(
            f"cannot materialise {unfilled[:8]}{' ...' if len(unfilled) > 8 else ''}: they are on "
            "meta but no deferred init of the model covers them (build the model eagerly instead)"
        )
    for _, owner in records:
        owner.deferred_init.check(owner)
    if not has_meta(module):
        return 0
    device = torch.device(device)
    ties = _ties(module)
    # Storage in the final dtype, device and shard; FSDP2 units re-point their shards (their _apply).
    # A meta parameter cannot take real storage in place, so each module gets a new one: ties
    # (embedding = head) are made one parameter again.
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    for first, *aliases in ties:
        keep = module.get_parameter(first)
        for alias in aliases:
            owner, _, leaf = alias.rpartition(".")
            module.get_submodule(owner).register_parameter(leaf, keep)
    filled = 0
    with torch.no_grad():
        for _, owner in records:
            filled += owner.deferred_init.fill(owner)
            owner.deferred_init = None
    return filled


def materialize_shards(module: nn.Module, device: torch.device, offloaded: bool = False) -> int:
    """The recipe's step for a module built on ``meta``, once it is split and sharded:
    :func:`materialize` on ``device``, or in CPU memory where FSDP2 keeps ``offloaded``
    parameter shards. Nothing to do for a module with nothing on ``meta``, nor onto the ``meta``
    device (the planner's ``validate=true``: only shapes are wanted)."""
    if not has_meta(module) or torch.device(device).type == "meta":
        return 0
    return materialize(module, torch.device("cpu") if offloaded else device)


def _ties(module: nn.Module) -> list[list[str]]:
    """Names of each parameter reachable under several names, the first as named_parameters() has it."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _replay(owner: nn.Module, record: DeferredInit) -> int:
    """Every fill of ``record`` in order on a generator started from its state; each parameter
    of ``owner`` gets its part of the result. The fills run on a worker thread ``AHEAD``
    parameters ahead of the copies (both release the GIL), so the random fill, which is serial,
    hides the cast and the copy to the device; ``AHEAD + 1`` parameter-sized fp32 buffers exist."""
    generator = torch.Generator(device="cpu")
    generator.set_state(record.rng_state)
    params = dict(owner.named_parameters(remove_duplicate=False))  # a tied weight under each name
    # Fused projections under tensor parallelism hold their rows regrouped ([q_r; k_r; v_r] per rank).
    fused = {
        id(p): getattr(m, FUSED_ROWS_ATTR)
        for m in owner.modules()
        if hasattr(m, FUSED_ROWS_ATTR)
        for p in m.parameters(recurse=False)
    }
    filled = 0
    todo = iter(enumerate(record.inits))
    pending: deque[tuple[ParamInit, Future]] = deque()
    # Reused fp32 buffers, one per parameter in flight: fresh ones would cost a page fault per
    # 4 KiB of every parameter (large allocations are fresh mmaps), as much as the fill itself.
    largest = max((math.prod(init.shape) for init in record.inits), default=0)
    scratch = [torch.empty(largest, dtype=torch.float32) for _ in range(AHEAD + 1)]
    # One: draws stay in order.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="materialize") as pool:

        def submit() -> None:
            index, init = next(todo, (None, None))
            if init is not None:  # buffer index % (AHEAD + 1): not the one being copied from
                pending.append(
                    (init, pool.submit(_generate, init, generator, scratch[index % len(scratch)]))
                )

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
            part = local_part(rows, param)
            if local.device.type != "cpu" and part.dtype != local.dtype:
                part = part.to(local.dtype)  # cast on the host: half the bytes cross to the device
            local.copy_(part)  # casts as module.to(dtype) does (round to nearest even)
            filled += 1
    return filled


def _generate(init: ParamInit, generator: torch.Generator, buffer: Tensor) -> Tensor:
    # What the eager init wrote: fp32 on CPU.
    full = buffer[: math.prod(init.shape)].view(init.shape)
    with torch.no_grad():  # grad mode is per thread
        init.fill(full, generator)
    return full


def local_region(param: Tensor) -> Optional[tuple[slice, ...]]:
    """The slices of the full tensor that hold this rank's part of ``param`` (the whole for a
    plain tensor), or ``None`` where the part is not one box of it (strided shards: tensor
    parallelism inside FSDP2). Shapes only: works on ``meta``."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    if not all(type(p) in (Shard, Replicate) for p in param.placements):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def local_part(full: Tensor, param: Tensor) -> Tensor:
    """This rank's part of ``full`` for a parameter laid out like ``param`` (a view, on CPU)."""
    region = local_region(param)
    if region is not None:  # plain dim-splits: a slice, computed here
        return full[region]
    # Strided shards (tensor parallelism inside FSDP2) and the rest: DTensor's own split, locally.
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        full, param.device_mesh, param.placements, src_data_rank=None
    ).to_local()


__all__ = [
    "DeferredInit",
    "ParamInit",
    "has_meta",
    "local_part",
    "local_region",
    "materialize",
    "materialize_shards",
    "to_device_keeping_meta",
]
