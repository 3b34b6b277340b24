"""GPT-2 naming: fused q/k/v projection ``attn.c_attn``, ``c_proj``, ``c_fc`` — as ``nn.Linear``
(the hand-written test model) or as ``transformers``' ``Conv1D`` (``GPT2LMHeadModel``)."""

from lightning_3d.parallel.plans.common import TransformerNames

GPT2_NAMES = TransformerNames(
    signature=("*wte", "*.attn.c_attn", "*.mlp.c_fc", "*lm_head"),
    embedding="*wte",
    first_block="*.h.0",
    colwise=("*.mlp.c_fc",),
    rowwise=("*.attn.c_proj", "*.mlp.c_proj"),
    norms=("*.ln_1", "*.ln_2", "*.ln_f"),
    head="*lm_head",
    fused_colwise={"*.attn.c_attn": 3},
    # transformers' GPT2Attention splits c_attn's output by split_size (the full width); the
    # head counts are divided too, so the module describes the heads it holds.
    local_sizes={"*.attn": ("split_size", "num_heads", "embed_dim")},
)
