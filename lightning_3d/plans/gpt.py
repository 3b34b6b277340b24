"""The project's reference GPT (``lightning_3d.models.GPT``)."""

from lightning_3d.parallel.plans.common import TransformerNames

GPT_NAMES = TransformerNames(
    signature=("*tok_emb", "*.attn.wq", "*.mlp.fc1", "*lm_head"),
    embedding="*tok_emb",
    first_block="*blocks.0",
    colwise=("*.attn.wq", "*.attn.wk", "*.attn.wv", "*.mlp.fc1"),
    rowwise=("*.attn.wo", "*.mlp.fc2"),
    norms=("*.attn_norm", "*.mlp_norm", "*.norm"),
    head="*lm_head",
    shared_inputs=("*.attn",),  # forward(x): x feeds wq, wk, wv
)
