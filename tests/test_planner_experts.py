"""The planner's MoE facts (``planner/experts.py``) against the reference MoE GPT: counted
parameters, model-state bytes per rank against what an ep run holds, all-to-all volume against
what the collective is handed, and the ``expert`` sizes it proposes.

The search's expert axis (``planner/search.py``): it picks ``expert`` > 1 where the experts do
not fit replicated, the memory model's bytes per rank equal what ep1 and ep2 runs hold, and given
sizes the model cannot take are refused before anything is enumerated.

Broken variants caught (each planted, seen failing, reverted): the experts' state counted as
ZeRO-sharded at ``expert`` > 1 (the measured-bytes test); the all-to-all counted one direction
only (the measured-volume test and the step-time test); the memory model counting the experts
replicated at ``expert`` > 1 (the search and the ep2 run-bytes tests) or leaving them out at
``expert`` = 1 (the ep1 run-bytes test); the search without its expert axis (the search test);
given sizes not refused before the enumeration (the refusal test); ``auto`` not keeping a given
``expert`` (the auto test).
"""

from __future__ import annotations

import pytest
import torch

from lightning_3d.planner import Cluster, PlannerOptions
from lightning_3d.planner.choice import Choice
from lightning_3d.planner.experts import (
    ExpertFacts,
    all_to_all_bytes,
    expert_facts,
    expert_state_bytes,
    propose_expert_sizes,
)
from tools.harness.runs import TINY_MODEL, Run
from tools.harness.world import run_world

MOE = {"n_experts": 4, "top_k": 2, "shared_expert": True}


def _facts(**model):
    from lightning_3d.models.moe import LitMoEGPT

    with torch.device("meta"):
        module = LitMoEGPT(**{**TINY_MODEL, **MOE, **model})
    return expert_facts(module), module


def test_facts_count_the_experts_of_the_reference_moe_gpt():
    facts, module = _facts()
    C, H = TINY_MODEL["n_embd"], 4 * TINY_MODEL["n_embd"]
    assert facts.expert_params == TINY_MODEL["n_layer"] * 4 * 2 * C * H
    assert facts.expert_params + facts.dense_params == sum(p.numel() for p in module.parameters())
    assert (facts.moe_layers, facts.n_experts, facts.top_k, facts.hidden) == (2, 4, 2, C)
    from lightning_3d.models import LitGPT

    with torch.device("meta"):
        assert expert_facts(LitGPT(**TINY_MODEL)) is None


def test_state_bytes_and_proposals():
    facts = ExpertFacts(
        moe_layers=2, n_experts=8, top_k=2, hidden=64, expert_params=800, dense_params=200
    )
    assert expert_state_bytes(facts, 1, 4, 3) == 16 * 1000 / 4
    assert expert_state_bytes(facts, 4, 4, 3) == 16 * 200 / 4 + 16 * 800 / 4
    assert expert_state_bytes(facts, 2, 4, 0) == 16 * 200 + 16 * 800 / 2
    volume = all_to_all_bytes(facts, tokens=100, expert=4)
    assert (
        volume["through"] == 4 * 2 * 2 * 100 * 64 * 4
        and volume["sent"] == volume["through"] * 3 / 4
    )
    assert all_to_all_bytes(facts, 100, 1) == {"through": 0.0, "sent": 0.0}
    capped = ExpertFacts(2, 8, 2, 64, 800, 200, capacity_factor=0.5)
    # 8 experts x ceil(0.5 * 200 slots / 8) = 104 slots at most
    assert all_to_all_bytes(capped, 100, 4)["through"] == 4 * 2 * 104 * 64 * 4
    # ZeRO-1 on 4 ranks: ep1 10000 bytes, ep2 2200 + 6400, ep4 2200 + 3200: a budget only ep4 meets.
    budget = expert_state_bytes(facts, 4, 4, 1)
    sizes = propose_expert_sizes(facts, data=4, zero_stage=1, tokens=100, memory_bytes=budget)
    assert [o.expert for o in sizes] == [4, 1, 2] and sizes[0].fits and not sizes[1].fits
    roomy = propose_expert_sizes(facts, data=4, zero_stage=1, tokens=100)
    assert [o.expert for o in roomy] == [1, 2, 4]  # all fit: the least traffic first
    three = ExpertFacts(2, 6, 2, 64, 600, 200)
    assert [o.expert for o in propose_expert_sizes(three, 4, 1, 100)] == [1, 2]


@pytest.mark.parametrize(
    ("expert", "data", "message"),
    [
        (3, 4, "expert=3 does not divide data=4; expert=3 does not divide n_experts=8"),
        (0, 4, "expert=0 must be a positive integer"),
    ],
)
def test_bad_sizes_are_refused_naming_the_values(expert, data, message):
    facts = ExpertFacts(2, 8, 2, 64, 800, 200)
    with pytest.raises(ValueError, match=message):
        expert_state_bytes(facts, expert, data, 1)


