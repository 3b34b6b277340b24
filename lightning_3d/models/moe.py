"""The reference GPT with mixture-of-experts MLPs: a top-k softmax router, the experts' weights
as grouped 3-D tensors (expert first, as transformers 5 keeps them), an optional shared expert,
dropless routing, and a load-balancing loss over the global batch.

Written for one process; ``ThreeDStrategy(expert=N)`` splits the experts over ranks from the
outside (``parallel/expert.py`` sets each layer's ``routing``), as tensor and pipeline
parallelism rewrite :class:`~lightning_3d.models.gpt.GPT`.

Load-balancing loss (Switch Transformer's): ``aux = E * sum_e f_e * P_e``, ``f_e`` the fraction of
the batch's routed token slots that went to expert ``e``, ``P_e`` the router's mean probability
for ``e``. Both are the global batch's: the counts and probability sums are summed over the data
ranks (data x context under context parallelism; tensor ranks each route the whole of their
data rank's tokens, ``parallel/plans/moe.py``). The value is the global one on every rank;
the gradient is that of ``G`` times this rank's share, which the data-parallel average (over
``G`` ranks) turns into the global gradient, as the token-mean objective does for the
cross-entropy (``parallel/objective.py``), so ``F.cross_entropy(...) + coef * aux`` is one
process's objective. Under gradient accumulation
the objective's per-step factor rescales the whole gradient, this term's too: exact for one
micro-batch per step, or micro-batches with equal numbers of counted tokens.
Under a pipeline the loss is the last stage's, out of reach of the other stages' layers:
each layer then carries its weighted term on its own output (``parallel/expert_pipeline.py``),
weighted as a micro-batch's loss, which is the same objective as one process accumulating the
same micro-batches.

Aux-loss-free balancing (DeepSeek-V3's, ``bias_update_rate`` > 0): a per-expert bias is added to
the router's probabilities to pick the top-k, never to the gating weights. After each optimizer
step :class:`LitMoEGPT` moves each expert's bias by ``+rate`` if it received fewer token slots
than the mean over experts during the step, ``-rate`` if more (``sign(mean - load)``). The loads
are the global batch's, summed over the step's micro-batches, so every rank moves its copy the
same way; a step the non-finite check (``nonfinite="skip"``) or the grad scaler (an fp16
overflow) skips applied nothing and moves no bias. The bias is a buffer, saved in checkpoints.

Capacity (``capacity_factor``; ``None``: dropless): an expert takes at most
``capacity = ceil(capacity_factor * tokens * top_k / n_experts)`` token slots per forward, where
``tokens`` is the **global** batch's (every data rank's, and with context parallelism every
context rank's share of the sequences; the ranks' shares being equal), so
a layout drops exactly what one process does on the whole batch. Which slots go: an expert
keeps the slots whose gating probability is above the ``capacity + 1``-th highest among all
slots routed to it in the global batch (ties at that line are all dropped, so it may keep
fewer). The rule depends on scores only, not on where a token sits in the batch or on which
rank, which is what makes it the same in every layout. A dropped slot contributes nothing: its
token keeps the other experts' outputs (weights not renormalised) and the residual. The
load-balancing statistics count the router's choices, before dropping.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lightning_3d.models.gpt import GPT, Block, GPTConfig, _normal
from lightning_3d.models.lit_gpt import LitGPT
from lightning_3d.parallel.expert_pipeline import carry_loss
from lightning_3d.parallel.materialize import ParamInit
from lightning_3d.parallel.pipeline import PipelineSpec


@dataclass
class MoEConfig(GPTConfig):
    """:class:`GPTConfig` with every block's MLP a mixture of experts.

    Attributes:
        n_experts: Experts per layer (each an MLP of ``mlp_ratio * n_embd`` hidden units).
        top_k: Experts each token is sent to; at most ``n_experts``.
        shared_expert: Whether a dense MLP every token goes through is added (DeepSeek's).
        aux_loss_coef: Weight of the load-balancing loss in :class:`LitMoEGPT`'s objective.
        capacity_factor: Token slots an expert takes per forward, as a multiple of an even
            share of the global batch's (module docstring); ``None``: dropless.
        bias_update_rate: Step of the aux-loss-free balancing bias after each optimizer step
            (module docstring); 0: no bias (the router's top-k as is).
    """

    n_experts: int = 4
    top_k: int = 2
    shared_expert: bool = False
    aux_loss_coef: float = 0.01
    capacity_factor: Optional[float] = None
    bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if not isinstance(self.n_experts, int) or self.n_experts < 1:
            problems.append(f"n_experts={self.n_experts!r} must be a positive integer")
        elif not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.n_experts:
            problems.append(f"top_k={self.top_k!r} must be in 1..n_experts={self.n_experts}")
        if not isinstance(self.aux_loss_coef, (int, float)) or self.aux_loss_coef < 0:
            problems.append(f"aux_loss_coef={self.aux_loss_coef!r} must be a number >= 0")
        capacity = self.capacity_factor
        if capacity is not None and (
            isinstance(capacity, bool)
            or not isinstance(capacity, (int, float))
            or not 0 < capacity < math.inf
        ):
            problems.append(f"capacity_factor={capacity!r} must be a number > 0 (or None)")
        rate = self.bias_update_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < math.inf:
            problems.append(f"bias_update_rate={rate!r} must be a number >= 0")
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
    (E,) (token slots routed to each expert over the global batch, detached) for logging.
    ``expert_bias`` (E,): the aux-loss-free balancing bias, a buffer moved by
    :meth:`update_bias` (``None`` when ``bias_update_rate`` is 0)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        from lightning_3d.models.gpt import MLP

        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.capacity_factor = config.capacity_factor
        # None without balancing: nothing for to_empty() to leave undefined, nothing saved.
        bias = torch.zeros(config.n_experts) if config.bias_update_rate > 0 else None
        self.register_buffer("expert_bias", bias)
        self.router = nn.Linear(config.n_embd, config.n_experts, bias=False)
        self.experts = GroupedExperts(config)
        self.shared = MLP(config) if config.shared_expert else None
        self.drop = nn.Dropout(config.dropout)
        # parallel/expert.py sets this: the process groups of expert and data parallelism.
        self.routing: Optional[Any] = None
        # parallel/expert_pipeline.py sets this under a pipeline: the weight of a micro-batch's
        # loss, with which this layer carries its weighted aux_loss on its output.
        self.aux_loss_coef = config.aux_loss_coef
        self.aux_weight: Optional[Callable[[], torch.Tensor]] = None
        self.aux_loss: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        tokens = x.reshape(-1, C)  # (N, C)
        E = self.n_experts
        probs = self.router(tokens).float().softmax(-1)  # (N, E)
        # The balancing bias picks the experts; the gates stay the router's probabilities.
        scores = probs if self.expert_bias is None else probs + self.expert_bias  # (N, E)
        chosen = scores.topk(self.top_k, dim=-1).indices  # (N, k)
        gates = probs.gather(-1, chosen)  # (N, k)
        weights = gates / gates.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)  # (N * k,) the expert of each token slot
        counts = torch.bincount(flat, minlength=E)  # (E,) the router's choices
        group = flat
        if self.capacity_factor is not None:
            # Dropped slots form a group after the last expert's: sorted last, sent nowhere.
            keep = self._within_capacity(gates.detach().reshape(-1), flat)
            group = torch.where(keep, flat, E)
        order = group.argsort(stable=True)  # token slots grouped by expert
        kept = torch.bincount(group, minlength=E + 1)[:E]  # (E,) slots each expert takes
        source = order // self.top_k  # (N * k,) the token of each sorted slot
        routed = tokens[source]  # (N * k, C)
        if self.routing is not None and self.routing.ep_size > 1:
            out = self.routing.dispatch(routed, kept, self.experts)
        else:
            # The one device-to-host read of the layer: split sizes are host ints.
            sizes = kept.tolist()
            out = self.experts(routed[: sum(sizes)], sizes)  # (n kept, C)
        n = out.shape[0]
        out = out * weights.reshape(-1)[order[:n], None].to(out.dtype)
        # Under autocast the experts compute in bf16/fp16 while the tokens stay fp32: the
        # outputs add up in the tokens' dtype, as the residual stream they join.
        y = torch.zeros_like(tokens).index_add(0, source[:n], out.to(tokens.dtype))  # (N, C)
        if self.shared is not None:
            y = y + self.shared(tokens)
        self._balance(probs, counts)
        if self.aux_weight is not None and self.aux_loss_coef > 0 and torch.is_grad_enabled():
            # Under a pipeline the loss is the last stage's: this layer's term rides backward on
            # its activations, from whichever stage holds it (parallel/expert_pipeline.py).
            y = carry_loss(y, self.aux_loss_coef * self.aux_loss, self.aux_weight())
        return self.drop(y.view(B, T, C))

    def _within_capacity(self, scores: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """(N * k,) bool: the slots their expert keeps under the global capacity rule (module
        docstring). One gather over the data ranks of each rank's top ``capacity + 1`` scores
        per expert; no host read."""
        E, slots = self.n_experts, scores.numel()
        ranks = 1 if self.routing is None else self.routing.data_size
        capacity = math.ceil(self.capacity_factor * slots * ranks / E)
        line = capacity + 1
        table = scores.new_full((slots, E), -math.inf)  # (N * k, E) each slot under its expert
        table[torch.arange(slots, device=scores.device), flat] = scores
        top = table.topk(min(line, slots), dim=0).values  # (<= line, E)
        if top.shape[0] < line:
            top = torch.cat([top, top.new_full((line - top.shape[0], E), -math.inf)])
        if self.routing is not None:
            top = self.routing.gather(top)  # (ranks * line, E)
        threshold = top.topk(line, dim=0).values[-1]  # (E,) the highest score that is dropped
        return scores > threshold[flat]

    def _apply(self, fn: Any, recurse: bool = True) -> "MoE":
        """``nn.Module._apply`` (``.to``, ``.cuda``, the precision plugin's cast), the balancing
        bias kept fp32: in bf16 a step of ``bias_update_rate`` (1e-3) near 0.25 rounds away."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """Move ``expert_bias`` by ``rate * sign(mean - load)``: up for an expert below the mean
        load ``load`` (E,), down above it."""
        self.expert_bias.add_(rate * torch.sign(load.mean() - load).to(self.expert_bias.dtype))

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

    def init_weights(self) -> None:
        """GPT's fills, then every balancing bias zeroed: buffers built on ``meta`` come out of
        ``to_empty`` holding whatever the memory held."""
        super().init_weights()
        for layer in self.moe_layers():
            if layer.expert_bias is not None:
                layer.expert_bias.zero_()

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
    load-balancing loss.

    Logs, every training step: ``max_expert_load`` (the busiest expert's share of token slots,
    over layers), ``expert_imbalance`` (the busiest expert's slots over the mean, over layers;
    1 is perfect balance) and, for up to 8 experts, ``expert_tokens/<e>`` (slots to expert ``e``
    summed over layers), on the progress bar. :meth:`step_figures` hands the last optimizer
    step's figures to :class:`~lightning_3d.observe.summary.RunSummary` (summary.json's
    ``step_figures``). With ``bias_update_rate`` > 0, every layer's balancing bias moves after
    each optimizer step by the step's global loads (module docstring).

    Example::

        LitMoEGPT(n_experts=8, top_k=2, capacity_factor=1.25, bias_update_rate=1e-3)
    """

    def __init__(
        self,
        n_experts: int = 4,
        top_k: int = 2,
        shared_expert: bool = False,
        aux_loss_coef: float = 0.01,
        capacity_factor: Optional[float] = None,
        bias_update_rate: float = 0.0,
        **kwargs: Any,
    ) -> None:
        self._moe = {
            "n_experts": n_experts,
            "top_k": top_k,
            "shared_expert": shared_expert,
            "aux_loss_coef": aux_loss_coef,
            "capacity_factor": capacity_factor,
            "bias_update_rate": bias_update_rate,
        }
        # The running step's sums over its micro-batches, and the last finished step's.
        self._step_sums: dict[str, Any] = {}
        self._finished_step: dict[str, torch.Tensor] = {}
        # Under a pipeline: this rank's layers' figures of the running step, by block index.
        self._stage_rows: dict[str, dict[int, torch.Tensor]] = {}
        # id(module) -> its block's index, made once a fit (a pipeline reads it every block).
        self._block_index: Optional[dict[int, int]] = None
        super().__init__(**kwargs)

    def build_model(self) -> nn.Module:
        fields = {k: getattr(self.config, k) for k in GPTConfig.__dataclass_fields__}
        self.config = MoEConfig(**fields, **self._moe)
        return MoEGPT(self.config, defer_init=self.hparams.get("deferred_init", False))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = super()._loss(batch)
        if self.training:
            counts = self.model.tokens_per_expert()  # (layers, E)
            aux = self.config.aux_loss_coef * self.model.aux_loss()
            self._log_load(counts)
            # Once per micro-batch (a recomputed forward overwrites, never adds).
            for name, value in (("counts", counts), ("aux_loss", aux.detach())):
                self._step_sums[name] = (
                    value if name not in self._step_sums else self._step_sums[name] + value
                )
            self._step_sums["micro_batches"] = self._step_sums.get("micro_batches", 0) + 1
            loss = loss + aux
        return loss

    def _log_load(self, counts: torch.Tensor) -> None:
        peak = counts.max(-1).values  # (layers,)
        self.log("max_expert_load", (peak / counts.sum(-1)).max())
        self.log("expert_imbalance", (peak / counts.mean(-1)).max(), prog_bar=True)
        if counts.shape[-1] <= 8:
            per_expert = counts.sum(0)  # (E,)
            for e in range(per_expert.numel()):
                self.log(f"expert_tokens/{e}", per_expert[e], prog_bar=True)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step, then the balancing bias moved by the step's global loads."""
        super().optimizer_step(*args, **kwargs)
        step, self._step_sums = self._step_sums, {}
        if not step:
            return
        counts = step["counts"]  # (layers, E), summed over the step's micro-batches
        self._finished_step = {
            "aux_loss": step["aux_loss"] / step["micro_batches"],
            "tokens_per_expert": counts,
            "expert_imbalance": counts.max(-1).values / counts.mean(-1),
        }
        rate = self.config.bias_update_rate
        # A skipped step (non-finite, a grad-scaler overflow) applied nothing: no bias move.
        if rate > 0 and not getattr(self.trainer.strategy, "step_skipped", False):
            # By block index: under a pipeline this rank holds some layers, the counts all.
            for index, layer in self._indexed_layers():
                layer.update_bias(counts[index], rate)

    def step_figures(self) -> dict[str, torch.Tensor]:
        """The last optimizer step's figures, global over the data ranks: ``aux_loss`` (the
        weighted load-balancing term this module adds to the cross-entropy, mean over the
        step's micro-batches), ``tokens_per_expert`` (layers, E) (token slots the router sent
        to each expert, summed over micro-batches) and ``expert_imbalance`` (layers,) (the
        busiest expert's slots over the mean)."""
        return dict(self._finished_step)

    def pipeline_spec(self) -> PipelineSpec:
        """:class:`LitGPT`'s split, each block run through :meth:`_pipeline_block`, which
        records its layer's figures once per micro-batch. The load-balancing loss reaches the
        objective through each layer's activations (``parallel/expert_pipeline.py``), not
        through :meth:`_loss`, which a pipeline does not run."""
        return dataclasses.replace(super().pipeline_spec(), block_forward=self._pipeline_block)

    def _pipeline_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One block of a stage's forward; a training forward adds its layer's token counts and
        weighted aux loss to the step's. Only a micro-batch's forward: torch's metadata
        inference (stand-in inputs) adds nothing, and neither does a forward recomputed by
        activation checkpointing (inside the block, not through here)."""
        x = block(x)
        # No trainer when the planner measures a block through the spec.
        strategy = self._trainer.strategy if self._trainer is not None else None
        runtime = getattr(strategy, "pipeline", None)
        if self.training and runtime is not None and runtime.in_forward_chunk:
            rows = self._stage_rows.setdefault("rows", {})
            for index, layer in self._indexed_layers(block):
                figures = torch.cat(
                    [layer.tokens_per_expert, (self.config.aux_loss_coef * layer.aux_loss)[None]]
                ).detach()  # (E + 1,)
                rows[index] = figures if index not in rows else rows[index] + figures
        return x

    def pipeline_training_step_end(self, loss: torch.Tensor, batch: Any, batch_idx: int) -> None:
        """:class:`LitGPT`'s, then the step's figures over every stage's layers (one all-reduce
        over the pipeline group; each stage's rows are already global over the data ranks):
        logged and summed as :meth:`_loss` does, over the step's micro-batches."""
        super().pipeline_training_step_end(loss, batch, batch_idx)
        rows, self._stage_rows = self._stage_rows.get("rows", {}), {}
        table = torch.zeros(
            self.config.n_layer, self.config.n_experts + 1, device=self.device
        )  # (layers, E + 1)
        for index, figures in rows.items():
            table[index] = figures.to(table.dtype)
        runtime = getattr(self.trainer.strategy, "pipeline", None)
        if runtime is not None:
            dist.all_reduce(table, group=runtime.group)
        micro_batches = runtime.micro_batches if runtime is not None else 1
        counts, aux = table[:, :-1], table[:, -1].sum()  # (layers, E), summed over micro-batches
        self._log_load(counts)
        for name, value in (("counts", counts), ("aux_loss", aux)):
            self._step_sums[name] = (
                value if name not in self._step_sums else self._step_sums[name] + value
            )
        self._step_sums["micro_batches"] = self._step_sums.get("micro_batches", 0) + micro_batches

    def on_fit_start(self) -> None:
        """The block index is the parallelised model's: made afresh at its first use."""
        super().on_fit_start()
        self._block_index = None

    def _indexed_layers(self, within: Optional[nn.Module] = None) -> list[tuple[int, MoE]]:
        """``(block index, layer)`` of the MoE layers this rank holds (in ``within`` only, if
        given): rows of :meth:`MoEGPT.tokens_per_expert` are block indices, on every stage."""
        if self._block_index is None:
            self._block_index = {
                id(m): i for i, block in enumerate(self.model.blocks) for m in block.modules()
            }
        index = self._block_index
        scope = self.model if within is None else within
        return [(index[id(m)], m) for m in scope.modules() if isinstance(m, MoE)]


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a grouped weight (a ``DTensor`` under expert parallelism)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight
