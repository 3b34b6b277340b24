"""Llama-style naming (Hugging Face ``LlamaForCausalLM`` layout; grouped-query attention works as
long as ``tensor`` divides the number of k/v heads)."""

from lightning_3d.parallel.plans.common import TransformerNames

LLAMA_NAMES = TransformerNames(
    signature=("*embed_tokens", "*.self_attn.q_proj", "*.mlp.gate_proj", "*lm_head"),
    embedding="*embed_tokens",
    first_block="*layers.0",
    colwise=(
        "*.self_attn.q_proj",
        "*.self_attn.k_proj",
        "*.self_attn.v_proj",
        "*.mlp.gate_proj",
        "*.mlp.up_proj",
    ),
    rowwise=("*.self_attn.o_proj", "*.mlp.down_proj"),
    norms=("*.input_layernorm", "*.post_attention_layernorm", "*.norm"),
    head="*lm_head",
    # transformers' StableLM (which ships no plan) views its heads by these global sizes.
    local_sizes={"*.self_attn": ("num_heads", "num_key_value_heads", "hidden_size")},
)
