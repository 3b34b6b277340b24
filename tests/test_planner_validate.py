"""``python -m lightning_3d.planner validate=true``: the planner's choice built at its full world size in
one process (fake process group, ``meta`` tensors) and held against the prediction.

Fake world, one process: a 64-rank dp × tp × pp layout of the tiny GPT under ZeRO 1 and 3 passes
through the app; a memory model that predicts wrong bytes, and a tensor-parallel plan the
planner misreads, are each caught. ``-m slow``: the 1,024-rank layout of the 70B configuration.
"""

from __future__ import annotations

import re
import resource
import time

import pytest
import torch

from lightning_3d.planner.choice import Choice
from lightning_3d.strategy.choice_check import rank_kinds, validate_layout

TINY = dict(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=32)


def _tiny():
    from lightning_3d.models import LitGPT

    with torch.device("meta"):
        return LitGPT(**TINY)


@pytest.fixture(scope="module")
def tiny_facts():
    from lightning_3d.planner.facts import model_facts

    return model_facts(
        _tiny(), precision="bf16-mixed", tp_sizes=(1, 2), policies=("none", "full"), name="tiny"
    )


def _app(*overrides: str) -> int:
    from lightning_3d.planner.__main__ import plan
    from tools.harness.apps import compose_config

    return plan(compose_config("plan", *overrides))


def test_rank_kinds_one_per_stage_kind_at_both_corners():
    kinds = rank_kinds(Choice(data=4, tensor=2, pipeline=4), n_layer=8)
    # Stages 1 and 2 hold two blocks and no ends: one kind. Corners (dp 0, tp 0) and (dp 3, tp 1).
    assert [k.rank for k in kinds] == [0, 7, 8, 15, 24, 31]
    assert [(k.stage, k.dp_rank, k.tp_rank) for k in kinds[-2:]] == [(3, 0, 0), (3, 3, 1)]
    assert "embeddings" in kinds[0].label and "head" in kinds[-1].label
    assert [k.rank for k in rank_kinds(Choice(data=1, tensor=1, pipeline=1), n_layer=2)] == [0]


