"""fp32 master weights for a low-precision module under ZeRO 0-2: when, and what it costs.

The ZeRO paper's memory formula assumes mixed-precision Adam: 2 bytes of bf16 (fp16) weight and
2 of gradient a parameter on every rank, and 12 bytes of fp32 master weight, momentum and
variance, sharded from stage 1 on (stage 0 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N).
Lightning's ``precision="bf16-true"`` converts the module to bf16; the flat-bucket engine
(``zero.py``) then keeps bf16 buckets and, for each rank's slice, an fp32 master that the
optimizer steps and that is rounded back into the bucket after every step. This module decides
when the engine does so (:func:`master_options`), refuses the combinations it was not built for
(:func:`refuse_master_combinations`), and counts the bytes it holds (:func:`zero_state_bytes`),
from the tensors themselves, for the tests and the bench.

Under ``bf16-mixed`` nothing changes: the module's weights are fp32 and autocast computes in
bf16, so there is nothing to keep a master of (16Ψ at every stage below 3, 4Ψ of it in fp32
gradients); ``bf16-true`` is how to ask for the paper's memory (docs/memory.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

from lightning_3d.parallel.tensor import local_tensor

if TYPE_CHECKING:
    from lightning_3d.parallel.zero import ZeroDataParallel

MASTER_DTYPE = torch.float32
# Lightning's precision names under which the module itself is converted to a low precision.
LOW_PRECISION_MODULES = ("bf16-true", "16-true")


def master_options(optimizer: torch.optim.Optimizer, plan: Any) -> dict[str, Any]:
    """``ZeroDataParallel`` keywords for ``optimizer`` under ``plan`` (the ``zero`` group's):
    ``defer_reduce`` as given, and fp32 masters where the
    ``zero`` group asks for them, the optimizer trains parameters of a lower precision, and no
    offload device keeps its own (``OffloadedAdam`` holds fp32 masters in its store). An
    optimizer over fp32 parameters (``bf16-mixed``, ``32-true``) gets none, so one rank at stage 0
    keeps its no-copy pass-through."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    low = any(p.is_floating_point() and p.element_size() < 4 for p in params)
    deferred = {"defer_reduce": plan.zero.defer_reduce}
    if not (plan.zero.master_weights and low and plan.offload.device == "none"):
        return deferred
    return {**deferred, "master_dtype": MASTER_DTYPE, "grad_dtype": plan.zero.grad_dtype}


def refuse_master_combinations(plan: Any, precision: str) -> None:
    """``ValueError`` before any rewrite when fp32 masters would meet what they were not built
    and tested with: sharded checkpoints (their writer saves slices of the bf16 buckets;
    consolidated ones save the masters). ``zero_master_weights=False`` runs them as before."""
    layout = plan.layout
    if not (plan.zero.master_weights and str(precision) in LOW_PRECISION_MODULES):
        return
    if layout.zero_stage == 3 or plan.offload.device != "none":
        return
    if plan.checkpoint.format == "sharded":  # its writer saves slices of the bf16 buckets
        raise ValueError(
            f"precision={precision!r} with zero_stage={layout.zero_stage} keeps fp32 master weights "
            "(zero_master_weights=True), which do not support checkpoint_format='sharded' yet: use "
            "checkpoint_format='consolidated', precision='bf16-mixed', zero_stage=3, or "
            "zero_master_weights=False"
        )


def zero_state_bytes(
    module: nn.Module, optimizer: torch.optim.Optimizer, engine: Optional[ZeroDataParallel]
) -> dict[str, int]:
    """Model-state bytes on this rank, counted once per storage from the tensors themselves:
    ``params`` (the module's, i.e. the flat buckets), ``grads`` (the engine's gradient buffers and
    any ``.grad`` of the module's parameters), ``masters`` (the optimizer's parameters that are
    not the module's: fp32 masters; a slice that is a view of a bucket is counted there),
    ``master_grads`` (their gradients where they are copies, made for one step) and
    ``optimizer_state``."""
    seen: set[int] = set()

    def count(tensors: list[Optional[Tensor]]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = local_tensor(t).untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    params = list(module.parameters())
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    buckets = engine.buckets if engine is not None else []
    buffers = [t for b in buckets for t in (b.grad, b.shard_grad, b.staging)]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    return {
        "params": count(params),
        "grads": count(buffers + [p.grad for p in params]),
        "masters": count(stepped),
        "master_grads": count([p.grad for p in stepped]),
        "optimizer_state": count(state),
    }


def paper_bytes(num_params: int, stage: int, data: int) -> float:
    """The ZeRO paper's model-state bytes per rank with mixed-precision Adam (K = 12)."""
    psi, n = num_params, data
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[
        stage
    ]
