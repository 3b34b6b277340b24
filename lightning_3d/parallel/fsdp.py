"""ZeRO-3 on the data-parallel axis with FSDP2 (``fully_shard``).

Each transformer block becomes its own FSDP unit so that only one block's full parameters
exist at a time: they are all-gathered just before the block runs and freed right after
(``reshard_after_forward=True``), gathered again for its backward, and its gradients are
reduce-scattered as soon as they are produced. Parameters, gradients and optimizer state are
then all ``DTensor`` shards (dim 0 over the data axis): 16Ψ/N bytes per rank for fp32 Adam.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the elements of every ``nn.ModuleList`` it contains."""
    blocks: list[nn.Module] = []
    for child in module.modules():
        if isinstance(child, nn.ModuleList):
            blocks.extend(m for m in child if any(p.requires_grad for p in m.parameters()))
    return blocks


def apply_zero3(
    module: nn.Module, dp_mesh: DeviceMesh, roots: Optional[list[nn.Module]] = None, **fsdp_kwargs
) -> list[nn.Module]:
    """Shard ``module`` with FSDP2, one unit per block plus outer units for the rest.

    ``module`` is typically a ``LightningModule``: its own ``forward`` may never run (Lightning
    calls ``training_step``), so the outer units are its direct children, whose forwards do run
    — or, under a pipeline, ``roots``: the stage modules the schedule calls. Returns the modules
    that became FSDP units.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    units: list[nn.Module] = []
    for block in find_blocks(module):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=True, **fsdp_kwargs)
        units.append(block)
    for child in roots if roots is not None else module.children():
        has_params = any(True for _ in child.parameters())
        if has_params and not isinstance(child, FSDPModule):
            # The outer unit holds what no block owns (embeddings, final norm, head).
            fully_shard(child, mesh=dp_mesh, reshard_after_forward=True, **fsdp_kwargs)
            units.append(child)
    return units
