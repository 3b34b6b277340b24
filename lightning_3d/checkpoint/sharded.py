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
from collections.abc import Iterable, Mapping, Sequence
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
def model_state(
    module: nn.Module,
    keep: Optional[Callable[[str], bool]] = None,
    engines: Sequence[ZeroDataParallel] = (),
) -> dict[str, Any]:
    """``module.state_dict()`` ready for DCP: DTensors and plain tensors as they are (no copy),
    fused tensor-parallel projections whole; ``keep(name)``: only those. Parameters whose bucket
    in one of the ZeRO 0-2 ``engines`` keeps an fp32 master are saved as that master
    (:func:`_master_weights`), as the consolidated writer does. A collective only when fused
    projections exist."""
    masters = _master_weights(module, engines, keep)
    fused = StateView(module).fused_by_name()
    state = {}
    for name, value in module.state_dict().items():
        if keep is not None and not keep(name):
            continue
        if name in masters:
            state[name] = masters[name]
        else:
            state[name] = to_full(value, fused[name]) if fused.get(name) else value
    return state


def _names_of(module: nn.Module) -> dict[int, list[str]]:
    """``id(parameter) -> its names in state_dict()`` (a weight tied inside this module has two)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _master_slices(engines: Sequence[ZeroDataParallel]) -> list[tuple[ZeroDataParallel, Any]]:
    """``(engine, owned slice)`` for every bucket slice that is an fp32 master (the optimizer's
    slice wraps the master itself: its local tensor is the master)."""
    out = []
    for engine in engines:
        with_master = {id(p) for p in engine.master_params()}
        out += [(engine, s) for s in engine.owned_slices() if id(s.params[0]) in with_master]
    return out


def _master_weights(
    module: nn.Module,
    engines: Sequence[ZeroDataParallel],
    keep: Optional[Callable[[str], bool]] = None,
) -> dict[str, Any]:
    """The weights to save for parameters with fp32 masters, under each of their names: this
    rank's elements of the master as :class:`Pieces` at the parameter's global shape, in fp32, so
    the stored weight is the value the optimizer stepped, not its bf16 rounding. At stage 0 every
    data rank holds the whole master and lists the same boxes: DCP's save planner keeps one copy
    of items with the same name and offsets. A fused tensor-parallel projection (rows regrouped
    per rank) is saved whole, gathered over dp and tp as the consolidated writer does: a
    collective over dp when the engines hold one (every data rank holds the same parameters)."""
    view, names = StateView(module), _names_of(module)
    out: dict[str, Any] = {}
    fused: dict[ZeroDataParallel, set[int]] = {}
    for engine, owned in _master_slices(engines):
        master = local_tensor(owned.param)
        for p, (start, stop, base) in zip(owned.params, owned.ranges):
            if id(p) in view.fused:
                fused.setdefault(engine, set()).add(id(p))
                continue
            value = Pieces(p.shape, _param_pieces(p, master, start, stop, base))
            out.update(dict.fromkeys(names.get(id(p), ()), value))
    for engine, ids in fused.items():
        for p, master in engine.master_weights(only=ids):
            if id(p) in ids:
                out.update(dict.fromkeys(names.get(id(p), ()), view.full(p, master)))
    return {name: value for name, value in out.items() if keep is None or keep(name)}


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

    for part in _slicing_engines(engine):
        slices = part.owned_slices()
        has_fused = any(id(p) in fused for owned in slices for p in owned.params)
        gathered = part.gather_param_states(optimizer) if has_fused else {}
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


def _slicing_engines(engine: Optional[ZeroDataParallel]) -> list[ZeroDataParallel]:
    """The engines whose slices hold ``engine``'s optimizer's state: it (ZeRO 1-2, or fp32
    masters) and its expert weights' (``parallel/expert_zero.py``), whose slices are
    ``DTensor`` s on (replica, ``ep``) and whose pieces sit at the expert weights' global
    offsets like any other's."""
    if not state_in_slices(engine):
        return []
    return [engine] + ([engine.experts] if engine.experts is not None else [])


