"""Sharded checkpoints: every rank writes only what it holds, with ``torch.distributed.checkpoint``.

The directory's layout and the DCP calls are ``sharded_files.py``; this module decides what each
rank hands to DCP, from the same per-parameter view (``view.py``) the consolidated writer uses.
Every tensor is stored under a name that does not depend on the layout and at its global shape:
``state_dict.<parameter>`` and ``optimizer_states.<i>.<parameter>.<key>``. FSDP2 shards and
tensor-parallel ``DTensor`` s go to DCP as they are; ZeRO 1/2 flat slices as :class:`Pieces`
(``pieces.py``), placed by the engine's :meth:`~ZeroDataParallel.owned_slices`; tensors
replicated over ranks are written once (DCP's de-duplication spreads them over the ranks). Fused
q/k/v projections under tensor parallelism (whose rows are regrouped per rank) are saved whole,
in the plain model's row order.

Loading reads, on each rank, exactly the boxes its current layout holds — which is what makes a
checkpoint saved under one layout resume under any other (data, tensor, pipeline size, ZeRO
stage, offload).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_3d.checkpoint.pieces import Pieces, flat_boxes, flat_index
from lightning_3d.checkpoint.sharded_files import MODEL
from lightning_3d.checkpoint.view import StateView, optimizer_params, state_in_slices, to_full
from lightning_3d.parallel.optimizers import refuse_sharded_quantized
from lightning_3d.parallel.tensor import local_tensor
from lightning_3d.parallel.zero import ZeroDataParallel


# ------------------------------------------------------------------------------ placement
def _global_offset(param: Tensor) -> tuple[int, ...]:
    if isinstance(param, DTensor):
        return tuple(
            compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)[
                1
            ]
        )
    return (0,) * param.dim()


def _param_pieces(param: Tensor, flat: Tensor, start: int, stop: int, base: int) -> list:
    """Boxes of elements ``[start, stop)`` of ``param``'s local tensor, whose values sit at
    ``flat[k - base]`` for element ``k``, in the parameter's global coordinates."""
    shape = tuple(local_tensor(param).shape)
    origin = _global_offset(param)
    parts = []
    for offsets, sizes in flat_boxes(shape, start, stop):
        first = flat_index(shape, offsets) - base
        view = flat[first : first + math.prod(sizes)].view(sizes)
        parts.append((tuple(o + g for o, g in zip(offsets, origin)), view))
    return parts


# ------------------------------------------------------------------------------ save
def model_state(module: nn.Module, keep: Optional[Callable[[str], bool]] = None) -> dict[str, Any]:
    """``module.state_dict()`` ready for DCP: DTensors and plain tensors as they are (no copy),
    fused tensor-parallel projections whole; ``keep(name)``: only those. A collective only when
    fused projections exist."""
    fused = StateView(module).fused_by_name()
    return {
        name: to_full(value, fused[name]) if fused.get(name) else value
        for name, value in module.state_dict().items()
        if keep is None or keep(name)
    }


