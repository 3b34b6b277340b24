"""What one rank holds of a mixture-of-experts model's experts, in every layout the strategy runs.

The expert axis (``parallel/expert.py``) is carved from the data ranks at a fixed pipeline,
context and tensor coordinate (``layout.build_expert_mesh``): ``expert`` neighbouring data
ranks split each MoE layer's experts. So, per rank:

- **tensor**: the experts (and the router) are replicated over the tensor ranks, never split
  (``parallel/plans/moe.py``): a rank holds its ``1 / expert`` of the experts whole, whatever
  ``tensor`` is;
- **pipeline**: a stage holds the experts of its own blocks only (:func:`stage_expert_parts`);
- **context**: context ranks see other tokens of the same samples, so they sum the experts'
  gradients like data ranks: the ranks holding the same experts, the *replica group*, are
  ``dp_replica × cp``, ``R = data × context / expert`` of them (:func:`replica_size`).

The experts' model state follows the ZeRO formula over the replica group
(:func:`expert_state`): ``Ψ_e / expert`` elements per rank, then stage ``k`` over ``R``: ZeRO-1
shards their optimizer state (and a bf16 module's fp32 masters) over ``R``, ZeRO-2 also their
gradients, ZeRO-3 (FSDP2 over the replica mesh) weights, gradients and state, each weight's
dim 0 chunked as FSDP2 cuts it. ``R = 1`` (``expert = data × context``) and ZeRO-0 leave them
whole, with their moments and no masters, as the strategy steps them outside the ZeRO engines.

Whether the experts' state is sharded over the replicas or kept whole on every replica, per
ZeRO stage, is one rule, :func:`experts_sharded_over_replicas`; every figure of the planner that
depends on it takes a keyword of that name (``None``: the rule), so a test or a caller can
price either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from lightning_3d.parallel.stages import stage_blocks, stage_ids
from lightning_3d.planner.facts import MASTER_STATE_BYTES, Part, optimizer_state_bytes

if TYPE_CHECKING:
    from lightning_3d.planner.choice import Choice
    from lightning_3d.planner.facts import ModelFacts


def experts_sharded_over_replicas(zero_stage: int) -> bool:
    """Whether the strategy shards the expert weights' ZeRO state over their replica group at
    ``zero_stage`` (ZeRO 1-2: optimizer state and masters, ZeRO-2 also gradients, over
    ``dp_replica × cp``; ZeRO-3: FSDP2 over the same ranks). ``False``: each rank keeps its
    ``1 / expert`` of the experts whole with their gradients and moments (``16 Ψ_e / expert``
    in fp32 AdamW), as at ZeRO-0. The planner's one switch between the two."""
    return zero_stage >= 1


def resolve(sharded: Optional[bool], zero_stage: int) -> bool:
    """``sharded``, or :func:`experts_sharded_over_replicas` at ``zero_stage`` where ``None``."""
    return experts_sharded_over_replicas(zero_stage) if sharded is None else sharded


def replica_size(choice: Choice) -> int:
    """``R``: the ranks holding the same experts, ``dp_replica × cp`` (``parallel/expert.py``'s
    ``expert_groups``)."""
    return choice.data * choice.context // choice.expert


def expert_shards(choice: Choice, sharded: Optional[bool] = None) -> int:
    """Ways a rank's experts' optimizer state is split: ``R`` where it is sharded over the
    replica group (ZeRO 1-3), else 1."""
    r = replica_size(choice)
    return r if resolve(sharded, choice.zero_stage) and choice.zero_stage >= 1 else 1


def replica_rank(choice: Choice, dp_rank: int) -> int:
    """Index in its replica group of the rank whose index over ZeRO's ``data × context`` axis
    (data outer) is ``dp_rank``: data rank ``d`` is expert rank ``d % expert`` of replica group
    ``d // expert`` (``layout.build_expert_mesh``), flattened with the context rank inner."""
    data_rank, context_rank = divmod(dp_rank, choice.context)
    return data_rank // choice.expert * choice.context + context_rank


