"""A per-parameter view of a parallelized module's state, as one process would hold it.

Both checkpoint writers (``consolidated.py``: full tensors, rank 0 writes; ``sharded.py``: each
rank writes what it holds) and :func:`full_state_dict` need the same three translations between
this rank's layout and a single process's, and this module is the only place that makes them:

- names: each parameter under its one-process name, a tied weight under its canonical name
  whichever of its modules this pipeline stage holds (:class:`StateView` ``.name_of``,
  :func:`tied_aliases`);
- fused q/k/v rows: tensor parallelism regroups a fused projection's output rows per rank
  (``FusedColwiseParallel``, recorded on the module as ``FUSED_ROWS_ATTR``); saved state is in
  the plain model's row order (:func:`fused_rows`);
- full <-> local: a ``DTensor`` (tensor parallel, ZeRO-3, a ZeRO 1/2 slice) gathered to a full
  tensor on CPU (:func:`to_full`), and a full tensor cut back to this rank's part laid out like
  a parameter (:func:`to_local_like`).

It also says which tensors hold a parameter's optimizer state: the parameters of the user's
param groups (:func:`optimizer_params`), kept in the ZeRO engine's slices when
:func:`state_in_slices`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lightning_3d.parallel.tensor import FUSED_ROWS_ATTR, local_tensor, regroup_fused_rows
from lightning_3d.parallel.tied import TIED_ALIASES_ATTR, param_names

if TYPE_CHECKING:
    from lightning_3d.parallel.zero import ZeroDataParallel

Fused = Optional[tuple[int, ...]]  # regroup_fused_rows' (chunks, tp[, dim]), None: not fused


# ------------------------------------------------------------------------------ names and rows
def fused_rows(module: nn.Module) -> dict[int, tuple[int, ...]]:
    """``id(parameter) -> (chunks, tp[, dim])`` for the fused projections tensor parallelism
    regrouped. Keyed by the parameter object (not its name): a pipeline stage or a tied alias
    may name it differently, the object is the same."""
    return {
        id(p): getattr(mod, FUSED_ROWS_ATTR)
        for mod in module.modules()
        if hasattr(mod, FUSED_ROWS_ATTR)
        for p in mod.parameters(recurse=False)
    }


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """``alias -> canonical name`` of tied weights (empty when nothing is tied)."""
    return getattr(module, TIED_ALIASES_ATTR, {})


# ------------------------------------------------------------------------------ full <-> local
def to_full(value: Any, fused: Fused = None, to_cpu: bool = True) -> Any:
    """``value`` at full size in the plain model's row order, detached and copied (to CPU unless
    ``to_cpu=False``). A collective when ``value`` is a ``DTensor``. Non-tensors pass through."""
    if not isinstance(value, Tensor):
        return value
    full = value.full_tensor() if isinstance(value, DTensor) else value
    if callable(getattr(full, "get_original_weight", None)):  # torchao's NF4: dequantized values
        full = full.get_original_weight()
    if fused is not None and full.dim() >= 1:
        full = regroup_fused_rows(full, *fused, inverse=True)
    full = full.detach()
    return full.to("cpu", copy=True) if to_cpu else full.clone()


def to_local_like(
    full: Any, param: Tensor, fused: Fused = None, dtype: Optional[torch.dtype] = None
) -> Any:
    """A full tensor laid out like ``param``: this rank's shard (a DTensor) if ``param`` is one,
    on its device, in ``dtype`` (default: the parameter's). Scalars and non-tensors are copied."""
    if not isinstance(full, Tensor) or full.dim() == 0:
        return full.clone() if isinstance(full, Tensor) else full
    device = local_tensor(param).device
    if is_traceable_wrapper_subclass(full) and not isinstance(param, DTensor):
        # A quantized optimizer state (low-bit AdamW, parallel/optimizers.py): its codes, scales
        # and map as saved, copied to the parameter's device; a cast would change its meaning.
        return full.to(device=device, copy=True)
    full = full.to(device=device, dtype=dtype or param.dtype)
    if fused is not None:
        full = regroup_fused_rows(full, *fused)
    if isinstance(param, DTensor):
        # Every rank holds the full tensor (it read the file): take the local part, no traffic.
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full.clone()


class StateView:
    """One module's parameters as one process would name and lay them out.

    Built once per save or load (``FUSED_ROWS_ATTR`` and the aliases are read then: DTensor
    parameters are new objects after ``Module._apply``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.name_of = param_names(module)  # id(parameter) -> its one-process name
        self.fused = fused_rows(module)  # id(parameter) -> regrouping, for fused projections

    def fused_by_name(self) -> dict[str, tuple[int, ...]]:
        """The fused projections under their names in this module (as ``state_dict()`` has them)."""
        return {
            name: self.fused[id(p)]
            for name, p in self.module.named_parameters()
            if id(p) in self.fused
        }

    def full(self, param: Tensor, value: Any) -> Any:
        """``value`` (``param`` itself or a state shaped like it) at full size on CPU."""
        return to_full(value, self.fused.get(id(param)))

    def local_like(self, param: Tensor, full: Any, dtype: Optional[torch.dtype] = None) -> Any:
        """A full ``value`` for ``param`` cut to this rank's part, laid out like ``param``."""
        return to_local_like(full, param, self.fused.get(id(param)), dtype)

    @torch.no_grad()
    def copy_into(self, target: Tensor, full: Tensor) -> None:
        """Load a full tensor into a parameter or buffer in place (this rank's part of it)."""
        local_tensor(target).copy_(local_tensor(self.local_like(target, full)))


# ------------------------------------------------------------------------------ optimizer state
def optimizer_params(
    optimizer: torch.optim.Optimizer, engine: Optional[ZeroDataParallel]
) -> list[list[Tensor]]:
    """The model parameters of each param group, as the user built them (a ZeRO engine has
    replaced the optimizer's own groups with its slices)."""
    return (
        engine.original_groups
        if engine is not None
        else [g["params"] for g in optimizer.param_groups]
    )


def state_in_slices(engine: Optional[ZeroDataParallel]) -> bool:
    """Whether the optimizer state lives in the engine's flat slices (ZeRO 1/2, or fp32 masters),
    not per parameter."""
    return engine is not None and engine.state_in_slices


# ------------------------------------------------------------------------------ the whole model
def full_state_dict(
    module: nn.Module,
    to_cpu: bool = True,
    pp_group: Any = None,
    keep: Optional[Callable[[str], bool]] = None,
) -> dict[str, Tensor]:
    """Every parameter and buffer at full size, keyed by its one-process name.

    A collective when the module holds ``DTensor`` s (ZeRO-3, tensor parallel): call it on every
    rank. Parameters that are views of ZeRO flat buffers are cloned out of them. With
    ``pp_group`` (pipeline stages, each holding other parameters) the stages' dicts are merged.
    ``keep(name)``: only those tensors are gathered (a checkpoint of LoRA adapters never
    assembles the frozen base).
    """
    fused, aliases = fused_rows(module), tied_aliases(module)
    # A tied weight under its one-process name, whichever of its modules this stage holds.
    state = {
        aliases.get(name, name): to_full(tensor, fused.get(id(tensor)), to_cpu)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
        if keep is None or keep(aliases.get(name, name))
    }
    if pp_group is not None:
        parts: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=pp_group)
        state = {k: v for part in parts for k, v in part.items()}
    return state
