"""Lightning's ``grad_norm`` over the whole model when pipeline stages each hold a part of it.

``lightning.pytorch.utilities.grad_norm(module, norm_type)`` reads ``module.named_parameters()``:
under a pipeline, this stage's parameters only, so its ``grad_{p}_norm_total`` is one stage's.
:func:`grad_norm` answers the same keys for every parameter of every stage.
"""

from __future__ import annotations

from typing import Any, Union

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import grad_norm as stage_grad_norm

from lightning_3d.parallel.tied import TIED_ALIASES_ATTR


def grad_norm(
    module: Any, norm_type: Union[float, int, str], group_separator: str = "/"
) -> dict[str, torch.Tensor]:
    """Lightning's ``grad_norm`` of ``module``, for the whole model under a pipeline: each
    parameter's gradient norm under its one-process name, from whichever stage holds it (a tied
    weight once), and ``grad_{p}_norm_total`` over all of them. Without a pipeline (or outside
    a ``ThreeDStrategy`` fit) it is Lightning's. A collective under a pipeline: call it on every
    rank, e.g. ``self.log_dict(grad_norm(self, 2))`` in ``on_before_optimizer_step``.
    """
    norms = stage_grad_norm(module, norm_type, group_separator)
    group = _pipeline_group(module)
    if group is None:
        return norms
    total_key = f"grad_{float(norm_type)}_norm_total"
    prefix = f"grad_{float(norm_type)}_norm{group_separator}"
    aliases = getattr(module, TIED_ALIASES_ATTR, {})
    own = {
        prefix + aliases.get(key[len(prefix) :], key[len(prefix) :]): float(value)
        for key, value in norms.items()
        if key != total_key
    }
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, own, group=group)
    device = next((v.device for v in norms.values()), torch.device("cpu"))
    merged = {k: torch.tensor(v, device=device) for part in parts for k, v in part.items()}
    if merged:
        merged[total_key] = torch.stack(list(merged.values())).norm(float(norm_type))
    return merged


def _pipeline_group(module: Any) -> Any:
    """The pipeline group of the ``ThreeDStrategy`` fitting ``module`` (``None``: no pipeline)."""
    try:
        strategy = module.trainer.strategy
    except (AttributeError, RuntimeError):  # a plain nn.Module, or a module with no Trainer
        return None
    return getattr(getattr(strategy, "parallelized", None), "pp_group", None)
