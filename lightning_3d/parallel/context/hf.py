"""Hugging Face decoders under context parallelism, through transformers' attention interface.

``transformers`` runs attention through a registry of functions keyed by
``config._attn_implementation``; :func:`route_hf_attention` registers :func:`attention_forward`
under :data:`IMPLEMENTATION` and switches the model to it (``set_attn_implementation``), so the
model's own layers call it with their rotated q, k, v — nothing of the model is rewritten. An
implementation name ``transformers`` has no mask function for gets no mask (its mask helpers
return ``None``): the kernels apply the causal mask themselves, at each rank's true positions,
which the wrapper passes as ``position_ids`` (rotary and learned positions both read them).
Packed rows' documents (:mod:`.batch`) reach it as the keyword ``document_ids``, which the
model's layers pass on to the attention function with their other keywords.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from lightning_3d.families.mixers import (
    is_routed_attention,
    layer_list,
    layers_without_attention,
    mixer_problems,
)
from lightning_3d.parallel.context.attention import ATTR

IMPLEMENTATION = "lightning_3d_context"


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention signature: q (B, H, T/cp, D), k/v (B, H_kv, T/cp, D) of this
    rank's tokens, ``document_ids`` (B, T) of the whole sequence among the keywords for packed
    rows; returns (B, T/cp, H, D) and no weights."""
    attend = getattr(module, ATTR, None)
    if attend is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attention {IMPLEMENTATION!r} but was not given the "
            f"context group (apply_context_parallel)"
        )
    if attention_mask is not None:
        raise ValueError(
            "context parallelism takes no attention mask (padding or packed sequences): "
            "its kernels apply the causal mask themselves"
        )
    documents = kwargs.get("document_ids")
    out = attend(query, key, value, scaling, documents)  # (B, H, T/cp, D)
    return out.transpose(1, 2).contiguous(), None


def is_hf_model(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return hasattr(module, "set_attn_implementation") and hasattr(config, "_attn_implementation")


def hf_problems(model: nn.Module) -> list[str]:
    """What context parallelism (``parallelism.context``) cannot route in a ``transformers``
    model: token mixers that are not attention through the attention interface (linear attention,
    Mamba, convolutions: :mod:`lightning_3d.families.mixers`), and attention its kernels do not
    compute (dropout, sliding windows, chunked attention, soft-capping, sinks)."""
    config, name = model.config, type(model).__name__
    problems = mixer_problems(model)
    for cls, layers in layers_without_attention(model).items():
        problems.append(
            f"{name}: {layer_list(layers)} ({cls}) {'hold' if len(layers) > 1 else 'holds'} "
            "no attention module it can route "
            "(a class named *Attention with the model's config and a layer_idx)"
        )
    if not model._can_set_attn_implementation():
        problems.append(f"{name} does not run attention through transformers' attention interface")
    if getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_pdrop", 0.0):
        dropout = getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_pdrop", 0.0)
        problems.append(f"{name}: attention dropout {dropout} (the kernels have none); set it to 0")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        problems.append(
            f"{name}: sliding-window attention (sliding_window={window}), which the context "
            "kernels do not compute"
        )
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None and "chunked_attention" in (getattr(config, "layer_types", None) or []):
        problems.append(f"{name}: chunked attention (attention_chunk_size={chunk})")
    for key in ("attn_logit_softcapping", "attn_logit_softcap"):
        if getattr(config, key, None) is not None:
            problems.append(f"{name}: attention logit soft-capping ({key}={getattr(config, key)})")
    sinks = sorted(
        {type(m).__name__ for m in model.modules() if isinstance(getattr(m, "sinks", None), Tensor)}
    )
    if sinks:
        problems.append(
            f"{name}: attention sinks ({', '.join(sinks)}.sinks; the kernels have none)"
        )
    return [f"context parallelism (parallelism.context): {p}" for p in problems]


def route_hf_attention(model: nn.Module, attend: Any) -> list[str]:
    """Register :func:`attention_forward`, switch ``model`` to it and give every attention module
    ``attend``; returns the names of those modules. ``ValueError`` for what cannot be routed."""
    from transformers import AttentionInterface

    problems = hf_problems(model)
    if problems:
        raise ValueError("; ".join(problems))
    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    model.set_attn_implementation(IMPLEMENTATION)
    # Pipeline stages call the model themselves (models/hf_pipeline.py): the positions to pass.
    model.context_shard = attend
    routed = []
    for name, sub in model.named_modules():
        # The modules that call the interface: those holding the model's config and a layer index.
        if is_routed_attention(sub):
            setattr(sub, ATTR, attend)
            routed.append(name)
    return routed
