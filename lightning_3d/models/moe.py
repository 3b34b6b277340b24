"""The reference GPT with mixture-of-experts MLPs: a top-k softmax router, the experts' weights
as grouped 3-D tensors (expert first, as transformers 5 keeps them), an optional shared expert,
dropless routing, and a load-balancing loss over the global batch.

Written for one process; ``ThreeDStrategy(expert=N)`` splits the experts over ranks from the
outside (``parallel/expert.py`` sets each layer's ``routing``), as tensor and pipeline
parallelism rewrite :class:`~lightning_3d.models.gpt.GPT`.

Load-balancing loss (Switch Transformer's): ``aux = E * sum_e f_e * P_e``, ``f_e`` the fraction of
the batch's routed token slots that went to expert ``e``, ``P_e`` the router's mean probability
for ``e``. Both are the global batch's: the counts and probability sums are summed over the data
ranks. The value is the global one on every rank; the gradient is that of ``G`` times this
rank's share, which the data-parallel average (over ``G`` ranks) turns into the global
gradient, as the token-mean objective does for the cross-entropy (``parallel/objective.py``), so
``F.cross_entropy(...) + coef * aux`` is one process's objective. Under gradient accumulation
the objective's per-step factor rescales the whole gradient, this term's too: exact for one
micro-batch per step, or micro-batches with equal numbers of counted tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lightning_3d.models.gpt import GPT, Block, GPTConfig, _normal
from lightning_3d.models.lit_gpt import LitGPT
from lightning_3d.parallel.materialize import ParamInit


@dataclass
class MoEConfig(GPTConfig):
    """:class:`GPTConfig` with every block's MLP a mixture of experts.

    Attributes:
        n_experts: Experts per layer (each an MLP of ``mlp_ratio * n_embd`` hidden units).
        top_k: Experts each token is sent to; at most ``n_experts``.
        shared_expert: Whether a dense MLP every token goes through is added (DeepSeek's).
        aux_loss_coef: Weight of the load-balancing loss in :class:`LitMoEGPT`'s objective.
    """

    n_experts: int = 4
    top_k: int = 2
    shared_expert: bool = False
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if not isinstance(self.n_experts, int) or self.n_experts < 1:
            problems.append(f"n_experts={self.n_experts!r} must be a positive integer")
        elif not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.n_experts:
            problems.append(f"top_k={self.top_k!r} must be in 1..n_experts={self.n_experts}")
        if not isinstance(self.aux_loss_coef, (int, float)) or self.aux_loss_coef < 0:
            problems.append(f"aux_loss_coef={self.aux_loss_coef!r} must be a number >= 0")
        if problems:
            raise ValueError("; ".join(problems))


class GroupedExperts(nn.Module):
    """``n`` GELU MLPs as two grouped weights, expert first: ``w_in`` (E, C, H), ``w_out``
    (E, H, C). Expert parallelism keeps a slice of dim 0 on each rank (a ``DTensor``)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.w_in = nn.Parameter(torch.empty(config.n_experts, config.n_embd, hidden))
        self.w_out = nn.Parameter(torch.empty(config.n_experts, hidden, config.n_embd))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` (n, C) grouped by local expert, ``counts[j]`` rows for local expert ``j``."""
        w_in, w_out = _local(self.w_in), _local(self.w_out)  # (E_local, C, H), (E_local, H, C)
        outs = [
            F.gelu(chunk @ w_in[j]) @ w_out[j]  # (n_j, C)
            for j, chunk in enumerate(rows.split(counts))
        ]
        return torch.cat(outs) if outs else rows


class MoE(nn.Module):
    """Top-k routed experts (and an optional shared expert) in place of a block's MLP.

    After each forward: ``aux_loss`` (0-d, the load-balancing loss) and ``tokens_per_expert``
    (E,) (token slots routed to each expert over the global batch, detached) for logging."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        from lightning_3d.models.gpt import MLP

        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.router = nn.Linear(config.n_embd, config.n_experts, bias=False)
        self.experts = GroupedExperts(config)
        self.shared = MLP(config) if config.shared_expert else None
        self.drop = nn.Dropout(config.dropout)
        # parallel/expert.py sets this: the process groups of expert and data parallelism.
        self.routing: Optional[Any] = None
        self.aux_loss: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        tokens = x.reshape(-1, C)  # (N, C)
        probs = self.router(tokens).float().softmax(-1)  # (N, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k) each
        weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)  # (N * k,) the expert of each token slot
        order = flat.argsort(stable=True)  # token slots grouped by expert
        counts = torch.bincount(flat, minlength=self.n_experts)  # (E,)
        source = order // self.top_k  # (N * k,) the token of each sorted slot
        routed = tokens[source]  # (N * k, C)
        if self.routing is not None and self.routing.ep_size > 1:
            out = self.routing.dispatch(routed, counts, self.experts)
        else:
            # The one device-to-host read of the layer: split sizes are host ints.
            out = self.experts(routed, counts.tolist())  # (N * k, C)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        y = torch.zeros_like(tokens).index_add(0, source, out)  # (N, C)
        if self.shared is not None:
            y = y + self.shared(tokens)
        self._balance(probs, counts)
        return self.drop(y.view(B, T, C))

    def _balance(self, probs: torch.Tensor, counts: torch.Tensor) -> None:
        """``aux_loss`` and ``tokens_per_expert`` over the global batch (module docstring)."""
        E = self.n_experts
        local = probs.sum(0)  # (E,) this rank's probability mass per expert
        n_local = local.new_full((1,), probs.shape[0])
        stats = torch.cat([counts.to(local.dtype), local.detach(), n_local])  # (2E + 1,)
        size = 1
        if self.routing is not None:
            stats, size = self.routing.global_sum(stats), self.routing.data_size
        total, mass, n = stats[:E], stats[E : 2 * E], stats[2 * E]
        fraction = total / (n * self.top_k)  # (E,) f_e, no gradient
        share = local * size / n  # gradient: G times this rank's part of P_e
        mean_prob = mass / n + share - share.detach()  # value: the global P_e
        self.aux_loss = E * (fraction * mean_prob).sum()
        self.tokens_per_expert = total.detach()


class MoEGPT(GPT):
    """:class:`GPT` whose blocks' MLPs are :class:`MoE` layers."""

    def __init__(self, config: MoEConfig, defer_init: bool = False) -> None:
        if defer_init:
            raise ValueError("MoEGPT does not support defer_init=True yet")
        super().__init__(config)

    def build_block(self, config: GPTConfig) -> nn.Module:
        block = Block(config)
        block.mlp = MoE(config)
        return block

    def parameter_inits(self) -> list[ParamInit]:
        """GPT's fills, then the experts' (``w_out`` shrunk like GPT's residual projections)."""
        std = 0.02
        proj_std = std / math.sqrt(2 * self.config.n_layer)
        inits = super().parameter_inits()
        for name, module in self.named_modules():
            if isinstance(module, GroupedExperts):
                for weight, s in (("w_in", std), ("w_out", proj_std)):
                    shape = tuple(getattr(module, weight).shape)
                    inits.append(ParamInit(f"{name}.{weight}", shape, partial(_normal, std=s)))
        return inits

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the last forward, summed over layers."""
        return torch.stack([m.aux_loss for m in self.moe_layers()]).sum()

    def tokens_per_expert(self) -> torch.Tensor:
        """(layers, E): token slots each expert received in the last forward (global batch)."""
        return torch.stack([m.tokens_per_expert for m in self.moe_layers()])


class LitMoEGPT(LitGPT):
    """:class:`LitGPT` on :class:`MoEGPT`: cross-entropy plus ``aux_loss_coef`` times the
    load-balancing loss; logs the busiest expert's share of token slots (``max_expert_load``)."""

    def __init__(
        self,
        n_experts: int = 4,
        top_k: int = 2,
        shared_expert: bool = False,
        aux_loss_coef: float = 0.01,
        **kwargs: Any,
    ) -> None:
        self._moe = {
            "n_experts": n_experts,
            "top_k": top_k,
            "shared_expert": shared_expert,
            "aux_loss_coef": aux_loss_coef,
        }
        super().__init__(**kwargs)

    def build_model(self) -> nn.Module:
        fields = {k: getattr(self.config, k) for k in GPTConfig.__dataclass_fields__}
        self.config = MoEConfig(**fields, **self._moe)
        return MoEGPT(self.config, defer_init=self.hparams.get("deferred_init", False))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = super()._loss(batch)
        if self.training:
            counts = self.model.tokens_per_expert()  # (layers, E)
            load = (counts.max(-1).values / counts.sum(-1)).max()
            self.log("max_expert_load", load)
            loss = loss + self.config.aux_loss_coef * self.model.aux_loss()
        return loss

    def pipeline_spec(self) -> Any:
        raise ValueError("the MoE GPT has no pipeline split yet (its loss adds the router's)")


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a grouped weight (a ``DTensor`` under expert parallelism)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight
