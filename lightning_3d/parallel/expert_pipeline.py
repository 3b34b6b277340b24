"""Mixture-of-experts layers under a pipeline: each layer's load-balancing loss carried by its
own activations, so it reaches the objective from whichever stage holds the layer.

Without a pipeline, ``LitMoEGPT`` adds ``aux_loss_coef * model.aux_loss()`` (every layer's
load-balancing loss) to the cross-entropy, and one backward covers both. Under a pipeline the
schedule computes the loss on the last stage only, from the last stage's outputs; a layer on
another stage is out of its reach, and the schedule's backward starts from the loss alone. So
each layer attaches its weighted loss to its output (Megatron-LM's ``MoEAuxLossAutoScaler``
does the same): :func:`carry_loss` returns the activations unchanged, and in backward gives the
loss the gradient it would have had as a term of the micro-batch's loss, ``weight`` — the
factor the pipeline gives every micro-batch's loss (``1 / (micro_batches * k)``, times the
16-mixed loss scale). The router's gradient then arrives through the same backward as the
activations', on its own stage, on any schedule that runs each micro-batch's backward once.

Why not another way: summing the layers' losses onto the last stage's loss would need their
graphs sent along with the activations (``torch.distributed.pipelining`` sends tensors, not
graphs); a separate backward of each stage's losses would be a second backward per micro-batch
outside the schedule's order, with the expert all-to-alls of the ``ep`` ranks in an order no
schedule promises.

The weights are the same as under gradient accumulation on one process (a step of ``m``
micro-batches, each with its own load-balancing statistics over its global micro-batch, each
term divided by ``m * k``), so a pipeline trains what one process does with the same
micro-batches accumulated; the objective's per-step factor (``parallel/objective.py``) then
rescales both alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_3d.parallel.expert import moe_layers


class _CarryLoss(torch.autograd.Function):
    """Identity on ``x``; backward gives ``loss`` the gradient ``weight`` (a 0-d tensor)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, loss: Tensor, weight: Tensor) -> Tensor:
        ctx.loss_dtype, ctx.weight = loss.dtype, weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        # On the device: the weight is a device tensor, the gradient a broadcast of it.
        return grad, ctx.weight.detach().to(ctx.loss_dtype), None


def carry_loss(x: Tensor, loss: Tensor, weight: Tensor) -> Tensor:
    """``x`` unchanged; its backward also runs ``loss``'s with gradient ``weight``, as if
    ``weight * loss`` had been added to the objective. Outside autograd: ``x``."""
    if not torch.is_grad_enabled() or not loss.requires_grad:
        return x
    return _CarryLoss.apply(x, loss, weight)


def carry_aux_losses(module: nn.Module, weight: Callable[[], Tensor]) -> int:
    """Give every mixture-of-experts layer of ``module`` that computes a load-balancing loss
    (an ``aux_loss_coef`` attribute: the reference MoE) the pipeline's loss weight; each then
    carries ``aux_loss_coef * aux_loss`` on its output (:func:`carry_loss`); so does ``module``
    itself where it has an ``aux_weight`` attribute (a loss of all its layers together, carried
    by its last stage: a Hugging Face family's router loss, ``models/hf_pipeline_router.py``).
    ``weight()``: a 0-d device tensor, read at every forward. Returns the number of carriers
    given it. In place."""
    layers = [layer for layer in moe_layers(module) if hasattr(layer, "aux_loss_coef")]
    carriers = layers + ([module] if hasattr(module, "aux_weight") else [])
    for carrier in carriers:
        carrier.aux_weight = weight
    return len(carriers)