@pytest.mark.parametrize("zero, policy", [(1, "none"), (3, "full")])
def test_app_validates_a_64_rank_layout(capsys, zero, policy):
    code = _app(
        "model=gpt_tiny",
        "cluster.nodes=8",
        "layout.tensor=4",
        "layout.pipeline=2",
        f"planner.zero_stages=[{zero}]",
        "planner.offloads=[none]",
        f"planner.ac_policies=[{policy}]",
        "validate=true",
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert (
        re.search(rf"dp=8 tp=4 (sp )?pp=2 zero={zero}", out)
        and f"ac={policy}" in out
        and "built at 64 ranks" in out
    )
    rows = [line for line in out.splitlines() if line.startswith("| ") and "bytes |" in line]
    assert len(rows) == 2 * 2 * 3  # two stage kinds x two corners x three quantities
    assert {line.split("|")[1].strip() for line in rows} == {"0", "31", "32", "63"}
    assert all(abs(float(line.split("|")[6]) - 1) <= 0.1 for line in rows)
    assert "every rank kind matches" in out


def test_a_wrong_memory_model_is_caught(monkeypatch, capsys, tiny_facts):
    import lightning_3d.planner.memory as planner_memory

    honest = planner_memory.predicted_rank

    # The per-rank prediction validation checks (the search keeps the honest model): one that
    # forgets ZeRO's sharding of the optimizer state.
    def inflated(facts, choice, rank):
        predicted = honest(facts, choice, rank)
        return {
            **predicted,
            "optimizer_state_bytes": predicted["optimizer_state_bytes"] * choice.data,
        }

    choice = Choice(data=4, tensor=2, pipeline=2, zero_stage=1, micro_batches=2, batch_per_rank=2)
    assert not validate_layout(_tiny, tiny_facts, choice, "bf16-mixed").problems
    monkeypatch.setattr(planner_memory, "predicted_rank", inflated)
    problems = validate_layout(_tiny, tiny_facts, choice, "bf16-mixed").problems
    assert problems and all("optimizer_state_bytes" in p for p in problems)
    ratio = float(problems[0].split("ratio ")[1].split(",")[0])
    assert ratio == pytest.approx(4, abs=0.02)  # Adam's scalar step counters: a few bytes
    code = _app(
        "model=gpt_tiny",
        "cluster.nodes=2",
        "cluster.devices_per_node=8",
        "layout.tensor=2",
        "layout.pipeline=2",
        "planner.zero_stages=[1]",
        "planner.offloads=[none]",
        "planner.ac_policies=[none]",
        "validate=true",
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: validation failed:"), err


def test_a_memory_model_that_under_predicts_is_caught(monkeypatch, tiny_facts):
    """The dangerous direction: a model that predicts too little plans layouts that do not fit.
    Broken variant caught (seen failing): ``Row.off`` flagging only ``ratio > 1 + TOLERANCE``."""
    import lightning_3d.planner.memory as planner_memory

    honest = planner_memory.predicted_rank

    def deflated(facts, choice, rank):  # a ZeRO-3 model that shards the gradients twice over
        predicted = honest(facts, choice, rank)
        return {**predicted, "grad_bytes": predicted["grad_bytes"] / choice.data}

    choice = Choice(data=4, tensor=2, pipeline=1, zero_stage=3)
    monkeypatch.setattr(planner_memory, "predicted_rank", deflated)
    problems = validate_layout(_tiny, tiny_facts, choice, "bf16-mixed").problems
    assert problems and all("grad_bytes" in p for p in problems)
    ratio = float(problems[0].split("ratio ")[1].split(",")[0])
    assert ratio == pytest.approx(0.25, abs=0.02)


def test_a_misread_tensor_plan_is_caught(monkeypatch, tiny_facts):
    import lightning_3d.planner.facts as facts_module

    choice = Choice(data=2, tensor=2, pipeline=1, zero_stage=3)
    # "TP splits nothing".
    monkeypatch.setattr(facts_module, "split_dims", lambda module: ({}, set()))
    problems = validate_layout(_tiny, tiny_facts, choice, "bf16-mixed").problems
    assert any(
        "is not split by the plan but placed" in p and "attn.wq.weight" in p for p in problems
    ), problems


def test_activations_measured_on_other_shapes_are_caught(monkeypatch, tiny_facts):
    import lightning_3d.planner.activations as activations

    choice = Choice(
        data=2,
        tensor=2,
        pipeline=2,
        zero_stage=1,
        micro_batches=2,
        batch_per_rank=2,
        ac_policy="full",
    )
    assert not validate_layout(_tiny, tiny_facts, choice, "bf16-mixed").problems
    # A planner that measured the block at full width, as if tensor parallelism split nothing in it.
    monkeypatch.setattr(activations, "local_block", lambda block, prefix, split, columns, tp: block)
    problems = validate_layout(_tiny, tiny_facts, choice, "bf16-mixed").problems
    assert problems and all("activation bytes were measured on" in p for p in problems), problems


@pytest.mark.parametrize("tensor", [1, 2])
def test_zero3_chunks_of_small_dims_are_predicted_on_every_rank(tensor):
    """Width 36 on 5 data ranks: FSDP2 gives rank 0 ceil(36 / 5) = 8 rows of a norm's weight and
    the last rank 4 (at tensor 2, of a column-split weight's 18 rows: 4 and 2), far from 36 / 5;
    the memory model counts each parameter's chunk, so both corners match to the byte."""
    from lightning_3d.models import LitGPT
    from lightning_3d.planner.facts import model_facts

    def narrow():
        with torch.device("meta"):
            return LitGPT(vocab_size=250, block_size=16, n_layer=2, n_head=4, n_embd=36)

    facts = model_facts(
        narrow(), precision="bf16-mixed", tp_sizes=(tensor,), policies=("none",), name="narrow"
    )
    choice = Choice(data=5, tensor=tensor, pipeline=1, zero_stage=3)
    v = validate_layout(narrow, facts, choice, "bf16-mixed")
    assert not v.problems, v.problems
    rows = {(r.kind.dp_rank, r.quantity): r for r in v.rows}
    for dp_rank in (0, 4):
        for quantity in ("param_bytes", "grad_bytes"):
            assert rows[dp_rank, quantity].predicted == rows[dp_rank, quantity].built
        # And Adam's fp32 step counter per parameter.
        optimizer = rows[dp_rank, "optimizer_state_bytes"]
        assert optimizer.built - optimizer.predicted == 4 * len(list(narrow().parameters()))
    # The chunks really differ.
    assert rows[4, "param_bytes"].built < 0.9 * rows[0, "param_bytes"].built


def test_context_layouts_validate_on_the_flattened_shard_axis(capsys, tiny_facts):
    """The planner proposes context parallelism by default, and ZeRO then shards over data x
    context flattened (``dp_cp``). Broken variant caught (seen failing): the check looked for a
    ``dp`` placement and decoded ranks as ``(pp, dp, tp)``, refusing every ZeRO-3 parameter as
    "placed None on dp" (the 70B plan's first choice at 1,024 ranks, dp=512 cp=2)."""
    kinds = rank_kinds(Choice(data=2, tensor=2, pipeline=2, context=2), n_layer=4)
    assert [(k.rank, k.shard_rank) for k in kinds] == [(0, 0), (7, 3), (8, 0), (15, 3)]
    choice = Choice(data=3, tensor=2, pipeline=1, zero_stage=1, context=2)
    assert not validate_layout(_tiny, tiny_facts, choice, "bf16-mixed").problems
    code = _app(
        "model=gpt_tiny",
        "cluster.nodes=2",
        "cluster.devices_per_node=8",
        "layout.tensor=2",
        "layout.pipeline=2",
        "layout.context=2",
        "planner.zero_stages=[3]",
        "planner.offloads=[none]",
        "planner.ac_policies=[none]",
        "validate=true",
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "dp=2 cp=2" in out and "zero=3" in out and "every rank kind matches" in out


def test_offload_is_refused_before_building(tiny_facts):
    with pytest.raises(ValueError, match=r"offload='cpu'.*planner.offloads=\[none\]"):
        validate_layout(
            _tiny,
            tiny_facts,
            Choice(data=2, tensor=1, pipeline=1, zero_stage=1, offload="cpu"),
            "bf16-mixed",
        )


@pytest.mark.slow
def test_70b_at_1024_ranks(capsys):
    start = time.perf_counter()
    code = _app(
        "model=gpt_70b",
        "cluster=128_nodes_8x80gb",
        "layout.tensor=8",
        "layout.pipeline=8",
        "planner.zero_stages=[1]",
        "planner.offloads=[none]",
        "validate=true",
        "top=3",
    )
    seconds = time.perf_counter() - start
    out = capsys.readouterr().out
    assert code == 0, out
    assert "built at 1,024 ranks" in out and "every rank kind matches" in out
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    with capsys.disabled():
        print(
            f"\n70B at 1,024 ranks: plan + validate {seconds:.1f} s in-process; pytest's peak RSS {rss:.2f} GB"
        )
