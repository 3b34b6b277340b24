"""A Hugging Face mixture-of-experts family's router loss across pipeline stages.

The family's loss (``models/hf_moe.py``) is one product of sums pooled over every layer:
``coef * E * sum_e (C_e / N) * (P_e / N)``, ``C_e`` the slots sent to expert ``e`` by every
layer, ``P_e`` the router probabilities of ``e`` summed over every layer's rows, ``N`` the rows
of every layer. It is not a sum of per-layer terms, so each layer carrying its own term on its
activations (the reference MoE's way, ``parallel/expert_pipeline.py``) would train another
objective: the gradient of a layer's probabilities is weighted by the counts of every layer,
those of later stages too.

So the sums travel with the activations. Each stage returns, beside its hidden states, one
vector of ``3E + 1`` numbers: the counts, probability sums and rows of the layers so far, global
over the data (x context) ranks (:func:`~lightning_3d.parallel.objective.batch_sum`, one
all-reduce of ``2E + 1`` numbers per stage and micro-batch), and this rank's probability sums with
their gradient. The last stage adds its own layers' and computes the loss, which it carries on
its output (:func:`~lightning_3d.parallel.expert_pipeline.carry_loss`) with the weight the
schedule gives a micro-batch's loss (``1 / (micro_batches * k)``): the gradient reaches every
stage's routers back through the vector, sent by the schedule like any activation's. The
objective is one process's accumulating the same micro-batches (each micro-batch's loss from its
own global sums); the objective's per-step factor then rescales it with the cross-entropy, as
without a pipeline.

The router logits are taken where ``transformers`` records them for ``output_router_logits``
(the model's ``_can_record_outputs["router_logits"]``: a router class and the index of the
logits in its output), by forward hooks held for the stage's forward only. Under a pipeline no
attention mask reaches the layers (``models/hf_pipeline.py``): every row counts, as one process
counts rows given without a mask.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.models.hf_moe import RouterLoss, pooled_router_loss, router_sums
from lightning_3d.parallel.expert_pipeline import carry_loss
from lightning_3d.parallel.objective import batch_sum
from lightning_3d.parallel.pipeline import PipelineSpec


def router_recorder(model: nn.Module) -> tuple[type, int]:
    """The module class whose output holds the router logits in ``model`` (a ``transformers``
    causal LM), and their index in that output; ``ValueError`` naming the class for a family that
    records none."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", recorder)
    if not isinstance(target, type):
        raise ValueError(
            f"{type(model).__name__} does not say which module returns its router logits "
            "(no _can_record_outputs['router_logits']): its router loss cannot cross pipeline "
            "stages; set model.router_aux_loss_coef=0"
        )
    return target, int(getattr(recorder, "index", 0) or 0)


def carry_router_loss(lit: Any, spec: PipelineSpec, loss: RouterLoss) -> PipelineSpec:
    """``spec`` (``lit``'s Hugging Face pipeline split) with each stage carrying the router sums
    of ``loss`` to the next and the last stage carrying the loss on its output (the module
    docstring). ``lit.aux_weight`` (set by the strategy, ``carry_aux_losses``) gives the weight;
    ``lit.pipeline_router_aux`` sums the loss's value over the step's micro-batches."""
    target, index = router_recorder(lit.model)
    stage_forward = spec.stage_forward
    width = 3 * loss.experts + 1

    def forward(stage: Any, x: Any, *carried: Tensor) -> Any:
        # Only a micro-batch's training forward counts: not torch's shape inference (stand-in
        # inputs, run once before the first step), not a forward-only schedule.
        counting = torch.is_grad_enabled() and lit.training and _in_forward_chunk(lit)
        logits: list[Tensor] = []
        handles = [
            module.register_forward_hook(lambda m, args, out: logits.append(out[index]))
            for block in _stage_blocks(lit, spec, stage)
            for module in block.modules()
            if counting and isinstance(module, target)
        ]
        try:
            out = stage_forward(stage, x)
        finally:
            for handle in handles:
                handle.remove()
        sums = carried[0] if carried else _zeros(out, width)
        if logits:
            sums = sums + _stage_sums(logits, loss)
        if not stage.is_last:
            return out, sums
        weight = getattr(lit, "aux_weight", None)
        if not counting or weight is None:
            return out
        E = loss.experts
        # The probabilities' slot holds G times this rank's sums already (_stage_sums): size 1.
        aux = pooled_router_loss(sums[: 2 * E + 1], sums[2 * E + 1 :], 1, loss)
        before = getattr(lit, "pipeline_router_aux", None)
        lit.pipeline_router_aux = aux.detach() if before is None else before + aux.detach()
        return carry_loss(out, aux, weight())

    return dataclasses.replace(spec, stage_forward=forward)


def _stage_sums(logits: list[Tensor], loss: RouterLoss) -> Tensor:
    """This stage's part of the carried vector (3E + 1,): its layers' counts, probabilities and
    rows summed over the data (x context) ranks (no gradient), then ``G`` times this rank's
    probabilities (with it: the data-parallel average makes it the global gradient)."""
    probs, stats = router_sums(tuple(logits), loss)
    stats, size = batch_sum(stats)
    return torch.cat([stats, probs * size])


def _zeros(out: Any, width: int) -> Tensor:
    """The first stage's empty sums, beside its output; with a gradient where autograd records,
    so the vector every stage sends is one the schedule sends a gradient back for."""
    first = out[0] if isinstance(out, (tuple, list)) else out
    return torch.zeros(width, device=first.device, requires_grad=torch.is_grad_enabled())


def _in_forward_chunk(lit: Any) -> bool:
    """Whether a pipeline runs a micro-batch's forward now (``False`` outside a Trainer)."""
    trainer = getattr(lit, "_trainer", None)
    runtime = getattr(trainer.strategy, "pipeline", None) if trainer is not None else None
    return runtime is not None and runtime.in_forward_chunk


def _stage_blocks(lit: Any, spec: PipelineSpec, stage: Any) -> list[nn.Module]:
    """The blocks ``stage`` holds (by its block indices in the model's block list)."""
    layers = lit.get_submodule(spec.blocks)
    return [layers[i] for i in stage.block_ids]


def log_step_router_aux(lit: Any, device: torch.device) -> None:
    """Under a pipeline, at the end of ``lit``'s step: the router loss's mean over the step's
    micro-batches, the last stage's, logged on every stage of the pipeline group (one
    all-reduce; the other stages add 0) as ``router_aux_loss``, and added to the step's figures."""
    runtime = getattr(lit.trainer.strategy, "pipeline", None)
    if runtime is None:
        return
    aux, lit.pipeline_router_aux = getattr(lit, "pipeline_router_aux", None), None
    total = torch.zeros((), device=device) if aux is None else aux.to(device)
    dist.all_reduce(total, group=runtime.group)
    lit.log("router_aux_loss", total / runtime.micro_batches)
    if lit.expert_loads is not None:
        lit.expert_loads.add_aux(total, runtime.micro_batches)
