"""Consolidated checkpoints: full tensors in the format of a single-process run.

Whatever the layout (ZeRO slices, FSDP2 shards, tensor-parallel DTensors, fused q/k/v regrouped
rows), the model state is saved under the ``LightningModule``'s own parameter names at full size,
and the optimizer state as ``torch.optim.Optimizer.state_dict()`` of the user's optimizer would
look in one process (state keyed by parameter index, in the user's param-group order). Such a
checkpoint loads into plain Lightning and resumes under any other layout: each rank takes its
own part on load. The cost is that saving gathers everything (every rank takes part, rank 0
writes) — fine for models whose state fits in one host's memory. What is gathered, and how it
is cut back on load, is the per-parameter view (``view.py``) the sharded writer uses too.

Under a pipeline each stage holds other parameters. Stages merge their parts over the pipeline
group (``pp_group``), and the optimizer's parameter indices are those of one process: each
param group's parameters ordered by their position in the whole model (``order``, the
parameter names before the split) — which is how a group built from ``self.parameters()``
(filtered or not) is ordered in one process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.checkpoint.view import (
    StateView,
    full_state_dict,
    optimizer_params,
    state_in_slices,
    tied_aliases,
)
from lightning_3d.parallel.optimizers import refuse_sharded_quantized
from lightning_3d.parallel.zero import ZeroDataParallel


# ---------------------------------------------------------------------------------- model
def full_model_state(
    module: nn.Module,
    pp_group: Any = None,
    names: Optional[list[str]] = None,
    keep: Optional[Callable[[str], bool]] = None,
    engines: Sequence[ZeroDataParallel] = (),
) -> dict[str, Tensor]:
    """``module.state_dict()`` at full size on CPU (``names``: its keys in one process, for a
    pipeline stage that holds only some; ``keep(name)``: only those are gathered and returned).
    Parameters with fp32 masters in ``engines`` are saved as their masters (:func:`master_state`).
    A collective: call on every rank."""
    full = full_state_dict(module, pp_group=pp_group, keep=keep)
    full.update(master_state(module, engines, keep, pp_group))
    # state_dict() lists a tied weight under each of its names; full_state_dict once.
    aliases = tied_aliases(module)
    full.update({alias: full[name] for alias, name in aliases.items() if name in full})
    return {
        name: full[name]
        for name in (names if names is not None else module.state_dict())
        if name in full and (keep is None or keep(name))
    }


@torch.no_grad()
def load_full_model_state(
    module: nn.Module,
    state: Mapping[str, Tensor],
    strict: bool = True,
    names: Optional[list[str]] = None,
) -> None:
    """Copy full tensors into ``module``'s (possibly sharded) parameters and buffers in place.
    ``names``: the state's keys in one process (a pipeline stage loads only what it holds)."""
    own = dict([*module.named_parameters(), *module.named_buffers()])
    expected = set(names if names is not None else module.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if strict and (missing or unexpected):
        raise KeyError(
            f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}"
        )
    view = StateView(module)
    for name, full in state.items():
        if name not in own:
            continue
        target = own[name]
        if tuple(full.shape) != tuple(target.shape):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(full.shape)} != model shape {tuple(target.shape)}"
            )
        view.copy_into(target, full)


def master_state(
    module: nn.Module,
    engines: Sequence[ZeroDataParallel],
    keep: Optional[Callable[[str], bool]] = None,
    pp_group: Any = None,
) -> dict[str, Tensor]:
    """The fp32 master weights the ZeRO 0-2 ``engines`` keep for low-precision parameters, at
    full size on CPU under the parameters' one-process names, merged over the pipeline stages
    (``pp_group``; a tied weight's copies are equal). A checkpoint saves these as the model's
    weights: a resume in any layout (or in one process) starts from the values the optimizer
    stepped, not from their bf16 roundings. A collective: call on every rank."""
    view = StateView(module)
    out = {}
    for engine in engines:
        for p, master in engine.master_weights():
            name = view.name_of[id(p)]
            if keep is None or keep(name):
                out[name] = view.full(p, master)
    if pp_group is not None:
        parts: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, out, group=pp_group)
        out = {name: value for part in parts for name, value in part.items()}
    return out


@torch.no_grad()
def load_master_state(
    module: nn.Module, state: Mapping[str, Tensor], engines: Sequence[ZeroDataParallel]
) -> None:
    """Load saved weights into the ``engines``' fp32 masters (after :func:`load_full_model_state`
    rounded them into the bf16 parameters): fp32 in the checkpoint resumes exactly."""
    view = StateView(module)
    for engine in engines:
        values = {}
        for p in engine.master_params():
            full = state.get(view.name_of[id(p)])
            if full is not None:
                values[id(p)] = view.local_like(p, full, full.dtype)
        engine.load_master_weights(values)


