"""GPT-2-style naming: fused q/k/v projection ``attn.c_attn`` (as ``nn.Linear``), ``c_proj``, ``c_fc``."""

from lightning_3d.plans.common import TransformerNames

GPT2_NAMES = TransformerNames(
    signature=("*wte", "*.attn.c_attn", "*.mlp.c_fc", "*lm_head"),
    embedding="*wte",
    first_block="*.h.0",
    colwise=("*.mlp.c_fc",),
    rowwise=("*.attn.c_proj", "*.mlp.c_proj"),
    norms=("*.ln_1", "*.ln_2", "*.ln_f"),
    head="*lm_head",
    fused_colwise={"*.attn.c_attn": 3},
)