def optimizer_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    engine: Optional[ZeroDataParallel],
    order: Optional[list[str]] = None,
) -> dict[str, Any]:
    """The optimizer's state for DCP, ``{"tensors": {"<param>.<key>": ...}, "param_groups": [...],
    "elementwise": [...], "extras": {...}}``. A collective (names are merged over ranks)."""
    # Before any collective: quantized states split across ranks cannot be gathered.
    refuse_sharded_quantized(optimizer)
    view = StateView(module)
    name_of, fused = view.name_of, view.fused
    tensors: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    elementwise: set[str] = set()

    def put(fqn: str, value: Any) -> None:
        if isinstance(value, Tensor):
            tensors[fqn] = value
        else:
            extras[fqn] = value

    if state_in_slices(engine):
        slices = engine.owned_slices()
        has_fused = any(id(p) in fused for owned in slices for p in owned.params)
        gathered = engine.gather_param_states(optimizer) if has_fused else {}
        for owned in slices:
            for key, value in optimizer.state.get(owned.param, {}).items():
                flat = isinstance(value, Tensor) and value.dim() == 1
                elementwise |= {key} if flat else set()
                for p, (start, stop, base) in zip(owned.params, owned.ranges):
                    fqn = f"{name_of[id(p)]}.{key}"
                    if id(p) in fused and flat:
                        put(fqn, view.full(p, gathered[id(p)][key]))
                    elif flat:
                        tensors[fqn] = Pieces(
                            p.shape, _param_pieces(p, local_tensor(value), start, stop, base)
                        )
                    else:
                        put(fqn, _scalar(fqn, value))
    whole_params = (
        _set_aside(module, optimizer)
        if state_in_slices(engine)
        else [p for group in optimizer_params(optimizer, engine) for p in group]
    )
    for p in whole_params:
        for key, value in optimizer.state.get(p, {}).items():
            whole = isinstance(value, Tensor) and value.dim() >= 1 and value.shape == p.shape
            elementwise |= {key} if whole else set()
            fqn = f"{name_of[id(p)]}.{key}"
            put(
                fqn,
                (view.full(p, value) if id(p) in fused else value)
                if whole
                else _scalar(fqn, value),
            )
    groups = [[name_of[id(p)] for p in group] for group in optimizer_params(optimizer, engine)]
    param_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if dist.is_available() and dist.is_initialized():
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (groups, sorted(elementwise), extras))
        position = {name: i for i, name in enumerate(order or [])}
        groups = [
            sorted({n for part in parts for n in part[0][g]}, key=lambda n: position.get(n, 0))
            for g in range(len(groups))
        ]
        elementwise = {k for part in parts for k in part[1]}
        extras = {k: v for part in parts for k, v in part[2].items()}
    for group, names in zip(param_groups, groups):
        group["params"] = names
    return {
        "tensors": tensors,
        "param_groups": param_groups,
        "elementwise": sorted(elementwise),
        "extras": extras,
    }


