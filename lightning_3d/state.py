"""Full (unsharded) views of a model's state, whatever the layout it was trained in."""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def full_state_dict(module: nn.Module, to_cpu: bool = True) -> dict[str, Tensor]:
    """Every parameter and buffer at full size, keyed by its name in ``module``.

    A collective when the module holds ``DTensor`` s (ZeRO-3, tensor parallel): call it on every
    rank. Parameters that are views of ZeRO flat buffers are cloned out of them.
    """
    state: dict[str, Tensor] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        full = full.detach()
        state[name] = full.to("cpu", copy=True) if to_cpu else full.clone()
    return state

