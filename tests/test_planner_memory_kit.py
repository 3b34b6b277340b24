"""The memory kit in the layout planner and ``parallelism=auto``: the rungs a layout climbs where
it does not fit (chunked loss, 8-bit AdamW states, activation offload; planner/kit.py), the
run's own ``loss_chunks="auto"`` counted at the chunk it will use, and the choice handed on.

Plain unit tests on a 4-block GPT built on ``meta`` (512-token vocabulary, 64 wide, 256 tokens:
logits, states and block activations all weigh), one device whose memory is set to what each
combination of rungs needs.
"""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import replace

import pytest
import torch

from lightning_3d.options import Plan
from lightning_3d.options.model_check import check
from lightning_3d.parallel.chunked_loss import auto_chunks
from lightning_3d.planner import Cluster, PlannerOptions, plan_layouts
from lightning_3d.planner.choice import MEMORY_KIT, Choice
from lightning_3d.planner.facts import model_facts
from lightning_3d.planner.memory import rank_memory
from lightning_3d.planner.table import ranked_table
from lightning_3d.strategy.auto import choose_plan, constraints

MODEL = dict(vocab_size=512, block_size=256, n_layer=4, n_head=2, n_embd=64)
CHUNKS = auto_chunks(MODEL["vocab_size"], MODEL["n_embd"])  # 8
ONE = dict(
    zero_stages=(0,), ac_policies=("none",), offloads=("none",), reserve_gb=0.0, max_micro_batches=1
)


@pytest.fixture(scope="module")
def module():
    from lightning_3d.models import LitGPT

    with torch.device("meta"):
        return LitGPT(**MODEL)


@pytest.fixture(scope="module")
def facts(module):
    return model_facts(
        module, precision="bf16-mixed", tp_sizes=(1, 2), policies=("none",), name="kit"
    )


def _plan(facts, module, budget, devices=1, **options):
    cluster = Cluster(nodes=1, devices_per_node=devices, device_memory_gb=budget / 1e9)
    opts = PlannerOptions(batch_size=8, **{**ONE, **options})
    return plan_layouts(facts, cluster, opts, check=functools.partial(check, module))


def _need(facts, rungs):
    """Device bytes of the one-device layout with exactly ``rungs`` on."""
    opts = PlannerOptions(batch_size=8, **ONE)
    choice = replace(
        Choice(1, 1, 1, batch_per_rank=8),
        loss_chunks=CHUNKS if "loss_chunks" in rungs else 1,
        optimizer="adamw8bit" if "low_bit" in rungs else "adamw",
        activation_offload="activation_offload" in rungs,
    )
    return rank_memory(facts, choice, opts).total


def _rungs(choice) -> set[str]:
    on = set()
    if choice.loss_chunks > 1:
        on.add("loss_chunks")
    if choice.optimizer == "adamw8bit":
        on.add("low_bit")
    if choice.activation_offload:
        on.add("activation_offload")
    return on


def test_a_layout_that_fits_gets_no_rung(facts, module):
    roomy = _need(facts, set()) + 1
    with_kit = _plan(facts, module, roomy, memory_kit=MEMORY_KIT)[0]
    without = _plan(facts, module, roomy)[0]
    assert with_kit.fits and with_kit.choice == without.choice and not _rungs(with_kit.choice)
    assert with_kit.choice.kit_label() == ""


