"""Small Llama-style and GPT-2-style language models, written here so the tensor-parallel plans
for those naming schemes are tested without downloads. Both read their local head count from
the projection outputs, so column-sharded projections work unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_3d.models.lit_gpt import LitGPT


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (B, nh, T, hs); positions 0..T-1."""
    hs, T = x.shape[-1], x.shape[-2]
    inv = 1.0 / (10000 ** (torch.arange(0, hs, 2, device=x.device, dtype=torch.float32) / hs))
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv)  # (T, hs/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class LlamaAttention(nn.Module):
    def __init__(self, d: int, n_head: int, n_kv_head: int) -> None:
        super().__init__()
        self.head_dim = d // n_head
        self.q_proj = nn.Linear(d, n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * self.head_dim, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        B, T, _ = q.shape
        q = _rope(q.view(B, T, -1, self.head_dim).transpose(1, 2))  # (B, nh, T, hs)
        k = _rope(k.view(B, T, -1, self.head_dim).transpose(1, 2))  # (B, nkv, T, hs)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        # Grouped-query attention: each k/v head serves `repeat` q heads.
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, d: int, n_head: int, n_kv_head: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(d)
        self.self_attn = LlamaAttention(d, n_head, n_kv_head)
        self.post_attention_layernorm = nn.RMSNorm(d)
        self.mlp = LlamaMLP(d, 3 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, vocab: int, d: int, n_layer: int, n_head: int, n_kv_head: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaLayer(d, n_head, n_kv_head) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyLlama(nn.Module):
    """``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ..., ``lm_head``."""

    def __init__(
        self, vocab: int = 256, d: int = 32, n_layer: int = 2, n_head: int = 4, n_kv_head: int = 2
    ) -> None:
        super().__init__()
        self.model = LlamaModel(vocab, d, n_layer, n_head, n_kv_head)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(idx))


class GPT2Attention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.head_dim = d // n_head
        # Fused [q; k; v]. No bias: the key bias has an identically zero true gradient (softmax
        # ignores a shift shared by all keys), so Adam turns its rounding noise into lr-sized
        # updates that differ between any two summation orders, and no parity test could pass.
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # (B, T, nh * hs) each
        B, T, _ = q.shape
        # (B, nh, T, hs).
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class GPT2MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = GPT2Attention(d, n_head)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = GPT2MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Transformer(nn.Module):
    def __init__(self, vocab: int, block_size: int, d: int, n_layer: int, n_head: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.h = nn.ModuleList(GPT2Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class TinyGPT2(nn.Module):
    """``transformer.wte``, ``transformer.h.N.attn.c_attn``, ..., ``lm_head``."""

    def __init__(
        self, vocab: int = 256, block_size: int = 32, d: int = 32, n_layer: int = 2, n_head: int = 4
    ) -> None:
        super().__init__()
        self.transformer = GPT2Transformer(vocab, block_size, d, n_layer, n_head)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(idx))


class LitTinyLM(LitGPT):
    """``LitGPT``'s training recipe around a tiny Llama- or GPT-2-style network."""

    def __init__(self, arch: str = "llama", n_kv_head: int = 2, **kwargs) -> None:
        if arch not in ("llama", "gpt2"):
            raise ValueError(f"arch must be 'llama' or 'gpt2', got {arch!r}")
        self.arch, self.n_kv_head = arch, n_kv_head
        super().__init__(**kwargs)

    def build_model(self) -> nn.Module:
        c = self.config
        if self.arch == "llama":
            return TinyLlama(c.vocab_size, c.n_embd, c.n_layer, c.n_head, self.n_kv_head)
        return TinyGPT2(c.vocab_size, c.block_size, c.n_embd, c.n_layer, c.n_head)
