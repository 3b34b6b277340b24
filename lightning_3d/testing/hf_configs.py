"""Tiny random ``transformers`` configs for tests and examples (no downloads): byte vocabulary
(256, as the embedded data), 2 layers, fp32, no dropout, so parallel layouts can be compared with
one process number by number."""

from __future__ import annotations

from typing import Any

_ROTARY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.0)

TINY_HF: dict[str, dict[str, Any]] = {
    # grouped-query attention: 4 query heads share 2 k/v heads
    "llama": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=False, **_ROTARY),
    # tied input embedding and LM head (as Qwen2-0.5B)
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True, **_ROTARY),
    # Conv1D projections, fused q/k/v, tied embedding and head
    "gpt2": dict(model_type="gpt2", vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                 bos_token_id=255, eos_token_id=255),  # GPT-2's own 50256 lies outside a byte vocabulary
}


def tiny_hf_config(family: str, **overrides: Any) -> dict[str, Any]:
    """A copy of ``TINY_HF[family]`` with ``overrides``; ``ValueError`` for an unknown family."""
    if family not in TINY_HF:
        raise ValueError(f"unknown tiny Hugging Face family {family!r}; known: {sorted(TINY_HF)}")
    return {**TINY_HF[family], **overrides}
