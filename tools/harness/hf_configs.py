"""Tiny random ``transformers`` configs for tests and examples (no downloads): byte vocabulary
(256, as the embedded data), fp32, no dropout unless asked, so parallel layouts can be compared
with one process number by number.

Two sources: :data:`TINY_HF`, hand-picked families that together cover what the parallel code
must handle (the CI set), and :func:`registry_families` / :func:`tiny_config`, every decoder
family of the installed ``transformers`` whose config ships a tensor or pipeline plan, shrunk
by the sizes a pipeline check's twin gets (:mod:`lightning_3d.families.twin`; the whole matrix:
``python -m tools.harness.hf_matrix``).
"""

from __future__ import annotations

from typing import Any

_ROTARY = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    attention_dropout=0.0,
)
_SMALL = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# The CI set: each family stands for something the parallel code must get right.
TINY_HF: dict[str, dict[str, Any]] = {
    # grouped-query attention: 4 query heads share 2 k/v heads
    "llama": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=False, **_ROTARY),
    # tied input embedding and LM head (as Qwen2-0.5B)
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True, **_ROTARY),
    # Conv1D projections, fused q/k/v, tied embedding and head; ships no plan (names recognised)
    "gpt2": dict(
        model_type="gpt2",
        vocab_size=256,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=255,
        eos_token_id=255,
    ),  # GPT-2's own 50256 lies outside a byte vocabulary
    # per-head q/k norms: replicated weights whose gradients must be summed over tensor ranks
    "qwen3": dict(model_type="qwen3", head_dim=8, tie_word_embeddings=False, **_SMALL),
    # embedding scaled inside the embedding, sliding windows on every other layer, attention and
    # final logit soft-capping, tied head
    "gemma2": dict(
        model_type="gemma2", head_dim=8, sliding_window=8, tie_word_embeddings=True, **_SMALL
    ),
    # fused qkv_proj and gate_up_proj
    "phi3": dict(model_type="phi3", tie_word_embeddings=False, **_SMALL),
    # full-width q/k norms (gathered projections)
    "olmo2": dict(model_type="olmo2", tie_word_embeddings=False, **_SMALL),
    # mixture of experts: 3-D expert weights, a router
    "mixtral": dict(
        model_type="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        sliding_window=None,
        **_SMALL,
    ),
    # fused, per-head interleaved query_key_value; parallel residual; embed_in / final_layer_norm
    "gpt_neox": dict(
        model_type="gpt_neox",
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    ),
    # partial rotary, head dense, final_layernorm; embed_dropout on the first stage
    "phi": dict(
        model_type="phi",
        tie_word_embeddings=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        **{k: v for k, v in _SMALL.items() if k != "num_key_value_heads"},
    ),
    # ships no plan: Llama naming with global head counts read in the attention
    "stablelm": dict(
        model_type="stablelm",
        tie_word_embeddings=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **_SMALL,
    ),
}


def tiny_hf_config(family: str, **overrides: Any) -> dict[str, Any]:
    """A copy of ``TINY_HF[family]`` with ``overrides``; ``ValueError`` for an unknown family."""
    if family not in TINY_HF:
        raise ValueError(f"unknown tiny Hugging Face family {family!r}; known: {sorted(TINY_HF)}")
    return {**TINY_HF[family], **overrides}


def registry_families() -> list[str]:
    """Every causal-LM ``model_type`` of the installed ``transformers`` whose config class ships
    a tensor or pipeline plan, in the registry's order."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        cls = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
        if cls is not None and (cls.base_model_tp_plan or cls.base_model_pp_plan):
            out.append(model_type)
    return out


def tiny_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    """``model_type``'s default config shrunk as a pipeline check's twin is
    (:func:`lightning_3d.families.twin.shrunk`: its sizes where the config has them, every
    dropout at 0), then ``overrides``: a dict for :class:`~lightning_3d.models.HFCausalLM`'s
    ``config=``. A family in :data:`TINY_HF` gets its hand-picked config instead."""
    if model_type in TINY_HF:
        return tiny_hf_config(model_type, **overrides)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from lightning_3d.families.twin import SIZES, shrunk

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    aliases = getattr(cls, "attribute_map", {})
    sized = {aliases.get(k, k) for k in SIZES}
    options = {
        k: v
        for k, v in shrunk(defaults, aliases).items()
        if k in sized or (k == "layer_types" and v is not None) or v != defaults.get(k)
    }
    return {"model_type": model_type, **options, "tie_word_embeddings": False, **overrides}
