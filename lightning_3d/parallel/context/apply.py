"""Routing a model's attention through context parallelism, and splitting its batches.

:func:`apply_context_parallel` gives every attention layer it can route the same
:class:`~lightning_3d.parallel.context.attention.ContextAttention`: the reference GPT's
(an attribute ``context_attention``) and a Hugging Face model's (through transformers' attention
interface, :mod:`.hf`); modules that compute positions (an attribute ``context_shard``: the GPT,
``HFCausalLM``) get it too, for the positions of this rank's tokens. A model with no attention
to route is refused with its name. (Each rank's part of a batch: :mod:`.batch`.)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_3d.parallel.context.attention import ATTR, ContextAttention

POSITIONS_ATTR = "context_shard"  # a module that computes positions holds the ContextAttention


def apply_context_parallel(module: nn.Module, group: Any, scheme: str) -> ContextAttention:
    """Set ``module``'s attention layers (and its positions) to run across the context ``group``
    by ``scheme``, in place; returns the attention object they share."""
    from lightning_3d.parallel.context.hf import is_hf_model, route_hf_attention

    attend = ContextAttention(group, scheme)
    routed = []
    for name, sub in module.named_modules():
        if is_hf_model(sub) and not routed:
            routed += route_hf_attention(sub, attend)
        if hasattr(sub, POSITIONS_ATTR):
            setattr(sub, POSITIONS_ATTR, attend)
        if not hasattr(sub, ATTR) or name in routed:
            continue
        dropout = getattr(sub, "dropout", 0.0)
        if isinstance(dropout, float) and dropout > 0:
            raise ValueError(
                f"{name}: attention dropout {dropout} under context parallelism (the kernels "
                f"run attention without dropout); set attn_dropout=0"
            )
        setattr(sub, ATTR, attend)
        routed.append(name)
    if not routed:
        raise ValueError(
            f"{type(module).__name__} has no attention layer context parallelism can route "
            f"(the reference GPT's, or a Hugging Face model's); context must be 1 for it"
        )
    return attend


def context_problems(
    module: nn.Module, scheme: str, size: int, tensor: int = 1, pipeline: int = 1
) -> list[str]:
    """What keeps ``module`` (built on ``meta`` is enough) from running with ``context=size`` by
    ``scheme`` beside ``tensor`` and ``pipeline``: no attention to route, attention the kernels
    cannot compute (dropout, sliding windows, soft-capping, sinks), token mixers that are not
    attention (linear attention, Mamba), heads that all-to-all cannot split.
    ``pipeline`` is for the callers' symmetry: every pipeline composes."""
    from lightning_3d.parallel.context.hf import hf_problems, is_hf_model

    hf = next((m for m in module.modules() if is_hf_model(m)), None)
    if hf is not None:
        problems = hf_problems(hf)
        # A model without attention heads (Mamba) is refused by hf_problems already.
        heads = [h for h in [getattr(hf.config, "num_attention_heads", None)] if h is not None]
    else:
        layers = [(name, sub) for name, sub in module.named_modules() if hasattr(sub, ATTR)]
        if not layers:
            return [
                f"{type(module).__name__} has no attention layer context parallelism can route "
                f"(the reference GPT's, or a Hugging Face model's); context={size} must be 1"
            ]
        problems = [
            f"{name}: attention dropout {sub.dropout} under context={size} (the kernels have "
            f"none); set attn_dropout=0"
            for name, sub in layers
            if isinstance(getattr(sub, "dropout", 0.0), float) and sub.dropout > 0
        ]
        heads = sorted({sub.n_head for _, sub in layers if hasattr(sub, "n_head")})
    if scheme == "alltoall":
        problems += [
            f"context_scheme='alltoall' needs the attention heads ({h}) divisible by context × "
            f"tensor ({size} × {tensor} = {size * tensor}); use context_scheme='ring'"
            for h in heads
            if h % (size * tensor)
        ]
    return problems