def fit_gpt_world(rank: int, run: Run) -> dict:
    from tools.harness.runs import fit_gpt

    return fit_gpt(rank, run)


def _counted_fit(rank: int, run: Run) -> dict:
    """``fit_gpt`` counting what the all-to-alls are handed, from the second step on."""
    import torch.distributed as dist

    from tools.bench.comm import count_collectives
    from tools.harness.runs import fit_gpt

    with count_collectives() as counter:
        result = fit_gpt(rank, run)
    result["all_to_all"] = counter.by_op.get("dist.all_to_all_single")
    result["world"] = dist.get_world_size() if dist.is_initialized() else 1
    return result


def test_state_bytes_and_all_to_all_volume_match_an_ep2_run():
    """ep=2 on 2 ranks (ZeRO-1, AdamW): rank 0's model-state bytes at the end of backward are the
    formula's, and the bytes handed to the all-to-all over the run are the theory's for the
    token rows plus the per-expert counts (one int64 per expert, layer and forward), in the
    mean over ranks."""
    steps, batch, block = 2, 8, TINY_MODEL["block_size"]
    run = Run(
        arch="moe",
        strategy={"expert": 2, "zero_stage": 1},
        devices=2,
        steps=steps,
        model={**MOE, "optimizer": "adamw"},
    )
    results = run_world(_counted_fit, 2, run)
    facts, _ = _facts()
    mine = results[0]["summary"]["ranks"][0]
    held = mine["param_bytes"] + mine["grad_bytes"] + mine["optimizer_state_bytes"]
    assert held == pytest.approx(expert_state_bytes(facts, 2, 2, 1), rel=0.02)
    tokens = batch // 2 * block
    rows = all_to_all_bytes(facts, tokens, 2)["through"] * steps
    counts = 8 * facts.n_experts * facts.moe_layers * steps
    # A rank hands over its own slots (dispatch, and their gradients back) and the slots its
    # experts received (the outputs, and their gradients): those vary by rank, their mean not.
    handed = [r["all_to_all"].payload_bytes for r in results]
    assert sum(handed) / 2 == rows + counts, handed
    _assert_the_planner_predicts(results, expert=2)


def _assert_the_planner_predicts(results: list, expert: int) -> None:
    """The search's memory model (``planner/memory.py`` on the model's facts, the layout as a
    ``Choice``) against the bytes each rank of a ZeRO-1 run on 2 ranks held: parameters,
    gradients and optimizer state each within 2 % (ZeRO's buckets pad to whole slices)."""
    from lightning_3d.planner.memory import predicted_rank

    facts = _model_facts()
    choice = Choice(2, 1, 1, zero_stage=1, batch_per_rank=4, optimizer="adamw", expert=expert)
    held = results[0]["summary"]["ranks"]
    for rank in (0, 1):
        predicted = predicted_rank(facts, choice, rank)
        for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes"):
            assert predicted[key] == pytest.approx(held[rank][key], rel=0.02), (rank, key)


def test_the_planner_predicts_what_an_ep1_run_holds():
    """The MoE GPT at ``expert=1`` (the experts ordinary ZeRO-1 parameters) on 2 gloo ranks: each
    rank's model-state bytes are the search's (the ep2 run is checked above)."""
    run = Run(
        arch="moe",
        strategy={"expert": 1, "zero_stage": 1},
        devices=2,
        steps=2,
        model={**MOE, "optimizer": "adamw"},
    )
    _assert_the_planner_predicts(run_world(fit_gpt_world, 2, run), expert=1)


def _bench_cfg(**moe):
    from tools.bench.__main__ import load_config

    cfg, _ = load_config(["--quick"])
    cfg["moe"] = {**cfg["moe"], **moe}
    return cfg


def test_bench_moe_rows_theory_and_refusals():
    """The bench's MoE rows (``tools/bench/moe.py``): their theory is the planner's, and an
    expert axis the expert count does not split is refused before any process starts."""
    from tools.bench.compare import check_settings, formula, theory

    cfg = _bench_cfg()
    from tools.bench.moe import moe_facts

    facts = moe_facts(cfg)
    ep2 = theory("3d_moe_ep2", cfg, 0, 0)
    assert ep2["state_bytes"] == expert_state_bytes(facts, 2, 2, 1)
    tokens = cfg["data"]["batch_size"] // 2 * cfg["model"]["block_size"]
    a2a = all_to_all_bytes(facts, tokens, 2)["sent"]
    dense = 2 * 0.5 * 4 * facts.dense_params
    stats = 2 * 0.5 * 4 * 9 * facts.moe_layers
    assert ep2["sent_bytes"] == pytest.approx(dense + a2a + 8 * 4 * 2 / 2 + stats)
    assert "16Ψ_e/2" in formula("3d_moe_ep2")
    cfg = _bench_cfg(n_experts=3)
    cfg["rows"] = ["3d_moe_ep2"]
    with pytest.raises(
        ValueError, match=r"row 3d_moe_ep2: expert \(2\) must divide moe.n_experts \(3\)"
    ):
        check_settings(cfg)