# ------------------------------------------------------------------------------ optimizer
def _param_layout(
    view: StateView, groups: list[list[Tensor]], pp_group: Any, order: Optional[list[str]]
) -> tuple[dict[int, int], list[int]]:
    """Each local parameter's index in one process's optimizer state, and the group sizes there."""
    if pp_group is None:
        params = [p for group in groups for p in group]
        return {id(p): i for i, p in enumerate(params)}, [len(g) for g in groups]
    name_of = view.name_of  # a tied weight under its one-process name
    mine = [[name_of[id(p)] for p in group] for group in groups]
    parts: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, mine, group=pp_group)
    position = {name: i for i, name in enumerate(order or [])}
    merged = [
        sorted({n for part in parts for n in part[g]}, key=position.__getitem__)
        for g in range(len(groups))
    ]
    index = {name: i for i, name in enumerate(n for group in merged for n in group)}
    return {id(p): index[name_of[id(p)]] for group in groups for p in group}, [
        len(g) for g in merged
    ]


def full_optimizer_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    engine: Optional[ZeroDataParallel] = None,
    pp_group: Any = None,
    order: Optional[list[str]] = None,
) -> dict[str, Any]:
    """The user's optimizer's ``state_dict()`` as one process would have it. A collective."""
    # Before any collective: quantized states split across ranks cannot be gathered.
    refuse_sharded_quantized(optimizer)
    view = StateView(module)
    groups = optimizer_params(optimizer, engine)
    params = [p for group in groups for p in group]
    index_of, sizes = _param_layout(view, groups, pp_group, order)
    if state_in_slices(engine):
        per_param = engine.gather_param_states(optimizer)
        if engine.experts is not None:  # expert weights in their own engine (expert_zero.py)
            per_param.update(engine.experts.gather_param_states(optimizer))
        # Parameters in no bucket (expert weights, parallel/expert.py) keep their own state.
        per_param.update({id(p): optimizer.state[p] for p in params if p in optimizer.state})
    else:
        per_param = {id(p): optimizer.state.get(p, {}) for p in params}
    state = {
        index_of[id(p)]: {key: view.full(p, value) for key, value in per_param[id(p)].items()}
        for p in params
        if per_param.get(id(p))
    }
    if pp_group is not None:
        parts: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, state, group=pp_group)
        merged: dict[int, Any] = {}
        # A tied weight's state comes from each stage holding a copy: equal, kept once.
        for part in parts:
            for index, entry in part.items():
                merged.setdefault(index, entry)
        state = dict(sorted(merged.items()))
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    param_groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": list(range(start, start + size)),
        }
        for group, start, size in zip(optimizer.param_groups, starts, sizes)
    ]
    return {"state": state, "param_groups": param_groups}


def load_full_optimizer_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    engine: Optional[ZeroDataParallel] = None,
    pp_group: Any = None,
    order: Optional[list[str]] = None,
) -> None:
    """Inverse of :func:`full_optimizer_state`, into any layout of the same model."""
    view = StateView(module)
    groups = optimizer_params(optimizer, engine)
    index_of, sizes = _param_layout(view, groups, pp_group, order)
    saved_sizes = [len(g["params"]) for g in saved["param_groups"]]
    if sizes != saved_sizes:
        raise ValueError(
            f"optimizer param groups differ: checkpoint has sizes {saved_sizes}, model has {sizes}"
        )
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    params = [p for group in groups for p in group]
    # torch's optimizers keep their state in the parameter's dtype (and cast to it on load); an
    # optimizer that says otherwise (OffloadedAdam: fp32 moments and master weights for bf16
    # parameters) gets it as saved — cast, a resumed run would step from rounded weights.
    dtype = getattr(optimizer, "state_dtype", None) or (engine and engine.state_dtype)
    per_param = {}
    for p in params:
        index = index_of[id(p)]
        entry = saved["state"].get(index, saved["state"].get(str(index)))
        if entry:
            per_param[id(p)] = {k: view.local_like(p, v, dtype) for k, v in entry.items()}
    if state_in_slices(engine):
        engine.load_param_states(optimizer, per_param)
        experts = engine.experts  # expert weights in their own engine (expert_zero.py)
        if experts is not None:
            experts.load_param_states(optimizer, per_param)
        for p in params:  # in no bucket (expert weights): their own state, as saved
            owners = [e for e in (engine, experts) if e is not None and e.slice_of(p) is not None]
            if id(p) in per_param and not owners:
                optimizer.state[p] = per_param[id(p)]
    else:
        for p in params:
            if id(p) in per_param:
                optimizer.state[p] = per_param[id(p)]