@pytest.mark.parametrize(
    "rungs",
    [
        {"loss_chunks"},
        {"loss_chunks", "low_bit"},
        {"activation_offload"},
        {"loss_chunks", "activation_offload"},
        {"loss_chunks", "low_bit", "activation_offload"},
    ],
    ids=lambda r: "+".join(sorted(r)),
)
def test_a_layout_that_does_not_fit_climbs_exactly_the_rungs_it_needs(facts, module, rungs):
    """The device holds exactly what ``rungs`` need: every cheaper combination needs more (checked
    here, so the case is what it says), and the search turns on those rungs and no other."""
    budget = _need(facts, rungs) + 1
    every = [set(c) for n in range(4) for c in itertools.combinations(MEMORY_KIT, n)]
    earlier = [c for c in every if _code(c) < _code(rungs)]
    assert all(_need(facts, c) > budget for c in earlier), "not the case this test means"
    assert not _plan(facts, module, budget)[0].fits  # nothing fits without the kit
    best = _plan(facts, module, budget, memory_kit=MEMORY_KIT)[0]
    assert best.fits and _rungs(best.choice) == rungs, best.choice.label()
    assert best.memory.total == pytest.approx(budget - 1)
    if "loss_chunks" in rungs:
        assert best.choice.loss_chunks == CHUNKS
    # the table and the label say what was turned on
    assert best.choice.kit_label() in ranked_table([best]) and best.choice.kit_label()


def _code(rungs) -> int:
    """The climbing order: a binary count, the cheapest rung the lowest bit."""
    return sum(1 << i for i, rung in enumerate(MEMORY_KIT) if rung in rungs)


def test_nothing_fits_even_with_the_kit(facts, module):
    budget = _need(facts, set(MEMORY_KIT)) - 1
    cands = _plan(facts, module, budget, memory_kit=MEMORY_KIT)
    assert not any(c.fits for c in cands)
    assert {c.kind for c in cands} == {"device memory"}
    # the refusal says what the layout needs with the whole kit, and names the kit
    assert cands[0].memory.total == pytest.approx(budget + 1)
    assert "loss_chunks=8 adamw8bit activation_offload" in cands[0].choice.label()


def test_the_rungs_keep_every_refusal(facts, module):
    """Chunked loss under tensor parallelism at the rank's vocabulary's count, 8-bit states
    never beside offload, nor at ZeRO 1-3 with periodic checkpoints, nor in place of SGD: at
    every budget from what the whole kit needs on one device to what nothing needs, on two
    devices."""
    low, high = _need(facts, set(MEMORY_KIT)), _need(facts, set())
    climbed = set()
    for budget in [low / 2 + (high - low / 2) * i / 12 for i in range(13)]:
        cands = _plan(
            facts,
            module,
            budget,
            devices=2,
            memory_kit=MEMORY_KIT,
            zero_stages=(0, 1, 2, 3),
            offloads=("none", "cpu"),
            sequence_parallel=False,
            checkpoints=True,
        )
        for c in cands:
            ch = c.choice
            if ch.loss_chunks > 1:
                assert ch.loss_chunks == auto_chunks(512, 64, ch.tensor), ch.label()
            assert not (ch.optimizer == "adamw8bit" and ch.offload != "none"), ch.label()
            assert not (ch.optimizer == "adamw8bit" and ch.zero_stage > 0), ch.label()
            climbed |= _rungs(ch) if c.fits else set()
        sgd = _plan(facts, module, budget, memory_kit=MEMORY_KIT, optimizer="sgd")
        assert all(c.choice.optimizer == "sgd" for c in sgd)
    assert climbed == set(MEMORY_KIT)  # the budgets did make the layouts climb
    # ZeRO-1 on two ranks: where 8-bit states are what fits, periodic checkpoints refuse them
    for budget in [low / 4 + (high - low / 4) * i / 24 for i in range(25)]:
        zero1 = dict(devices=2, memory_kit=MEMORY_KIT, zero_stages=(1,), bucket_size_mb=1.0)
        zero1["sequence_parallel"] = False
        free = _plan(facts, module, budget, **zero1)
        if any(c.fits and c.choice.optimizer == "adamw8bit" for c in free):
            saving = _plan(facts, module, budget, checkpoints=True, **zero1)
            assert not any(c.choice.optimizer == "adamw8bit" for c in saving)
            break
    else:
        pytest.fail("no budget made a ZeRO-1 layout climb to 8-bit states")


