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


def max_abs_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, float]:
    """Largest absolute difference per tensor; raises ``KeyError`` naming keys missing on either side."""
    missing = sorted(set(a) ^ set(b))
    if missing:
        raise KeyError(f"state dicts differ in keys: {missing}")
    return {k: (a[k].float() - b[k].float()).abs().max().item() if a[k].numel() else 0.0 for k in a}


def max_rel_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """Largest ``|a - b| / max(|b|, 1e-3)`` over all tensors: relative, floored for near-zero entries."""
    worst = 0.0
    for key, diff in max_abs_diff(a, b).items():
        if a[key].numel():
            rel = ((a[key].float() - b[key].float()).abs() / b[key].float().abs().clamp_min(1e-3)).max().item()
            worst = max(worst, rel)
    return worst