@pytest.mark.slow
def test_bench_moe_rows_measure_their_theory(tmp_path):
    """``python -m tools.bench --quick`` on the four MoE rows: model state and bytes sent per
    step are the theory's (ratios 1.000 measured on 2026-12-06; the ZeRO-3 rows' theory counts
    the units FSDP2 keeps gathered from forward to backward)."""
    from tools.bench.__main__ import main
    from tools.bench.compare import ROWS

    rows = [name for name, row in ROWS.items() if row.arch == "moe"]
    records = main(["--quick", "--rows", *rows, "--outdir", str(tmp_path)])
    assert [r["row"] for r in records] == rows
    for r in records:
        assert r["state_bytes"] / r["state_formula_bytes"] == pytest.approx(1, abs=1e-3), r["row"]
        assert r["sent_bytes"] / r["sent_theory_bytes"] == pytest.approx(1, abs=0.01), r["row"]


def test_cli_summary_proposes_the_expert_axis_that_fits():
    """The planner CLI's MoE lines: every size that divides data and the experts, the ones whose
    state does not fit beside the layout's activations marked, and the size the search chose;
    beside tensor parallelism the size the search chose alone (its table ranks the others)."""
    from lightning_3d.planner import Choice, MemorySplit
    from lightning_3d.planner.experts import expert_summary

    facts = ExpertFacts(
        moe_layers=2, n_experts=8, top_k=2, hidden=64, expert_params=800, dense_params=200
    )
    choice = Choice(data=4, tensor=1, pipeline=1, zero_stage=1, batch_per_rank=2, expert=4)
    memory = MemorySplit(params=0, grads=0, optimizer=0, activations=1000, buffers=0)
    text = expert_summary(facts, choice, memory, device_bytes=1000 + 6000, seq_len=10)
    # ep4: ZeRO-1 dense 8*200 + 8*200/4 + experts 16*800/4; all-to-all 4*2*(2*10)*64*4 * 3/4
    assert "expert=4: 5.2 kB, 61.4 kB\n" in text and "expert=1: 10.0 kB, 0 B (does not fit)" in text
    assert text.endswith("chosen by the search: expert=4 (fastest predicted step)")
    tp = Choice(data=2, tensor=2, pipeline=1, zero_stage=1, expert=2)
    assert expert_summary(facts, tp, memory, 1e9, 10).endswith(
        "tensor=2, pipeline=1, context=1: chosen by the search: expert=2 (fastest predicted step; "
        "every size is in the table above)"
    )


def _model_facts(precision="32-true", **model):
    from dataclasses import replace

    from lightning_3d.planner.facts import model_facts

    experts, module = _facts(**model)
    facts = model_facts(module, precision=precision, policies=("none",), tp_sizes=(1,))
    # the data axis alone (no stage split to try), the experts as plan_candidates adds them
    return replace(facts, pipeline_ready=False, experts=experts)


# The search on two single-device nodes (no tensor axis fits a node, the facts allow no pipeline,
# one sequence chunk): the data axis with or without experts split over it, plain data parallelism.
_SEARCH = dict(
    batch_size=4,
    precision="32-true",
    zero_stages=(0,),
    ac_policies=("none",),
    offloads=("none",),
    max_micro_batches=1,
    context_sizes=(1,),
    sequence_parallel=False,
    reserve_gb=0.0,
    bucket_size_mb=0.25,
)