def test_loss_chunks_auto_is_counted_at_the_chunk_the_run_uses(facts, module):
    """Catches: the planner counting whole logits for ``loss_chunks="auto"``, which the run
    resolves to ``ceil(V / H)`` chunks (of the rank's ``ceil(V / tp)`` under tensor
    parallelism)."""
    roomy = 1e12
    auto = _plan(facts, module, roomy, loss_chunks="auto")[0]
    counted = _plan(facts, module, roomy, loss_chunks=CHUNKS)[0]
    whole = _plan(facts, module, roomy)[0]
    assert auto.choice.loss_chunks == CHUNKS
    assert auto.memory.activations == counted.memory.activations < whole.memory.activations
    split = _plan(facts, module, roomy, devices=2, loss_chunks="auto", sequence_parallel=False)
    tp2 = next(c for c in split if c.fits and c.choice.tensor == 2)
    assert tp2.choice.loss_chunks == auto_chunks(512, 64, 2) == 4  # the rank's 256 rows / 64


def test_bad_kit_values_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"memory_kit=\['chunks'\] must be a list of"):
        PlannerOptions(memory_kit=["chunks"])
    with pytest.raises(ValueError, match=r"optimizer='lion' must be one of"):
        PlannerOptions(optimizer="lion")


def test_parallelism_auto_applies_the_rungs(facts, module):
    """``choose_plan`` (the strategy's and the app's auto): the chosen plan runs with the rungs
    the search turned on, its line says so; the 8-bit rung only where the caller can set the
    optimizer (the app), and the run's own options leave their rung out."""
    cluster = Cluster(nodes=1, devices_per_node=1, device_memory_gb=(_need(facts, set()) - 1) / 1e9)

    def chosen(budget_rungs, **kw):
        budget = _need(facts, budget_rungs) + 1
        plan = Plan.from_options(auto=True, auto_memory_gb=budget / 1e9, **kw.pop("plan", {}))
        return choose_plan(
            module,
            plan,
            cluster,
            batch_size=8,
            seq_len=MODEL["block_size"],
            accumulate=1,
            precision="bf16-mixed",
            device_type="cuda",
            context_sizes=(1,),
            **kw,
        )

    got = chosen({"loss_chunks", "activation_offload"})
    assert got.plan.loss.chunks == CHUNKS and got.plan.ac.offload is True
    assert got.optimizer == "adamw" and "memory kit: loss_chunks=8 activation_offload" in got.line
    got = chosen({"loss_chunks", "low_bit"}, optimizer_settable=True)
    assert got.optimizer == "adamw8bit" and got.plan.loss.chunks == CHUNKS
    assert got.plan.ac.offload is False
    # without a settable optimizer the 8-bit rung is not climbed (something else fits instead)
    got = chosen({"loss_chunks", "low_bit"})
    assert got.optimizer == "adamw" and "adamw8bit" not in got.line
    # the run's own loss_chunks="auto" is counted, and kept as the run gave it
    got = chosen({"loss_chunks"}, plan={"loss_chunks": "auto"})
    assert got.plan.loss.chunks == "auto" and got.plan.ac.offload is False
    assert f"memory kit: loss_chunks={CHUNKS};" in got.line  # counted at the run's count
    # CPU ranks: their host is their device, activation offload is no rung there
    assert (
        "activation_offload"
        not in constraints(Plan.from_options(auto=True), "cpu").memory["memory_kit"]
    )


def _app_spec(app, *overrides):
    from hydra import compose, initialize_config_dir

    from lightning_3d.app.config import CONF_DIR, register_configs
    from lightning_3d.app.spec import read_spec

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return read_spec(compose(app, overrides=["parallelism=auto", *overrides]))