def stage_expert_parts(facts: ModelFacts, pipeline: int, virtual: int = 1) -> list[Part]:
    """The experts' parameters (all expert ranks' together) in each pipeline rank's blocks, its
    ``virtual`` stages together. Facts without per-block experts spread them evenly by block."""
    experts = facts.experts
    runs = stage_blocks(facts.n_layer, pipeline * virtual)
    out = []
    for rank in range(pipeline):
        ids = [i for s in stage_ids(rank, pipeline, virtual) for i in runs[s]]
        if experts.blocks:
            part = Part()
            for i in ids:
                part = part + experts.blocks[i]
        elif pipeline == 1:
            part = experts.expert_part
        else:
            share = experts.expert_params * len(ids) // facts.n_layer
            part = Part(share, 0, share)
        out.append(part)
    return out


def rank_experts(part: Part, expert: int) -> Part:
    """One expert rank's share of ``part``: every expert weight's dim 0 (the expert) split
    ``expert`` ways (``parallel/expert.py``'s ``shard_expert_weight``), no tensor split."""
    if not part.tensors:
        n = part.params / expert
        return Part(n, 0, part.flop_params / expert)
    tensors = tuple(((rows // expert, n // expert, -1), c) for (rows, n, _), c in part.tensors)
    return Part(part.params // expert, 0, part.flop_params // expert, tensors)


@dataclass(frozen=True)
class ExpertState:
    """Bytes one rank holds of its experts: weights, gradients, optimizer state (masters
    included)."""

    params: float
    grads: float
    optimizer: float

    def added_to(self, state: tuple[float, ...]) -> tuple[float, ...]:
        """``memory.model_state``'s (params, grads, optimizer, host, disk) with these added."""
        params, grads, optimizer, *rest = state
        return (params + self.params, grads + self.grads, optimizer + self.optimizer, *rest)


def expert_state(
    facts: ModelFacts,
    choice: Choice,
    experts: Part,
    dp_rank: int = 0,
    masters: bool = False,
    sharded: Optional[bool] = None,
) -> ExpertState:
    """The rank's bytes of ``experts`` (its stage's, all expert ranks' together) at
    ``choice.expert`` > 1 (the module docstring). ``dp_rank``: its index on ZeRO's axis, which
    picks its ZeRO-3 chunks (0 holds the most); ``masters``: whether ZeRO 0-2 keep fp32 masters
    of this module (``memory.keeps_masters``), which the sharded experts then have too."""
    p_b, g_b, o_b, _ = facts.bytes
    local = rank_experts(experts, choice.expert)
    n = local.params
    r, z = replica_size(choice), choice.zero_stage
    moments = sum(optimizer_state_bytes(choice.optimizer, o_b).values())
    if not resolve(sharded, z) or r == 1 or z == 0:
        return ExpertState(n * p_b, n * g_b, n * moments)
    if masters:  # the replica group's engine keeps them as the dense part's: fp32 master + moments
        moments = sum(
            optimizer_state_bytes(choice.optimizer, MASTER_STATE_BYTES[facts.precision]).values()
        )
    shard = n / r
    if z == 3 and all(rows % r == 0 for (rows, _, _), _ in local.tensors):
        # FSDP2 over the replicas cuts dim 0 (whole experts) where they divide; else dim 1.
        shard = local.sharded(1, r, replica_rank(choice, dp_rank))
    params = shard * p_b if z == 3 else n * p_b
    grads = shard * g_b if z >= 2 else n * g_b
    return ExpertState(params, grads, shard * moments)


def gathered_experts(facts: ModelFacts, choice: Choice, sharded: Optional[bool] = None) -> float:
    """Elements of one MoE layer's experts a rank gathers with its block under ZeRO-3: its
    ``1 / expert`` of them where FSDP2 shards them over the replica group; none where they are
    left whole beside FSDP2's units (held in the model state)."""
    if choice.zero_stage != 3 or not resolve(sharded, 3) or replica_size(choice) == 1:
        return 0.0
    return facts.experts.expert_params / facts.experts.moe_layers / choice.expert