def _set_aside(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The module's own parameters among a ZeRO 1-2 optimizer's (whose others are the engine's
    flat slices): those the engine left to another reduction (expert weights sharded over
    ``ep``, ``parallel/expert.py``), stepped and saved whole, as without an engine."""
    own = {id(p) for p in module.parameters()}
    return [p for group in optimizer.param_groups for p in group["params"] if id(p) in own]


def _scalar(fqn: str, value: Any) -> Any:
    # Replicated entries are written once: a per-rank tensor under one name would lose data.
    if isinstance(value, Tensor) and value.dim() > 0:
        raise ValueError(
            f"optimizer state {fqn!r} of shape {tuple(value.shape)} is neither per-element nor a "
            "scalar: sharded checkpoints cannot place it (use checkpoint_format='consolidated')"
        )
    return value


# ------------------------------------------------------------------------------ load
def model_targets(module: nn.Module, names: Iterable[str]) -> tuple[dict[str, Any], list]:
    """DCP targets for ``module``'s state (its own storage, so loading is in place), and the
    fused projections to copy in afterwards."""
    fused = StateView(module).fused_by_name()
    own = module.state_dict()
    targets, after = {}, []
    for name in names:
        value = own[name]
        if fused.get(name):
            whole = torch.zeros(value.shape, dtype=value.dtype)
            after.append((name, whole))
            targets[MODEL + name] = whole
        else:
            targets[MODEL + name] = value
    return targets, after


@torch.no_grad()
def finish_model(module: nn.Module, after: list) -> None:
    view = StateView(module)
    params = dict(module.named_parameters())
    for name, whole in after:
        view.copy_into(params[name], whole)


def optimizer_targets(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    engine: Optional[ZeroDataParallel],
    saved: Mapping[str, TensorStorageMetadata],
    meta: Mapping[str, Any],
    prefix: str,
) -> tuple[dict[str, Any], Any]:
    """DCP targets for one optimizer's state in this layout, and a function that installs them
    (call it after :func:`load`). ``saved``: the checkpoint's ``<param>.<key>`` entries."""
    view = StateView(module)
    _check_groups(view, optimizer, engine, meta)
    name_of, fused = view.name_of, view.fused
    elementwise = set(meta["elementwise"])
    keys_of: dict[str, dict[str, TensorStorageMetadata]] = {}
    for fqn, md in saved.items():
        name, key = fqn.rsplit(".", 1)
        keys_of.setdefault(name, {})[key] = md
    for fqn, value in meta.get("extras", {}).items():
        name, key = fqn.rsplit(".", 1)
        keys_of.setdefault(name, {})[key] = value
    targets: dict[str, Any] = {}
    # (state owner, its state, fused whole-parameter states, fused parameters inside a ZeRO slice)
    installs: list[tuple[Tensor, dict[str, Any], list, list]] = []

    def scalar(fqn: str, md: Any) -> Any:
        if not isinstance(md, TensorStorageMetadata):
            return md  # a plain Python value from meta.pt
        targets[prefix + fqn] = torch.zeros(md.size, dtype=md.properties.dtype)
        return targets[prefix + fqn]

    if state_in_slices(engine):
        for owned in engine.owned_slices():
            names = [name_of[id(p)] for p in owned.params]
            keys = {k: md for n in names for k, md in keys_of.get(n, {}).items()}
            if not keys:
                continue
            state, in_slice = {}, []
            for key, md in keys.items():
                if key not in elementwise:
                    first = next(n for n in names if key in keys_of.get(n, {}))
                    state[key] = scalar(f"{first}.{key}", md)
                    continue
                flat = torch.zeros(owned.numel, dtype=md.properties.dtype, device=owned.device)
                for p, (start, stop, base), name in zip(owned.params, owned.ranges, names):
                    if key not in keys_of.get(name, {}):
                        continue
                    if id(p) in fused:
                        whole = targets[prefix + f"{name}.{key}"] = torch.zeros(
                            p.shape, dtype=md.properties.dtype
                        )
                        in_slice.append((whole, p, flat, start, stop, base))
                    else:
                        targets[prefix + f"{name}.{key}"] = Pieces(
                            p.shape, _param_pieces(p, flat, start, stop, base)
                        )
                state[key] = engine.slice_dtensor(flat, owned.params[0])
            installs.append((owned.param, state, [], in_slice))
    whole_params = (
        _set_aside(module, optimizer)
        if state_in_slices(engine)
        else [p for group in optimizer_params(optimizer, engine) for p in group]
    )
    for p in whole_params:
        name = name_of[id(p)]
        if name not in keys_of:
            continue
        state, whole_states = {}, []
        for key, md in keys_of[name].items():
            if key not in elementwise:
                state[key] = scalar(f"{name}.{key}", md)
            elif id(p) in fused:
                whole = targets[prefix + f"{name}.{key}"] = torch.zeros(
                    p.shape, dtype=md.properties.dtype
                )
                whole_states.append((key, whole))
            else:
                state[key] = targets[prefix + f"{name}.{key}"] = torch.zeros_like(
                    p, dtype=md.properties.dtype
                )
        installs.append((p, state, whole_states, []))

    def install() -> None:
        for group, saved_group in zip(optimizer.param_groups, meta["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        for owner, state, whole_states, in_slice in installs:
            for key, whole in whole_states:
                state[key] = view.local_like(owner, whole, whole.dtype)
            for whole, p, flat, start, stop, base in in_slice:
                local = local_tensor(view.local_like(p, whole, flat.dtype)).reshape(-1)
                flat[start - base : stop - base].copy_(local[start:stop])
            optimizer.state[owner] = state

    return targets, install


def _check_groups(
    view: StateView,
    optimizer: torch.optim.Optimizer,
    engine: Optional[ZeroDataParallel],
    meta: Mapping[str, Any],
) -> None:
    groups = [[view.name_of[id(p)] for p in group] for group in optimizer_params(optimizer, engine)]
    saved = [g["params"] for g in meta["param_groups"]]
    if len(groups) != len(saved) or any(
        not set(mine) <= set(theirs) for mine, theirs in zip(groups, saved)
    ):
        raise ValueError(
            f"optimizer param groups differ: the checkpoint has {len(saved)} groups of sizes "
            f"{[len(g) for g in saved]}, the model {len(groups)} (here: {[len(g) for g in groups]})"
        )
