"""Planner facts for mixture-of-experts models: expert bytes per rank, all-to-all volume, and
which ``expert`` sizes to run an MoE model with.

Expert parallelism (``parallel/expert.py``) splits each MoE layer's experts over ``expert``
ranks carved from the data axis. Per rank, with ``Ψ_e`` the parameters of all experts and
``Ψ_d`` every other parameter (fp32 AdamW: 4 bytes of weight, 4 of gradient, 8 of moments):

- ``expert`` = 1: every expert is an ordinary data-parallel parameter, so the whole model
  follows the ZeRO formula (``observe.memory.zero_formula_bytes``) over the ``N`` data ranks;
- ``expert`` > 1: the dense part follows ZeRO over ``N``; the experts are left to the expert
  axis (the ZeRO engines set them aside, FSDP2 ignores them), so each rank holds
  ``16 Ψ_e / expert`` bytes whatever the ZeRO stage: their state is not sharded again over
  the ``N / expert`` ranks that hold the same experts.

All-to-all per micro-batch and rank: each of the ``L`` MoE layers sends every routed token slot
(``top_k × tokens`` rows of ``hidden`` elements) to its expert's rank and the outputs back
(2 directions), forward and backward (2 passes): ``4 L · top_k · tokens · hidden`` elements
through the collective, of which ``(expert - 1) / expert`` leave the rank under an even router
(what ``tools/bench/comm.py`` counts as sent). With a capacity factor under 1 at most that
share of the slots travels. The per-expert counts (one int64 per expert, layer and forward)
travel too and are left out: a rounding error next to the tokens.

Pure: a model on ``meta`` in (:func:`expert_facts`), numbers out. The planner's CLI prints
:func:`expert_summary` under its first choice and the bench's MoE rows take their theory from
here; :func:`lightning_3d.planner.search.plan_layouts` does not enumerate an expert axis yet
(its layouts have none; ``Plan`` refuses ``auto`` with ``expert`` > 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from lightning_3d.observe.memory import zero_formula_bytes
from lightning_3d.parallel.expert import moe_layers
from lightning_3d.planner.memory import human

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
    """

    moe_layers: int
    n_experts: int
    top_k: int
    hidden: int
    expert_params: int
    dense_params: int
    capacity_factor: Optional[float] = None

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
    experts = sum(p.numel() for layer in layers for p in layer.experts.parameters())
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
    )


def expert_state_bytes(facts: ExpertFacts, expert: int, data: int, zero_stage: int) -> float:
    """Model-state bytes per rank (fp32 AdamW) at ``expert`` × ``data`` (module docstring)."""
    _refuse(facts, expert, data)
    if expert == 1:
        return zero_formula_bytes(facts.dense_params + facts.expert_params, zero_stage, data)
    dense = zero_formula_bytes(facts.dense_params, zero_stage, data)
    return dense + STATE_BYTES * facts.expert_params / expert


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
    :func:`propose_expert_sizes` ranks on that layout's data axis, the device memory left to
    model state being what the layout's activations and buffers leave."""
    head = (
        f"mixture of experts: {facts.n_experts} experts x {facts.moe_layers} layers, "
        f"top-{facts.top_k}; expert axis on data={choice.data}, ZeRO-{choice.zero_stage}"
    )
    if (choice.tensor, choice.pipeline, getattr(choice, "context", 1)) != (1, 1, 1):
        return f"{head}: none (expert > 1 does not combine with tensor, pipeline or context yet)"
    tokens = max(choice.batch_per_rank // choice.micro_batches, 1) * seq_len
    budget = device_bytes - (memory.total - memory.model_state)
    options = propose_expert_sizes(facts, choice.data, choice.zero_stage, tokens, budget)
    lines = [f"{head} (model state per rank; all-to-all sent per rank and micro-batch):"]
    for o in options:
        note = "" if o.fits else " (does not fit)"
        sent = human(o.all_to_all_sent_bytes)
        lines.append(f"  expert={o.expert}: {human(o.state_bytes)}, {sent}{note}")
    lines.append(
        f"  proposed: ThreeDStrategy(expert={options[0].expert}) (parallelism=auto does not "
        "choose an expert axis yet)"
    )
    return "\n".join(lines)


def _refuse(facts: ExpertFacts, expert: int, data: int) -> None:
    problems = facts.problems(expert, data)
    if problems:
        raise ValueError("; ".join(problems))
