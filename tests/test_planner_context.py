"""The planner's context axis: a sequence whose activations fit no layout at context=1 is split
over ranks; ZeRO shards over data × context; the attention's exchanges are timed by the formulas
of docs/context-parallelism.md. Plain unit tests on a tiny GPT with a long sequence."""

from __future__ import annotations

import pytest
import torch

from lightning_3d.options import Plan
from lightning_3d.planner import Cluster, PlannerOptions, plan_layouts
from lightning_3d.planner.choice import Choice
from lightning_3d.planner.memory import activation_bytes, model_state, stage_parts
from lightning_3d.planner.timing import context_time

SEQ = 1024
# Four sequences on 4 devices: data parallelism gives each rank one whole sequence, and 3
# blocks make no pipeline of 2 or 4 (activations are measured at tensor=1 only); accumulation
# may split a rank's batch into single sequences. Below one sequence per rank, context is left.
OPTIONS = dict(
    batch_size=4,
    zero_stages=(0, 3),
    ac_policies=("none",),
    offloads=("none",),
    schedules=("1f1b",),
    sequence_parallel=False,
    reserve_gb=0.0,
    max_micro_batches=4,
)


@pytest.fixture(scope="module")
def facts():
    from lightning_3d.models import LitGPT
    from lightning_3d.planner.facts import model_facts

    with torch.device("meta"):
        module = LitGPT(vocab_size=256, block_size=SEQ, n_layer=3, n_head=4, n_embd=64)
    return model_facts(module, precision="32-true", policies=("none",), name="long")


def _plan(facts, memory_gb, contexts):
    cluster = Cluster(nodes=1, devices_per_node=4, device_memory_gb=memory_gb)
    options = PlannerOptions(**OPTIONS, context_sizes=contexts)
    return plan_layouts(facts, cluster, options)


def test_context_divides_the_activations_and_zero_shards_over_data_and_context(facts):
    one = Choice(1, 1, 1, batch_per_rank=1)
    four = Choice(1, 1, 1, batch_per_rank=1, context=4)
    assert activation_bytes(facts, four, 0, 3) == pytest.approx(
        activation_bytes(facts, one, 0, 3) / 4, rel=0.1
    )
    part = stage_parts(facts, 1, 1)[0][0]
    sharded = model_state(facts, Choice(1, 1, 1, zero_stage=3, context=4), part)
    assert sharded[0] == pytest.approx(model_state(facts, Choice(4, 1, 1, zero_stage=3), part)[0])


def test_the_planner_splits_a_sequence_that_fits_no_layout(facts):
    everything = _plan(facts, 1000.0, (1, 2, 4))
    assert {c.choice.context for c in everything if c.fits} == {1, 2, 4}
    need = {
        cp: min(c.memory.total for c in everything if c.fits and c.choice.context == cp)
        for cp in (1, 4)
    }
    budget = (need[1] + need[4]) / 2 / 1e9  # GB between what cp=1 and cp=4 need
    assert not any(c.fits for c in _plan(facts, budget, (1,)))  # without the axis: nothing fits
    best = _plan(facts, budget, (1, 2, 4))[0]
    assert best.fits and best.choice.context > 1, best.choice.label()
    assert f"cp={best.choice.context}" in best.choice.label()
    plan = Plan.from_options(**best.choice.options())  # a plan the strategy takes
    assert plan.layout.context == best.choice.context
    assert plan.cp.scheme == "alltoall"  # 4 heads divide by the context size: fewer bytes


def test_a_sequence_not_divisible_by_twice_the_context_is_rejected(facts):
    from dataclasses import replace

    odd = replace(facts, seq_len=SEQ + 4)  # divisible by 4, not by 8
    rejected = [c for c in _plan(odd, 1000.0, (1, 4)) if c.choice.context == 4]
    assert rejected and all("not divisible by 2 × context = 8" in c.reason for c in rejected)


