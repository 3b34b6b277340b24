"""The layouts published runs use: pipelines whose stages do not divide the blocks (an 80-layer
model on 6 stages, a 126-layer one on 16 with interleaving) and micro-batch counts that are not
powers of two (3, 6, 12 of a 384-device batch).

Plain unit tests on deep, narrow GPTs (their facts take seconds); one of the uneven layouts is
built in a fake world at its full size and held against the prediction. The strategy's side
(the same splits training as one process) is ``tests/test_pipeline.py``.
"""

from __future__ import annotations

import collections

import torch

from lightning_3d.planner import Cluster, PlannerOptions, plan_layouts
from lightning_3d.planner.choice import Choice
from lightning_3d.strategy.choice_check import rank_kinds, validate_layout

# What the search varies here; the rest of the enumeration is other tests' business.
NARROW = PlannerOptions(
    zero_stages=(1,),
    ac_policies=("none",),
    offloads=("none",),
    sequence_parallel=False,
    context_sizes=(1,),
)


def _deep(n_layer: int):
    from lightning_3d.models import LitGPT

    def make():
        with torch.device("meta"):
            return LitGPT(vocab_size=256, block_size=64, n_layer=n_layer, n_head=8, n_embd=64)

    return make


def _facts(n_layer: int):
    from lightning_3d.planner.facts import model_facts

    return model_facts(
        _deep(n_layer)(), precision="bf16-mixed", tp_sizes=(1, 2), policies=("none",), name="deep"
    )


def test_a_70_block_model_on_384_devices_plans_uneven_pipelines_and_3_micro_batches():
    """384 = 2^7 x 3 devices, 70 = 2 x 5 x 7 blocks: only pipelines of 1 and 2 divided both.
    Broken variants caught (seen failing): the search's "pipeline does not divide blocks"
    refusal, and micro-batch counts limited to powers of two."""
    facts = _facts(70)
    found = [
        c for c in plan_layouts(facts, Cluster(nodes=48, devices_per_node=8), NARROW) if c.fits
    ]
    pipelines = collections.Counter(c.choice.pipeline for c in found)
    assert {3, 4, 6, 8, 12, 16, 24, 32, 48, 64} <= set(pipelines), pipelines
    micro = {c.choice.micro_batches for c in found}
    assert {3, 6, 12, 24} <= micro, sorted(micro)
    # Interleaved chunks need not divide the blocks either: 6 ranks x 2 = 12 stages of 70.
    assert any(c.choice.pipeline == 6 and c.choice.virtual_stages == 2 for c in found)


def test_a_126_block_model_on_16_stages_is_planned_and_built_as_predicted():
    """126 blocks on 16 ranks (8 stages of 8 blocks, 8 of 7), and interleaved on 32 stages (30 of
    4, 2 of 3): planned, and the interleaved one built rank kind by rank kind in a fake world
    against the memory model. Broken variant caught (seen failing): the strategy refusing an
    interleaved split that does not divide the blocks."""
    facts = _facts(126)
    options = PlannerOptions(**{**NARROW.__dict__, "batch_size": 64})
    found = [
        c for c in plan_layouts(facts, Cluster(nodes=4, devices_per_node=8), options) if c.fits
    ]
    on_16 = {(c.choice.schedule, c.choice.virtual_stages) for c in found if c.choice.pipeline == 16}
    assert {("1f1b", 1), ("interleaved_1f1b", 2)} <= on_16, on_16
    choice = Choice(
        data=2,
        tensor=1,
        pipeline=16,
        zero_stage=1,
        micro_batches=16,
        schedule="interleaved_1f1b",
        virtual_stages=2,
        batch_per_rank=32,
    )
    kinds = rank_kinds(choice, 126)
    assert {k.label.split(": ")[1].split(" blocks")[0] for k in kinds} == {"8", "7"}
    result = validate_layout(_deep(126), facts, choice, "bf16-mixed")
    assert not result.problems, result.problems[:3]


def test_the_strategy_refuses_more_stages_than_blocks_before_the_planner_proposes_them():
    facts = _facts(4)
    candidates = plan_layouts(facts, Cluster(nodes=1, devices_per_node=8), NARROW)
    assert not any(c.fits and c.choice.pipeline * c.choice.virtual_stages > 4 for c in candidates)
    refused = [c for c in candidates if c.kind == "pipeline > blocks"]
    assert [c.choice.pipeline for c in refused] == [8], refused
    assert "pp=8 > n_layer=4" in refused[0].reason
