"""Full (unsharded) views of a model's state, whatever the layout it was trained in."""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_3d.parallel.tensor import FUSED_ROWS_ATTR, regroup_fused_rows
from lightning_3d.parallel.tied import TIED_ALIASES_ATTR


def full_state_dict(module: nn.Module, to_cpu: bool = True, pp_group=None) -> dict[str, Tensor]:
    """Every parameter and buffer at full size, keyed by its name in ``module``.

    A collective when the module holds ``DTensor`` s (ZeRO-3, tensor parallel): call it on every
    rank. Parameters that are views of ZeRO flat buffers are cloned out of them. With
    ``pp_group`` (pipeline stages, each holding other parameters) the stages' dicts are merged.
    """
    fused = {
        f"{name}.{pname}" if name else pname: getattr(mod, FUSED_ROWS_ATTR)
        for name, mod in module.named_modules()
        if hasattr(mod, FUSED_ROWS_ATTR)
        for pname, _ in mod.named_parameters(recurse=False)
    }
    # A tied weight under its one-process name, whichever of its modules this stage holds.
    aliases = getattr(module, TIED_ALIASES_ATTR, {})
    state: dict[str, Tensor] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        name = aliases.get(name, name)
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if name in fused:  # undo FusedColwiseParallel's row regrouping
            full = regroup_fused_rows(full, *fused[name], inverse=True)
        full = full.detach()
        state[name] = full.to("cpu", copy=True) if to_cpu else full.clone()
    if pp_group is not None:
        import torch.distributed as dist

        parts = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=pp_group)
        state = {k: v for part in parts for k, v in part.items()}
    return state
