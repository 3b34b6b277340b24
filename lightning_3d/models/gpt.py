"""A small byte-level GPT decoder.

Plain ``nn.Module`` code with no parallelism baked in: tensor/pipeline
parallel strategies rewrite or slice these modules from the outside, so the
forward passes are written to tolerate sharded layers (see
``CausalSelfAttention.forward`` and ``MLP.forward``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_3d.parallel.chunked_loss import chunked_cross_entropy
from lightning_3d.parallel.materialize import DeferredInit, ParamInit


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`.

    Attributes:
        vocab_size: Number of token ids; 256 for raw bytes.
        block_size: Maximum sequence length (size of the positional table).
        n_layer: Number of transformer blocks.
        n_head: Number of attention heads; must divide ``n_embd``.
        n_embd: Width of the residual stream.
        mlp_ratio: MLP hidden width as a multiple of ``n_embd``.
        dropout: Dropout probability for embeddings, attention and residuals.
        attn_dropout: Dropout probability of the attention weights alone; ``None``: ``dropout``.
        bias: Whether Linear and LayerNorm layers carry a bias.
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = False
    attn_dropout: Optional[float] = None

    def __post_init__(self) -> None:
        sizes = {
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "mlp_ratio": self.mlp_ratio,
        }
        bad = {k: v for k, v in sizes.items() if v <= 0}
        if bad:
            raise ValueError(f"GPTConfig sizes must be positive, got {bad}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attn_dropout is not None and not 0.0 <= self.attn_dropout < 1.0:
            raise ValueError(f"attn_dropout must be in [0, 1) or None, got {self.attn_dropout}")


# The fills of GPT's parameters (module-level, so a recorded plan pickles and deep-copies).
def _normal(t: torch.Tensor, generator: Optional[torch.Generator], std: float) -> None:
    nn.init.normal_(t, mean=0.0, std=std, generator=generator)


def _zeros(t: torch.Tensor, generator: Optional[torch.Generator]) -> None:
    nn.init.zeros_(t)


def _ones(t: torch.Tensor, generator: Optional[torch.Generator]) -> None:
    nn.init.ones_(t)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.n_embd
        self.wq = nn.Linear(d, d, bias=config.bias)
        self.wk = nn.Linear(d, d, bias=config.bias)
        self.wv = nn.Linear(d, d, bias=config.bias)
        self.wo = nn.Linear(d, d, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)
        # Only head_dim is fixed; the number of heads is read off the
        # projection output so a column-sharded wq/wk/wv (local heads) works.
        self.head_dim = d // config.n_head
        self.n_head = config.n_head  # of the whole layer, before any tensor split
        self.dropout = config.dropout if config.attn_dropout is None else config.attn_dropout
        # Context parallelism sets this (parallel/context/apply.py): x then holds this rank's
        # tokens of a sequence split over ranks, and attention runs across them.
        self.context_attention: Optional[Any] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # (B, T, nh * hs) each
        # B and T come from the projection, not from x: under sequence parallelism x holds
        # only this rank's T / tp positions, and the column-parallel projection gathers them.
        B, T, _ = q.shape
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        if self.context_attention is not None:
            y = self.context_attention(q, k, v)  # (B, nh, T, hs): T of this rank's tokens
        else:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                dropout_p=self.dropout if self.training else 0.0,
                is_causal=True,
            )  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hs)
        return self.resid_drop(self.wo(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.fc1 = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The hidden width is whatever fc1 emits, so a sharded fc1/fc2 pair works.
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        x = x + self.mlp(self.mlp_norm(x))
        return x


class GPT(nn.Module):
    # Output projections of each residual branch; their init is shrunk so the
    # residual stream's variance does not grow with depth (GPT-2 trick).
    _RESIDUAL_PROJ = ("attn.wo", "mlp.fc2")

    def __init__(self, config: GPTConfig, defer_init: bool = False) -> None:
        """``defer_init=True``: stay on ``meta`` and record the init (the CPU generator's state
        now and every parameter's fill) for :func:`lightning_3d.parallel.materialize.materialize`,
        which gives the same weights as the eager build in their final dtype, device and shard."""
        super().__init__()
        if not isinstance(defer_init, bool):
            raise ValueError(f"defer_init={defer_init!r} must be True or False")
        self.config = config
        # Build on meta and materialise afterwards, so that init_weights() is
        # the ONLY consumer of the RNG. That makes
        #   torch.manual_seed(s); GPT(cfg)
        # bit-identical to
        #   GPT(cfg) on meta -> to_empty() -> torch.manual_seed(s); init_weights()
        # and skips PyTorch's default init, which we would overwrite anyway.
        target = torch.empty(()).device  # respects `with torch.device(...)`
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
            self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(self.build_block(config) for _ in range(config.n_layer))
            self.norm = nn.LayerNorm(config.n_embd, bias=config.bias)
            # Deliberately not tied to tok_emb: tied weights would have to live
            # on both the first and the last pipeline stage.
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Context parallelism sets this (parallel/context/apply.py): the positions of this
        # rank's tokens, which are not 0..T-1 when a sequence is split over ranks.
        self.context_shard: Optional[Any] = None
        # ThreeDStrategy(loss_chunks=n) sets this (parallel/chunked_loss.py): forward(idx,
        # targets) then computes head and loss n chunks of tokens at a time, no whole logits.
        self.loss_chunks = 1
        self.deferred_init: Optional[DeferredInit] = None
        if defer_init:
            self.deferred_init = DeferredInit.capture(self.parameter_inits())
        elif target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    def build_block(self, config: GPTConfig) -> nn.Module:
        """One transformer block (built on ``meta``); variants swap in their own (``moe.py``)."""
        return Block(config)

    def parameter_inits(self) -> list[ParamInit]:
        """Every parameter's initial fill, in the order :meth:`init_weights` draws random numbers
        (``named_modules()`` order; weight before bias)."""
        std = 0.02
        proj_std = std / math.sqrt(2 * self.config.n_layer)
        inits: list[ParamInit] = []

        def add(name: str, param: Optional[nn.Parameter], fill: Any) -> None:
            if param is not None:
                inits.append(ParamInit(name, tuple(param.shape), fill))

        for name, module in self.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(module, nn.Linear):
                s = proj_std if name.endswith(self._RESIDUAL_PROJ) else std
                add(prefix + "weight", module.weight, partial(_normal, std=s))
                add(prefix + "bias", module.bias, _zeros)
            elif isinstance(module, nn.Embedding):
                add(prefix + "weight", module.weight, partial(_normal, std=std))
            elif isinstance(module, nn.LayerNorm):
                add(prefix + "weight", module.weight, _ones)
                add(prefix + "bias", module.bias, _zeros)
        return inits

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise every parameter in place (:meth:`parameter_inits`).

        Deterministic given the global RNG state; modules are visited in
        ``named_modules()`` order. Safe to call after ``to_empty()``.
        """
        for init in self.parameter_inits():
            init.fill(self.get_parameter(init.name), None)
        self.deferred_init = None

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Map token ids ``idx`` (B, T) to next-token logits (B, T, vocab); with ``targets``
        (B, T), to their mean cross-entropy instead (:meth:`loss`)."""
        B, T = idx.shape
        if self.context_shard is not None:  # idx: this rank's share of each sequence
            T *= self.context_shard.size
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        if targets is not None:
            return self.loss(x, targets)
        return self.head(x)  # (B, T, vocab)

    # embed / blocks / head: the three parts a pipeline splits across stages.
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) to the residual stream (B, T, C)."""
        if self.context_shard is not None:  # the true positions of this rank's tokens
            pos = self.context_shard.positions(idx.shape[1], idx.device)  # (T,)
        else:
            pos = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Residual stream (B, T, C) to logits (B, T, vocab)."""
        return self.lm_head(self.norm(x))

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The residual stream (B, T, C) to the mean cross-entropy against ``targets`` (B, T):
        whole logits and ``F.cross_entropy``, or with ``loss_chunks`` > 1 the head and the loss
        chunk by chunk (:func:`~lightning_3d.parallel.chunked_loss.chunked_cross_entropy`)."""
        if self.loss_chunks == 1:
            return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())
        return self.head_loss(self.norm(x), targets)

    def head_loss(self, normed: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The chunked head and loss of the normed residual stream (a pipeline's last stage
        ends at the norm and calls this as its loss)."""
        w, b = self.lm_head.weight, self.lm_head.bias
        return chunked_cross_entropy(normed, w, targets, self.loss_chunks, bias=b)

    def num_params(self) -> int:
        """Total number of parameter elements (embeddings included)."""
        return sum(p.numel() for p in self.parameters())