def test_search_splits_the_experts_where_they_do_not_fit_replicated():
    """16 experts of a 64-wide MoE GPT (1 M of its 1.1 M parameters): replicated on both data
    ranks they need 16 B each per rank, split over 2 half that. With device memory between the
    two the search's first choice is ``expert=2``, and the replicated layout is refused for
    memory; with room for both every size dividing data and the experts is ranked."""
    from lightning_3d.planner.memory import rank_memory
    from lightning_3d.planner.search import plan_layouts

    facts = _model_facts(n_embd=64, n_experts=16, block_size=8)
    options = PlannerOptions(**_SEARCH)
    need = {
        ep: rank_memory(facts, Choice(2, 1, 1, batch_per_rank=2, expert=ep), options).total
        for ep in (1, 2)
    }
    # the experts' 16 B per parameter, halved (the dense part and activations are the same)
    assert need[1] - need[2] == pytest.approx(16 * facts.experts.expert_params / 2)
    tight = Cluster(nodes=2, devices_per_node=1, device_memory_gb=(need[1] + need[2]) / 2e9)
    cands = plan_layouts(facts, tight, options)
    assert cands[0].fits and cands[0].choice.expert == 2, cands[0].choice.label()
    assert cands[0].choice.options()["expert"] == 2
    refused = [c for c in cands if c.choice.expert == 1 and c.choice.data == 2]
    assert refused and all(c.kind == "device memory" for c in refused)
    roomy = Cluster(nodes=2, devices_per_node=1, device_memory_gb=1.0)
    assert {c.choice.expert for c in plan_layouts(facts, roomy, options) if c.fits} == {1, 2}


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            (3,),
            r"^expert_sizes=\[3\]: expert=3 does not divide data=2; expert=3 does not divide "
            r"n_experts=4$",
        ),
        (
            (2, 8),
            r"^expert_sizes=\[2, 8\]: expert=8 does not divide data=2; expert=8 does not "
            r"divide n_experts=4$",
        ),
    ],
)
def test_expert_sizes_the_model_cannot_take_are_refused_in_one_line(sizes, message):
    from lightning_3d.planner.search import plan_layouts

    facts = _model_facts()
    cluster = Cluster(nodes=2, devices_per_node=1, device_memory_gb=1.0)
    with pytest.raises(ValueError, match=message):
        plan_layouts(facts, cluster, PlannerOptions(**_SEARCH, expert_sizes=sizes))
    with pytest.raises(ValueError, match="must be 'auto' or a non-empty list of positive"):
        PlannerOptions(expert_sizes=[0])
    from dataclasses import replace

    dense = replace(facts, experts=None)
    with pytest.raises(
        ValueError, match=r"expert_sizes=\[2\]: the model has no mixture-of-experts"
    ):
        plan_layouts(dense, cluster, PlannerOptions(**_SEARCH, expert_sizes=(2,)))
    given = plan_layouts(facts, cluster, PlannerOptions(**_SEARCH, expert_sizes=(2,)))
    assert {c.choice.expert for c in given if c.fits} == {2}


def test_auto_keeps_the_expert_size_it_is_given():
    """``parallelism=auto`` with ``expert=2`` (``strategy/auto.py``): the search keeps that size and
    the chosen plan runs it; without it the search ranks every size (the run's ``expert`` free)."""
    from lightning_3d.options import Plan
    from lightning_3d.strategy.auto import choose, planned

    _, module = _facts()
    cluster = Cluster(nodes=1, devices_per_node=2, device_memory_gb=8.0)
    plan = Plan.from_options(auto=True, expert=2)
    best = choose(module, cluster, plan, batch_size=8, device_type="cpu")
    assert best.choice.expert == 2 and planned(plan, best.choice).layout.expert == 2
    free = choose(module, cluster, Plan.from_options(auto=True), batch_size=8, device_type="cpu")
    assert free.choice.expert in (1, 2)


def test_step_time_moves_tokens_at_expert_2_and_counts_top_k_experts():
    """The search's time terms (``planner/timing.py`` with ``planner/experts.py``): at ``expert=2``
    the exchange is ``top_k × tokens × hidden × 4 B × 2 directions × 2 passes`` per MoE layer and
    micro-batch, half of it leaving the rank, over the node's link; a token's FLOPs count 2 of
    the 4 experts' weights at any expert size."""
    from lightning_3d.planner.experts import all_to_all_time, inactive_flop_params
    from lightning_3d.planner.timing import model_flops_per_token

    facts = _model_facts()
    e = facts.experts
    cluster = Cluster(nodes=1, devices_per_node=2, device_memory_gb=1.0, intra_node_gbps=1.0)
    choice = Choice(2, 1, 1, batch_per_rank=4, micro_batches=2, expert=2)
    tokens = 2 * TINY_MODEL["block_size"]  # a micro-batch of 2 sequences on this rank
    sent = 2 * 2 * e.moe_layers * e.top_k * tokens * e.hidden * 4 / 2
    assert all_to_all_time(facts, choice, cluster, latency=0.0) == pytest.approx(2 * sent / 1e9)
    assert all_to_all_time(facts, Choice(2, 1, 1, batch_per_rank=4), cluster, 0.0) == 0.0
    assert inactive_flop_params(facts, facts.n_layer) == e.expert_params / 2
    dense = facts.flop_params - e.expert_params / 2
    attention = 12 * facts.n_layer * facts.d_model * facts.seq_len
    assert model_flops_per_token(facts) == 6 * dense + attention