def test_the_attention_exchanges_follow_the_formulas():
    cluster = Cluster(nodes=1, devices_per_node=8, intra_node_gbps=1.0)  # 1e9 bytes/s
    n = 2 * 512 * 64  # micro-batch 2, 512 local tokens, width 64
    ring = Choice(1, 1, 1, batch_per_rank=2, context=4)
    alltoall = Choice(1, 1, 1, batch_per_rank=2, context=4, context_scheme="alltoall")
    assert context_time(ring, 3, 512 * 64, 4, cluster, 0.0) == pytest.approx(
        3 * 2 * n * (3 * 4 - 2) * 4 / 1e9
    )
    assert context_time(alltoall, 3, 512 * 64, 4, cluster, 0.0) == pytest.approx(
        3 * 8 * n * 3 / 4 * 4 / 1e9
    )
    assert context_time(Choice(1, 1, 1), 3, 512 * 64, 4, cluster, 0.0) == 0.0


def test_auto_context_sizes_are_the_powers_of_two_the_world_and_sequence_allow():
    options = PlannerOptions()
    assert options.context_sizes == "auto"
    assert options.context_sizes_for(8, 1024) == (1, 2, 4, 8)
    assert options.context_sizes_for(6, 1024) == (1, 2)  # 4 does not divide 6 ranks
    assert options.context_sizes_for(8, 12) == (1, 2)  # 12 tokens: not 2 x 4 chunks
    assert options.context_sizes_for(8, 1024, routable=False) == (1,)
    assert PlannerOptions(context_sizes=[1, 3]).context_sizes_for(8, 1024) == (1, 3)
    for bad in ("all", [], [0, 2], 2):
        with pytest.raises(ValueError, match=r"context_sizes=.* must be 'auto' or a non-empty"):
            PlannerOptions(context_sizes=bad)


def test_by_default_a_sequence_that_fits_no_layout_is_split(facts):
    """The default (``context_sizes="auto"``) proposes context parallelism without being asked:
    the same budget as above, nothing fits without the axis, the default's first choice splits."""
    cluster = Cluster(nodes=1, devices_per_node=4, device_memory_gb=1000.0)
    everything = plan_layouts(facts, cluster, PlannerOptions(**OPTIONS))
    need = {
        cp: min(c.memory.total for c in everything if c.fits and c.choice.context == cp)
        for cp in (1, 4)
    }
    budget = (need[1] + need[4]) / 2 / 1e9
    best = plan_layouts(facts, Cluster(1, 4, device_memory_gb=budget), PlannerOptions(**OPTIONS))[0]
    assert best.fits and best.choice.context > 1, best.choice.label()


def test_by_default_context_is_not_chosen_where_a_layout_fits_without_it(facts):
    """Where the sequence fits unsplit, the default ranks the layouts of context 1 as the list
    ``[1]`` does, all of them ahead of any that splits (a split adds exchanges, saves no FLOPs)."""
    cluster = Cluster(nodes=1, devices_per_node=4, device_memory_gb=1000.0)
    alone = plan_layouts(facts, cluster, PlannerOptions(**OPTIONS, context_sizes=(1,)))
    default = [c for c in plan_layouts(facts, cluster, PlannerOptions(**OPTIONS)) if c.fits]
    assert {c.choice.context for c in default} == {1, 2, 4}
    unsplit = [c.choice for c in default if c.choice.context == 1]
    assert unsplit == [c.choice for c in alone if c.fits]
    assert [c.choice.context for c in default[: len(unsplit)]] == [1] * len(unsplit)


def test_a_model_whose_attention_cannot_be_routed_is_not_split():
    from lightning_3d.models import LitGPT
    from lightning_3d.planner.facts import model_facts

    with torch.device("meta"):
        module = LitGPT(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
    facts = model_facts(module, precision="32-true", policies=("none",), name="dropout")
    assert not facts.context_ready
    cands = plan_layouts(facts, Cluster(1, 4, device_memory_gb=1000.0), PlannerOptions(**OPTIONS))
    assert {c.choice.context for c in cands} == {1}
