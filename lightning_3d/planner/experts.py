"""Planner facts for mixture-of-experts models: expert bytes per rank, all-to-all volume, and
which ``expert`` sizes to run an MoE model with.

Expert parallelism (``parallel/expert.py``) splits each MoE layer's experts over ``expert``
ranks carved from the data axis. Per rank, with ``Ψ_e`` the parameters of all experts and
``Ψ_d`` every other parameter (fp32 AdamW: 4 bytes of weight, 4 of gradient, 8 of moments):

- ``expert`` = 1: every expert is an ordinary data-parallel parameter, so the whole model
  follows the ZeRO formula (``observe.memory.zero_formula_bytes``) over the ``N`` data ranks;
- ``expert`` > 1: the dense part follows ZeRO over ``N``; each rank holds ``Ψ_e / expert`` of
  the experts, and their state follows ZeRO over the ``R = N / expert`` ranks that hold the
  same experts (whole, ``16 Ψ_e / expert``, at ZeRO-0 or ``R`` = 1, or where
  :func:`~lightning_3d.planner.expert_memory.experts_sharded_over_replicas` says the strategy
  keeps them whole). Beside tensor, context and pipeline parallelism:
  :mod:`lightning_3d.planner.expert_memory`.

All-to-all per micro-batch and rank: each of the ``L`` MoE layers sends every routed token slot
(``top_k × tokens`` rows of ``hidden`` elements) to its expert's rank and the outputs back
(2 directions), forward and backward (2 passes): ``4 L · top_k · tokens · hidden`` elements
through the collective, of which ``(expert - 1) / expert`` leave the rank under an even router
(what ``tools/bench/comm.py`` counts as sent). With a capacity factor under 1 at most that
share of the slots travels. The per-expert counts (one int64 per expert, layer and forward)
travel too and are left out: a rounding error next to the tokens.

In the search (:func:`lightning_3d.planner.search.plan_layouts`, sizes from
``PlannerOptions.expert_sizes``) an ``expert`` > 1 layout's model state is the above
(``planner/memory.py``), its ZeRO traffic the dense part's plus the experts' own collectives
over their replicas (:func:`expert_traffic`), and its exchange time :func:`all_to_all_time`; a
token's FLOPs count ``top_k`` experts, not all (:func:`inactive_flop_params`).

Where the expert axis is faster (the same FLOPs either way): ``expert`` = ``N`` moves
activations, ``4 L · top_k · T · C · E (N-1)/N`` per micro-batch of ``T`` tokens per rank, where
ZeRO-3 moves the experts' weights, ``3 Ψ_e · E (N-1)/N`` per micro-batch (two gathers and a
reduce-scatter), and ZeRO 0-2 their gradients, ``2 Ψ_e · E (N-1)/N`` per step. With
``Ψ_e = L · n_experts · 2 C · ffn`` the split sends fewer bytes while
``T < 1.5 · n_experts · ffn / top_k`` against ZeRO-3 and ``T_step < n_experts · ffn / top_k``
(tokens per rank and step) against ZeRO 0-2: many or wide experts, few tokens per rank. The
search weighs the same terms with each link's bandwidth and latency.

Pure: a model on ``meta`` in (:func:`expert_facts`), numbers out. The planner's CLI prints
:func:`expert_summary` under its first choice and the bench's MoE rows take their theory from
here.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from lightning_3d.observe.memory import zero_formula_bytes
from lightning_3d.parallel.activation_checkpoint import transformer_blocks
from lightning_3d.parallel.expert import moe_layers
from lightning_3d.planner.expert_memory import replica_size, resolve, stage_expert_parts
from lightning_3d.planner.facts import Part
from lightning_3d.planner.memory import human, stage_parts
from lightning_3d.planner.traffic import DataTraffic, data_traffic, kept_elements

if TYPE_CHECKING:
    from lightning_3d.planner.choice import Choice
    from lightning_3d.planner.cluster import Cluster
    from lightning_3d.planner.facts import ModelFacts

STATE_BYTES = 16  # fp32 AdamW per parameter: weight, gradient, two moments


@dataclass(frozen=True)
class ExpertFacts:
    """What the planner needs to know of an MoE model.

    Attributes:
        moe_layers: Layers whose MLP is a mixture of experts (``L``).
        n_experts: Experts per layer (the same in every layer).
        top_k: Experts each token is sent to.
        hidden: Width of the rows the all-to-all moves (the model's ``n_embd``).
        expert_params: Parameters of every expert of every layer (``Ψ_e``).
        dense_params: Every other parameter (``Ψ_d``), routers and shared experts included.
        capacity_factor: The model's capacity factor; ``None``: dropless.
        part: The experts' parameters as the planner's :class:`~lightning_3d.planner.facts.Part`
            (shapes for ZeRO-3's chunks), taken out of a block's at ``expert`` > 1, where the
            expert axis holds them instead of ZeRO; ``None``: counted from ``expert_params``.
        blocks: The experts' parameters in each transformer block, in the model's order (an
            empty ``Part`` for a dense block): what a pipeline stage holds of them. Empty: spread
            evenly over the blocks.
    """

    moe_layers: int
    n_experts: int
    top_k: int
    hidden: int
    expert_params: int
    dense_params: int
    capacity_factor: Optional[float] = None
    part: Optional[Part] = None
    blocks: tuple[Part, ...] = ()

    @property
    def expert_part(self) -> Part:
        """:attr:`part`, or one of ``expert_params`` elements without shapes."""
        if self.part is not None:
            return self.part
        return Part(self.expert_params, 0, self.expert_params)

    @property
    def active_share(self) -> float:
        """The share of the experts' matmul weights one token runs through (``top_k`` of them)."""
        return self.top_k / self.n_experts

    def problems(self, expert: int, data: int) -> list[str]:
        """Why ``expert`` ranks cannot split this model on ``data`` data ranks (empty: they can)."""
        out = []
        if not isinstance(expert, int) or expert < 1:
            return [f"expert={expert!r} must be a positive integer"]
        if data % expert:
            out.append(f"expert={expert} does not divide data={data}")
        if self.n_experts % expert:
            out.append(f"expert={expert} does not divide n_experts={self.n_experts}")
        return out


def expert_facts(module: nn.Module) -> Optional[ExpertFacts]:
    """:class:`ExpertFacts` of ``module`` (on ``meta`` or not); ``None`` for a dense model."""
    layers = moe_layers(module)
    if not layers:
        return None
    counts = sorted({layer.n_experts for layer in layers})
    if len(counts) > 1:
        raise ValueError(f"MoE layers with different expert counts {counts} are not planned yet")
    total = sum(p.numel() for p in module.parameters())
    weights = [p for layer in layers for p in layer.experts.parameters()]
    experts = sum(p.numel() for p in weights)
    shapes = _shapes(weights)
    per_block = tuple(
        _experts_part([p for layer in moe_layers(block) for p in layer.experts.parameters()])
        for _, block in transformer_blocks(module)
    )
    first = layers[0]
    hidden = first.router.in_features if hasattr(first, "router") else first.experts.w_in.shape[1]
    return ExpertFacts(
        moe_layers=len(layers),
        n_experts=counts[0],
        top_k=first.top_k,
        hidden=hidden,
        expert_params=experts,
        dense_params=total - experts,
        capacity_factor=getattr(first, "capacity_factor", None),
        part=Part(experts, 0, experts, shapes),
        blocks=per_block,
    )


def _shapes(weights: list) -> tuple:
    # Keyed as model_facts keys a block's (rows, elements, no tensor split: the plans replicate
    # the experts over the tensor ranks); every expert weight runs in a matmul.
    return tuple(
        sorted(Counter((p.shape[0] if p.dim() else 1, p.numel(), -1) for p in weights).items())
    )


def _experts_part(weights: list) -> Part:
    n = sum(p.numel() for p in weights)
    return Part(n, 0, n, _shapes(weights))


def expert_state_bytes(
    facts: ExpertFacts,
    expert: int,
    data: int,
    zero_stage: int,
    experts_sharded_over_replicas: Optional[bool] = None,
) -> float:
    """Model-state bytes per rank (fp32 AdamW) at ``expert`` × ``data`` (module docstring;
    ``data``: ZeRO's axis, data × context): the dense part by ZeRO over ``data``, the rank's
    ``Ψ_e / expert`` by ZeRO over the ``data / expert`` replicas, or whole
    (:func:`~lightning_3d.planner.expert_memory.experts_sharded_over_replicas`)."""
    _refuse(facts, expert, data)
    if expert == 1:
        return zero_formula_bytes(facts.dense_params + facts.expert_params, zero_stage, data)
    dense = zero_formula_bytes(facts.dense_params, zero_stage, data)
    replicas = data // expert
    if not resolve(experts_sharded_over_replicas, zero_stage) or replicas == 1:
        return dense + STATE_BYTES * facts.expert_params / expert
    return dense + zero_formula_bytes(facts.expert_params / expert, zero_stage, replicas)


def all_to_all_bytes(
    facts: ExpertFacts, tokens: int, expert: int, element_bytes: int = 4
) -> dict[str, float]:
    """Per micro-batch of ``tokens`` tokens on one rank: ``through`` (bytes handed to the
    all-to-all, forward and backward, both directions, every MoE layer) and ``sent`` (the part
    that leaves the rank under an even router). Zero at ``expert`` = 1 (no all-to-all)."""
    if expert == 1:
        return {"through": 0.0, "sent": 0.0}
    slots = facts.top_k * tokens
    if facts.capacity_factor is not None:  # at most the capacity of every expert travels
        slots = min(
            slots, facts.n_experts * math.ceil(facts.capacity_factor * slots / facts.n_experts)
        )
    through = 2 * 2 * facts.moe_layers * slots * facts.hidden * element_bytes
    return {"through": float(through), "sent": through * (expert - 1) / expert}


@dataclass(frozen=True)
class ExpertOption:
    """One ``expert`` size for a model on a data axis, predicted."""

    expert: int
    state_bytes: float
    all_to_all_sent_bytes: float
    fits: bool


def propose_expert_sizes(
    facts: ExpertFacts,
    data: int,
    zero_stage: int,
    tokens: int,
    memory_bytes: Optional[float] = None,
) -> list[ExpertOption]:
    """Every ``expert`` size that divides both ``data`` and the expert count, best first: the
    ones whose model state fits ``memory_bytes`` (all, when ``None``) before the others; among
    those that fit, the least all-to-all traffic first (the smallest expert axis that fits:
    more expert ranks send a larger share of every token off the rank), then the least memory.
    ``tokens``: per rank and micro-batch."""
    if data < 1:
        raise ValueError(f"data={data} must be a positive integer")
    options = []
    for expert in range(1, data + 1):
        if facts.problems(expert, data):
            continue
        state = expert_state_bytes(facts, expert, data, zero_stage)
        sent = all_to_all_bytes(facts, tokens, expert)["sent"]
        fits = memory_bytes is None or state <= memory_bytes
        options.append(ExpertOption(expert, state, sent, fits))
    return sorted(options, key=lambda o: (not o.fits, o.all_to_all_sent_bytes, o.state_bytes))


def expert_summary(
    facts: ExpertFacts, choice: Any, memory: Any, device_bytes: float, seq_len: int
) -> str:
    """Lines for the planner's CLI under its first choice (``choice``, a
    :class:`~lightning_3d.planner.choice.Choice`, and its ``memory``, a
    :class:`~lightning_3d.planner.memory.MemorySplit`): the ``expert`` sizes
    :func:`propose_expert_sizes` ranks by memory and traffic on that layout's data axis, the
    device memory left to model state being what the layout's activations and buffers leave,
    and the size the search chose (by predicted step time, ``choice.expert``)."""
    head = (
        f"mixture of experts: {facts.n_experts} experts x {facts.moe_layers} layers, "
        f"top-{facts.top_k}; expert axis on data={choice.data}, ZeRO-{choice.zero_stage}"
    )
    if (choice.tensor, choice.pipeline, getattr(choice, "context", 1)) != (1, 1, 1):
        # The per-size figures below are the whole model's on the data axis; beside tensor,
        # pipeline or context the search's own memory model ranked the sizes (the table above).
        return (
            f"{head}, tensor={choice.tensor}, pipeline={choice.pipeline}, context="
            f"{getattr(choice, 'context', 1)}: chosen by the search: expert={choice.expert} "
            "(fastest predicted step; every size is in the table above)"
        )
    tokens = max(choice.batch_per_rank // choice.micro_batches, 1) * seq_len
    budget = device_bytes - (memory.total - memory.model_state)
    options = propose_expert_sizes(facts, choice.data, choice.zero_stage, tokens, budget)
    lines = [f"{head} (model state per rank; all-to-all sent per rank and micro-batch):"]
    for o in options:
        note = "" if o.fits else " (does not fit)"
        sent = human(o.all_to_all_sent_bytes)
        lines.append(f"  expert={o.expert}: {human(o.state_bytes)}, {sent}{note}")
    lines.append(f"  chosen by the search: expert={choice.expert} (fastest predicted step)")
    return "\n".join(lines)


def inactive_flop_params(facts: ModelFacts, blocks: int) -> float:
    """Matmul weights of ``blocks`` blocks that a token does not run through: each MoE layer's
    experts beyond its ``top_k`` (0 for a dense model), the MoE layers taken as spread evenly
    over the model's blocks. A routed token costs ``6·top_k/n_experts`` FLOPs per expert weight,
    not 6, at any expert size: the expert axis moves tokens, not work."""
    experts = facts.experts
    if experts is None:
        return 0.0
    flops = experts.expert_part.flop_params * (1 - experts.active_share)
    return flops * blocks / facts.n_layer


def expert_traffic(
    facts: ModelFacts, choice: Choice, experts_sharded_over_replicas: Optional[bool] = None
) -> DataTraffic:
    """Bytes a rank sends per step over the data axis at ``expert`` > 1, on the pipeline rank
    that sends the most: ZeRO's collectives over the dense part on data × context
    (:func:`~lightning_3d.planner.traffic.data_traffic`: the experts are not in ZeRO's buckets nor
    FSDP2's dense units, so the last block's kept units hold its dense part only), and the rank's
    ``1 / expert`` of its stage's experts over their replica group (``R`` ranks,
    :func:`~lightning_3d.planner.expert_memory.replica_size`): ZeRO's collectives at the same
    stage over ``R`` where their state is sharded over the replicas, one all-reduce a step where
    it is kept whole. The experts are whole on every tensor rank (replicated, not split)."""
    p_b, g_b, _, act = facts.bytes
    gathered = act if facts.precision.endswith("mixed") else p_b
    tp, pp, v = choice.tensor, choice.pipeline, choice.virtual_stages
    replicas = replace(choice, data=replica_size(choice), context=1)
    if not resolve(experts_sharded_over_replicas, choice.zero_stage):
        replicas = replace(replicas, zero_stage=0)
    last_block = facts.experts.expert_params / facts.experts.moe_layers
    best = DataTraffic()
    for (part, _), experts in zip(stage_parts(facts, pp, v), stage_expert_parts(facts, pp, v)):
        whole = part.local(tp)
        dense = whole - experts.params
        kept = kept_elements(facts, choice, whole, tp) - (last_block if pp == 1 else 0.0)
        base = data_traffic(choice, dense * g_b, dense * p_b, dense * gathered, kept * gathered)
        held = experts.params / choice.expert
        # FSDP2 over the replicas reshards the experts after forward: none of them kept.
        own = data_traffic(replicas, held * g_b, held * p_b, held * gathered, 0.0)
        traffic = DataTraffic(
            base.all_reduce + own.all_reduce,
            base.reduce_scatter + own.reduce_scatter,
            base.all_gather + own.all_gather,
        )
        if traffic.total > best.total:
            best = traffic
    return best


def all_to_all_time(facts: ModelFacts, choice: Choice, cluster: Cluster, latency: float) -> float:
    """Seconds of token exchange per step at ``choice.expert`` (0 at 1): per micro-batch, every
    MoE layer's ``top_k × tokens × hidden`` rows to their experts' ranks and back (2 directions),
    forward and backward (2 passes), the ``(expert - 1) / expert`` that leave the rank
    (:func:`all_to_all_bytes`), over the expert group's link (inside a node where the group fits
    in one: its ranks are ``context × tensor`` apart, the data axis's stride), and per layer and
    pass two calls' latency each. A rank's tokens are its share of the sequence (``seq_len /
    context``), not divided by ``tensor``: the tensor ranks all route the same tokens, each in
    its own ep group. Under a pipeline each rank exchanges for its own stage's MoE layers only
    (the stage with the most of them is counted). The rows travel at the parameters' width (a
    norm's output, fp32 under mixed precision). None of it hides behind compute: the experts wait
    for their tokens, the next layer for their outputs."""
    experts = facts.experts
    if choice.expert == 1 or experts is None:
        return 0.0
    tokens = choice.micro_batch_size * facts.seq_len // choice.context
    parts = stage_expert_parts(facts, choice.pipeline, choice.virtual_stages)
    layers = round(experts.moe_layers * max(p.params for p in parts) / experts.expert_params)
    stage = replace(experts, moe_layers=layers)
    sent = all_to_all_bytes(stage, tokens, choice.expert, facts.bytes[0])["sent"]
    span = choice.expert * choice.context * choice.tensor
    inside = span <= cluster.devices_per_node or cluster.nodes == 1
    link = (cluster.intra_node_gbps if inside else cluster.inter_node_gbps) * 1e9
    calls = 4 * layers
    return choice.micro_batches * (sent / link + calls * latency)


def _refuse(facts: ExpertFacts, expert: int, data: int) -> None:
    problems = facts.problems(expert, data)
    if problems:
        raise ValueError("; ".join(problems))