def test_the_apps_choice_hands_the_rungs_to_the_ranks():
    """``with_auto`` (the apps' launcher): the rungs the planner turned on reach the ranks as
    overrides, the 8-bit states as ``model.optimizer`` (the fine-tune app only), and the spec the
    launcher validates carries them. Catches: a launcher that plans with the kit and launches
    ranks without it (they would run out of the memory the plan counted on)."""
    from lightning_3d.app.run import model_on_meta
    from lightning_3d.app.spec import with_auto

    wide = ["model=gpt_tiny", "model.vocab_size=2048", "data.batch_size=8", "trainer.devices=1"]

    def need(spec, model, **choice):
        opts = PlannerOptions(batch_size=8, seq_len=32, precision="32-true", reserve_gb=0.0)
        facts = model_facts(model, seq_len=32, precision="32-true", tp_sizes=(1,))
        return rank_memory(facts, Choice(1, 1, 1, batch_per_rank=8, **choice), opts).total

    spec = _app_spec("train", *wide)
    model = model_on_meta(spec.model)
    chunks = auto_chunks(2048, 32)
    budget = need(spec, model, loss_chunks=chunks) + 1
    spec = replace(spec, plan=spec.plan.updated(auto_memory_gb=budget / 1e9, ac_policy="none"))
    chosen, given, planned = with_auto(spec, model)
    assert chosen.plan.loss.chunks == chunks and f"parallelism.loss_chunks={chunks}" in given
    assert not any(g.startswith("model.optimizer") for g in given)  # the train app: never
    # the fine-tune app: 8-bit states where they are what fits (loss_chunks=auto is its own)
    spec = _app_spec("finetune", *wide, "offload=none", "finetune.pretrained=null")
    budget = need(spec, model, loss_chunks=chunks, optimizer="adamw8bit") + 1
    spec = replace(spec, plan=spec.plan.updated(auto_memory_gb=budget / 1e9, ac_policy="none"))
    chosen, given, planned = with_auto(spec, model)
    assert "model.optimizer=adamw8bit" in given and chosen.model.optimizer == "adamw8bit"
    assert planned["optimizer"] == "adamw8bit" and chosen.plan.loss.chunks == "auto"


def test_the_strategys_auto_trains_with_the_rung_it_chose():
    """``ThreeDStrategy(auto=True, auto_memory_gb=...)`` on one CPU rank, with a budget whole
    logits do not fit: the strategy runs the chunked loss the planner chose, step for step the
    run with ``loss_chunks`` given by hand (same losses, same weights; SGD). Catches: a choice
    the plan does not carry (the run would train whole logits, in memory it was told it lacks)."""
    import torch.distributed as dist

    from tools.harness.runs import TINY_DATA, TINY_MODEL, Run, fit_gpt

    model = {"vocab_size": 2048, "optimizer": "sgd", "dropout": 0.0}
    with torch.device("meta"):
        from lightning_3d.models import LitGPT

        meta = LitGPT(**{**TINY_MODEL, **model})
    seq, batch = TINY_DATA["block_size"], TINY_DATA["batch_size"]
    facts = model_facts(meta, seq_len=seq, precision="32-true", tp_sizes=(1,), policies=("none",))
    opts = PlannerOptions(batch_size=batch, seq_len=seq, precision="32-true", optimizer="sgd")
    chunks = auto_chunks(2048, TINY_MODEL["n_embd"])
    choice = Choice(1, 1, 1, batch_per_rank=batch, optimizer="sgd", loss_chunks=chunks)
    budget = rank_memory(facts, choice, opts).total + 1
    environ = dict(os.environ)
    try:
        auto = fit_gpt(0, Run(strategy={"auto": True, "auto_memory_gb": budget / 1e9}, model=model))
        by_hand = fit_gpt(0, Run(strategy={"loss_chunks": chunks}, model=model))
    finally:  # the strategy's one-rank process group and the variables Lightning set for it
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    assert auto["summary"]["planned"]["layout"]["loss_chunks"] == chunks
    assert auto["losses"] == by_hand["losses"]
    for name, tensor in by_hand["state"].items():
        assert torch.equal(auto["state"][name], tensor), name
