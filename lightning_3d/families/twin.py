"""A tiny random copy of a ``transformers`` model: the same family's code, with small sizes.

A pipeline split is checked on such a twin before any process starts (``hf_pipeline``), and
the tests and the family matrix build their models the same way (``tools.harness.hf_configs``). The
sizes (:data:`SIZES`) fit every family that derives nothing else from them: 4 heads over 2 k/v
heads (tensor=2 splits both), 4 layers (pipeline=2 gets 2 each; a family that alternates layer
types gets each type twice), a sliding window shorter than a test's 32-token blocks, 4 experts,
a byte vocabulary. Everything that makes a training forward random is off.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

SIZES: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    sliding_window=8,
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    rotary_dim=4,  # GPT-J, CodeGen: rotary on part of a head
    # multi-head latent attention (DeepSeek-V2/V3 and kin): low-rank q / kv, a rotary part per head
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    # state-space and linear-attention mixers (Mamba-2 hybrids, gated delta nets): their defaults
    # are full size, and transformers' reference kernels in Python are slow at those sizes
    mamba_d_ssm=64,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_d_state=16,
    mamba_chunk_size=16,
    mamba_num_heads=8,
    mamba_head_dim=8,
    ssm_state_size=16,
    chunk_size=16,
    linear_head_dim=8,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    moe_shared_expert_intermediate_size=32,
    shared_intermediate_size=32,
)
RANDOM_KEY_WORDS = ("dropout", "pdrop", "jitter")  # float config keys that make a forward random
MAX_PARAMS = 5_000_000  # above this the family derived sizes of its own: not a twin


def shrunk(options: dict[str, Any], aliases: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """``options`` (a config's keys) with :data:`SIZES` where it has them (under its own names:
    ``aliases`` is the config class's ``attribute_map``, GPT-2's ``hidden_size`` -> ``n_embd``),
    randomness off, and a per-layer ``layer_types`` list cycled over the new layer count in its
    own order of types."""
    aliases = aliases or {}
    out = dict(options)
    for key, value in SIZES.items():
        name = aliases.get(key, key)
        if name in options:
            out[name] = value
    if "qk_rope_head_dim" in options:  # multi-head latent attention: no grouped k/v heads, and
        # the rotary part is what its configs call head_dim
        mla = {
            "head_dim": SIZES["qk_rope_head_dim"],
            "num_key_value_heads": SIZES["num_attention_heads"],
        }
        for key, value in mla.items():
            if aliases.get(key, key) in options:
                out[aliases.get(key, key)] = value
    layers = aliases.get("num_hidden_layers", "num_hidden_layers")
    out.update(
        {
            k: 0.0
            for k, v in options.items()
            if isinstance(v, float) and any(w in k for w in RANDOM_KEY_WORDS)
        }
    )
    types = options.get("layer_types")
    if isinstance(types, list) and types and layers in out:
        order = list(dict.fromkeys(types))
        out["layer_types"] = [order[i % len(order)] for i in range(out[layers])]
    return out


def tiny_twin(model: nn.Module) -> Optional[nn.Module]:
    """A randomly initialised copy of the causal LM ``model``'s family at :data:`SIZES` (its
    attention implementation too), or ``None`` where the family does not build so."""

    config = model.config
    options = shrunk(config.to_dict(), getattr(type(config), "attribute_map", {}))
    for key in ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        options.pop(key, None)
    implementation = getattr(config, "_attn_implementation", None)
    try:
        small = type(config)(**options)
        with torch.device("meta"):
            count = sum(p.numel() for p in type(model)(small).parameters())
        if count > MAX_PARAMS:
            return None
        with torch.device("cpu"):
            twin = type(model)._from_config(small, attn_implementation=implementation)
    except Exception:  # noqa: BLE001 - a family whose own constructor rejects the small sizes
        return None
    return twin.train()
