"""Consolidated checkpoints: full tensors in the format of a single-process run.

Whatever the layout (ZeRO slices, FSDP2 shards, tensor-parallel DTensors, fused q/k/v regrouped
rows), the model state is saved under the ``LightningModule``'s own parameter names at full size,
and the optimizer state as ``torch.optim.Optimizer.state_dict()`` of the user's optimizer would
look in one process (state keyed by parameter index, in the user's param-group order). Such a
checkpoint loads into plain Lightning and resumes under any other layout: each rank takes its
own part on load. The cost is that saving gathers everything (every rank takes part, rank 0
writes) — fine for models whose state fits in one host's memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_3d.parallel.tensor import FUSED_ROWS_ATTR, local_tensor, regroup_fused_rows
from lightning_3d.parallel.zero import ZeroDataParallel
from lightning_3d.state import full_state_dict


def _fused_params(module: nn.Module) -> dict[int, tuple[int, int]]:
    return {
        id(p): getattr(mod, FUSED_ROWS_ATTR)
        for mod in module.modules()
        if hasattr(mod, FUSED_ROWS_ATTR)
        for p in mod.parameters(recurse=False)
    }


def _to_full(value: Any, fused: Optional[tuple[int, int]]) -> Any:
    if not isinstance(value, Tensor):
        return value
    full = value.full_tensor() if isinstance(value, DTensor) else value
    if fused is not None and full.dim() >= 1:
        full = regroup_fused_rows(full, *fused, inverse=True)
    return full.detach().to("cpu", copy=True)


def _to_local_like(full: Any, param: Tensor, fused: Optional[tuple[int, int]]) -> Any:
    """A full tensor laid out like ``param``: this rank's shard (a DTensor) if ``param`` is one."""
    if not isinstance(full, Tensor) or full.dim() == 0:
        return full.clone() if isinstance(full, Tensor) else full
    device = local_tensor(param).device
    full = full.to(device=device, dtype=param.dtype)
    if fused is not None:
        full = regroup_fused_rows(full, *fused)
    if isinstance(param, DTensor):
        # Every rank holds the full tensor (it read the file): take the local part, no traffic.
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full.clone()


# ---------------------------------------------------------------------------------- model
def full_model_state(module: nn.Module) -> dict[str, Tensor]:
    """``module.state_dict()`` at full size on CPU. A collective: call on every rank."""
    full = full_state_dict(module)
    return {name: full[name] for name in module.state_dict() if name in full}


@torch.no_grad()
def load_full_model_state(module: nn.Module, state: Mapping[str, Tensor], strict: bool = True) -> None:
    """Copy full tensors into ``module``'s (possibly sharded) parameters and buffers in place."""
    own = dict([*module.named_parameters(), *module.named_buffers()])
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if strict and (missing or unexpected):
        raise KeyError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
    fused = _fused_params(module)
    for name, full in state.items():
        if name not in own:
            continue
        target = own[name]
        if tuple(full.shape) != tuple(target.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(full.shape)} != model shape {tuple(target.shape)}")
        value = _to_local_like(full, target, fused.get(id(target)))
        local_tensor(target).copy_(local_tensor(value))


# ------------------------------------------------------------------------------ optimizer
def _groups(optimizer: torch.optim.Optimizer, engine: Optional[ZeroDataParallel]) -> list[list[Tensor]]:
    return engine.original_groups if engine is not None else [g["params"] for g in optimizer.param_groups]


def _sharded_by_engine(engine: Optional[ZeroDataParallel]) -> bool:
    return engine is not None and engine.stage >= 1


def full_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, engine: Optional[ZeroDataParallel] = None
) -> dict[str, Any]:
    """The user's optimizer's ``state_dict()`` as one process would have it. A collective."""
    groups = _groups(optimizer, engine)
    params = [p for group in groups for p in group]
    if _sharded_by_engine(engine):
        per_param = engine.gather_param_states(optimizer)
    else:
        per_param = {id(p): optimizer.state.get(p, {}) for p in params}
    fused = _fused_params(module)
    state = {
        index: {key: _to_full(value, fused.get(id(p))) for key, value in per_param[id(p)].items()}
        for index, p in enumerate(params)
        if per_param.get(id(p))
    }
    index_of = {id(p): i for i, p in enumerate(params)}
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [index_of[id(p)] for p in members]}
        for group, members in zip(optimizer.param_groups, groups)
    ]
    return {"state": state, "param_groups": param_groups}


def load_full_optimizer_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    engine: Optional[ZeroDataParallel] = None,
) -> None:
    """Inverse of :func:`full_optimizer_state`, into any layout of the same model."""
    groups = _groups(optimizer, engine)
    sizes = [len(g) for g in groups]
    saved_sizes = [len(g["params"]) for g in saved["param_groups"]]
    if sizes != saved_sizes:
        raise ValueError(f"optimizer param groups differ: checkpoint has sizes {saved_sizes}, model has {sizes}")
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    params = [p for group in groups for p in group]
    fused = _fused_params(module)
    per_param = {}
    for index, p in enumerate(params):
        entry = saved["state"].get(index, saved["state"].get(str(index)))
        if entry:
            per_param[id(p)] = {k: _to_local_like(v, p, fused.get(id(p))) for k, v in entry.items()}
    if _sharded_by_engine(engine):
        engine.load_param_states(optimizer, per_param)
    else:
        for p in params:
            if id(p) in per_param:
                optimizer.state[p] = per_param[id(p)]
