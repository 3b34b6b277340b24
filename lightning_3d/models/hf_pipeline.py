"""Pipeline specs for Hugging Face decoder families, so ``pipeline=N`` needs no user code.

Two layouts are known:

* ``model.layers`` decoders with rotary position embeddings (Llama, Qwen2, Mistral, Gemma-like):
  the first stage embeds (Gemma scales by sqrt(hidden)), every stage computes the rotary
  ``position_embeddings`` for its own layers from the model's ``rotary_emb`` (buffers only, kept
  on every rank), the last stage applies the final norm and the head.
* GPT-2 (``transformer.h``): token + position embeddings and dropout on the first stage, the final
  ``ln_f`` and the head on the last.

Attention masks do not cross stages: each layer runs causal attention with no mask, so right
padding must be marked in the targets (``-100``), which the loss skips.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightning_3d.parallel.pipeline import PipelineSpec


def _positions(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, T)


def _hidden(out: Any) -> torch.Tensor:
    """A decoder layer's residual stream (some return it first in a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def _spec(lit: Any, **parts: Any) -> PipelineSpec:
    """``parts`` (blocks, first, last, embed, head, block_forward) plus what every family shares:
    the module's loss, and batches as (input_ids, targets) — masks do not cross stages."""

    def split(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ids, _, targets = lit.split_batch(batch)
        return ids, targets

    return PipelineSpec(loss=lit.loss_fn, split_batch=split, inputs=lambda batch: split(batch)[0], **parts)


def _rotary_spec(lit: Any, prefix: str) -> PipelineSpec:
    outer = lit.model
    inner = outer.model
    scale = math.sqrt(outer.config.hidden_size) if outer.config.model_type.startswith("gemma") else None

    def embed(ids: torch.Tensor) -> torch.Tensor:
        x = inner.embed_tokens(ids)  # (B, T, C)
        return x * torch.tensor(scale, dtype=x.dtype) if scale is not None else x

    def block_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        positions = _positions(x)
        rotary = inner.rotary_emb(x, position_ids=positions)  # (cos, sin), each (1, T, head_dim)
        return _hidden(layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary))

    return _spec(
        lit,
        blocks=f"{prefix}.model.layers",
        first=(f"{prefix}.model.embed_tokens",),
        last=(f"{prefix}.model.norm", f"{prefix}.lm_head"),
        embed=embed,
        head=lambda x: outer.lm_head(inner.norm(x)),
        block_forward=block_forward,
    )


def _gpt2_spec(lit: Any, prefix: str) -> PipelineSpec:
    outer = lit.model
    inner = outer.transformer

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return inner.drop(inner.wte(ids) + inner.wpe(_positions(ids)))  # (B, T, C)

    return _spec(
        lit,
        blocks=f"{prefix}.transformer.h",
        first=(f"{prefix}.transformer.wte", f"{prefix}.transformer.wpe", f"{prefix}.transformer.drop"),
        last=(f"{prefix}.transformer.ln_f", f"{prefix}.lm_head"),
        embed=embed,
        head=lambda x: outer.lm_head(inner.ln_f(x)),
        block_forward=lambda block, x: _hidden(block(x, attention_mask=None)),
    )


def hf_pipeline_spec(lit: Any, prefix: str = "model") -> PipelineSpec:
    """The :class:`PipelineSpec` of ``lit.model`` (a ``transformers`` causal LM held at ``prefix``);
    ``ValueError`` naming the class for a layout not listed in the module docstring."""
    outer = lit.model
    inner = getattr(outer, "model", None)
    if inner is not None and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return _rotary_spec(lit, prefix)
    transformer = getattr(outer, "transformer", None)
    if transformer is not None and all(hasattr(transformer, a) for a in ("wte", "wpe", "h", "ln_f")):
        return _gpt2_spec(lit, prefix)
    raise ValueError(
        f"no pipeline spec for {type(outer).__name__}: known layouts are model.layers with rotary embeddings "
        "(Llama, Qwen2, Mistral, Gemma) and GPT-2's transformer.h; override pipeline_spec() to return a "
        "lightning_3d.PipelineSpec"
    )
