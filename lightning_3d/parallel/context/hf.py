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
    """What context parallelism cannot route in a ``transformers`` model (its config's values)."""
    config, problems = model.config, []
    name = type(model).__name__
    if not model._can_set_attn_implementation():
        problems.append(f"{name} does not run attention through transformers' attention interface")
    if getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_pdrop", 0.0):
        dropout = getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_pdrop", 0.0)
        problems.append(f"{name}: attention dropout {dropout} (the kernels have none); set it to 0")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        problems.append(f"{name}: sliding-window attention (sliding_window={window})")
    for key in ("attn_logit_softcapping", "attn_logit_softcap"):
        if getattr(config, key, None) is not None:
            problems.append(f"{name}: attention logit soft-capping ({key}={getattr(config, key)})")
    return problems


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
        if (
            hasattr(sub, "layer_idx")
            and hasattr(sub, "config")
            and "Attention" in type(sub).__name__
        ):
            setattr(sub, ATTR, attend)
            routed.append(name)
    return routed