def _set_aside(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The module's own parameters among a ZeRO 1-2 optimizer's (whose others are the engines'
    flat slices): those no engine buckets (expert weights sharded over ``ep`` whose replica
    group is one rank, ``parallel/expert.py``), stepped and saved whole, as without an engine."""
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
def model_targets(
    module: nn.Module, names: Iterable[str], engines: Sequence[ZeroDataParallel] = ()
) -> tuple[dict[str, Any], list]:
    """DCP targets for ``module``'s state (its own storage, so loading is in place), and the
    fused projections to copy in afterwards (:func:`finish_model`).

    A parameter whose bucket in one of the ZeRO 0-2 ``engines`` keeps an fp32 master is read
    into the master only: :class:`Pieces` over this rank's owned elements of it, which DCP fills
    with the stored values cast by its copy (fp32 as saved with masters; bf16 upcast from a
    checkpoint saved without). :func:`finish_model` then rounds each master into its bucket and
    gathers the other ranks' parts, as after a step. This is the cheapest exact way: each rank
    reads 4 bytes a parameter over N data ranks instead of every whole weight (what a direct read
    into the bf16 parameters takes) plus its master slice in a second pass, and the data ranks
    exchange the bf16 weights in memory, 2 bytes a parameter, once. A tied weight is read once."""
    view, names_of = StateView(module), _names_of(module)
    fused = view.fused_by_name()
    own = module.state_dict()
    names = list(names)
    wanted = set(names)
    masters: dict[str, Any] = {}  # name -> master Pieces, or the fp32 dtype of a fused one's
    for _, owned in _master_slices(engines):
        master = local_tensor(owned.param)
        for p, (start, stop, base) in zip(owned.params, owned.ranges):
            first = next((n for n in names_of.get(id(p), ()) if n in wanted), None)
            if first is None:
                continue
            masters[first] = (
                master.dtype
                if id(p) in view.fused
                else Pieces(p.shape, _param_pieces(p, master, start, stop, base))
            )
            wanted -= set(names_of[id(p)]) - {first}  # a tie's other names: the same master
    targets, after = {}, []
    for name in [n for n in names if n in wanted]:
        value = own[name]
        if isinstance(masters.get(name), Pieces):
            targets[MODEL + name] = masters[name]
        elif fused.get(name):
            whole = torch.zeros(value.shape, dtype=masters.get(name, value.dtype))
            after.append((name, whole))
            targets[MODEL + name] = whole
        else:
            targets[MODEL + name] = value
    return targets, after


@torch.no_grad()
def finish_model(module: nn.Module, after: list, engines: Sequence[ZeroDataParallel] = ()) -> None:
    """After DCP's read: the fused projections copied in (with masters: into the fp32 master
    too), and every bucket with masters rounded from them and gathered (a collective over dp
    from stage 1, :meth:`~lightning_3d.parallel.zero_state.ZeroState.refresh_from_masters`)."""
    view = StateView(module)
    params = dict(module.named_parameters(remove_duplicate=False))
    with_master = {id(p) for engine in engines for p in engine.master_params()}
    values = {}  # a fused projection's master: its fp32 whole, cut to this rank's part
    for name, whole in after:
        view.copy_into(params[name], whole)
        if id(params[name]) in with_master:
            values[id(params[name])] = view.local_like(params[name], whole, whole.dtype)
    for engine in {id(e): e for e, _ in _master_slices(engines)}.values():
        if values:
            engine.load_master_weights(values)  # only its own; the others keep theirs
        engine.refresh_from_masters()


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

    for part in _slicing_engines(engine):
        for owned in part.owned_slices():
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
                # Placed as the slice it belongs to (a stage-0 master is replicated over dp).
                state[key] = part.slice_dtensor(flat, owned.params[0], sharded=part.stage >= 1)
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
