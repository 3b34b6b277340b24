"""A Hugging Face mixture-of-experts family's router loss under a pipeline
(``models/hf_pipeline_router.py``): tiny qwen3_moe and mixtral with ``router_aux_loss_coef`` > 0
at pp2 (2 ranks; slow: other schedules, ZeRO-3, the chunked loss, and tp2 / cp2 / ep2 x pp2 on 4)
against one process, and under the device guard.

What one process means here, as for the reference MoE under a pipeline
(``tests/test_expert_parallel_pp.py``): a pipeline step of ``m`` micro-batches computes the
router loss per micro-batch from that micro-batch's global sums, so the reference is one process
that accumulates the same ``m`` micro-batches (``accumulate_grad_batches=m``, a batch of
``global / m``). Momentum SGD (an update proportional to the gradient, so a wrong scale shows),
4 layers (2 per stage: the routers of the first stage get their gradient through the carried
sums), the router loss weighted 0.5 so its gradient is a visible part of every router's.
Compared: the losses, every tensor's update, every rank's own weights, and the step figures'
``router_aux_loss`` (what is logged: the last stage's, gathered on every stage).

Broken variants caught (each planted and reverted, seen failing): the carried loss not divided
by the micro-batches (``aux_weight`` the runtime's weight times ``m``); the first stage's sums
not sent on (each stage's loss from its own layers only: every router's update off); the
probability sums sent without their gradient (the first stage's routers get none); the logged
loss not gathered over the stages (the first stage's figures 0); a host-made zero in that
gather's all-reduce (the device guard).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tools.harness.parity import (  # noqa: E402
    loss_mismatches,
    rank_state_mismatches,
    update_mismatches,
)
from tools.harness.runs import Run, fit_gpt_ranks  # noqa: E402
from tools.harness.world import run_world  # noqa: E402

SEED = 1234
STEPS = 3
MICRO = 2


def _model(family: str) -> dict:
    from tools.harness.hf_configs import tiny_config

    config = tiny_config(family, num_hidden_layers=4)
    return {"optimizer": "sgd", "lr": 0.3, "hf": config, "router_aux_loss_coef": 0.5}


def one_process(model: dict) -> dict:
    run = Run(
        arch="hf",
        strategy={},
        steps=STEPS,
        seed=SEED,
        model=model,
        data={"batch_size": 8 // MICRO},
        trainer={"accumulate_grad_batches": MICRO},
    )
    return run_world(fit_gpt_ranks, 1, run)[0]


def pipelined(model: dict, world: int, **strategy) -> list:
    strategy = {"pipeline": 2, "micro_batches": MICRO, "zero_stage": 1, **strategy}
    run = Run(arch="hf", strategy=strategy, devices=world, steps=STEPS, seed=SEED, model=model)
    return run_world(fit_gpt_ranks, world, run)


def assert_matches(world: list, one: dict) -> None:
    problems = loss_mismatches(world[0]["losses"], one["losses"])
    problems += update_mismatches(world[0]["state"], one["state"], one["initial_state"], 1e-4)
    problems += rank_state_mismatches(world, one, 1e-5)
    assert problems == [], "\n".join(problems)
    ref = one["summary"]["step_figures"]["router_aux_loss"]  # one value a step
    assert len(ref) == STEPS and min(ref) > 0
    for rank in world:  # the last stage's value, gathered on every stage
        assert rank["summary"]["step_figures"]["router_aux_loss"] == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_pp2_trains_the_router_loss_as_one_process(family):
    """pp2 (1F1B, 2 micro-batches, ZeRO-1) with the router loss on: one process's losses and
    every tensor's update, the routers of both stages included."""
    model = _model(family)
    assert_matches(pipelined(model, 2), one_process(model))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_ep2_pp2_trains_the_router_loss_as_one_process(family):
    """ep2 x pp2 on 4 ranks: the sums over each stage's two data ranks, the experts split."""
    model = _model(family)
    assert_matches(pipelined(model, 4, expert=2), one_process(model))


VARIANTS = {  # id -> (world, strategy changes)
    "zero3": (2, {"zero_stage": 3}),
    "gpipe": (2, {"schedule": "gpipe"}),
    "interleaved_1f1b": (2, {"schedule": "interleaved_1f1b"}),
    "zero_bubble": (2, {"schedule": "zero_bubble"}),
    "chunked_loss": (2, {"loss_chunks": 2}),
    "tp2": (4, {"tensor": 2}),
    "cp2": (4, {"context": 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_pp2_variants_train_the_router_loss_as_one_process(name):
    """qwen3_moe at pp2 under ZeRO-3 (FSDP2 on each stage), other schedules (GPipe; interleaved
    1F1B: two stages per rank, the sums crossing four stages; zero bubble: the backward split
    into the inputs' and the weights'), the chunked loss (the last stage ending at the head's
    input), and with tensor or context parallelism (4 ranks: the sums over data x context)."""
    world, strategy = VARIANTS[name]
    model = _model("qwen3_moe")
    assert_matches(pipelined(model, world, **strategy), one_process(model))


def test_the_carried_router_loss_is_device_faithful():
    """qwen3_moe at pp2 with the router loss under the device guard (``tests/support/
    device_guard.py``): no host-made tensor in a collective (the per-stage sums' all-reduce, the
    carried vector the schedule sends, the logged loss's all-reduce), no host read in the step."""
    from support.guarded_runs import guarded_fit

    strategy = {"pipeline": 2, "micro_batches": MICRO, "zero_stage": 1}
    run = Run(
        arch="hf", strategy=strategy, devices=2, steps=2, seed=SEED, model=_model("qwen3_moe")
    )
    for rank, result in enumerate(run_world(guarded_fit, 2, run, ())):
        assert not result["violations"], f"rank {rank}:\n" + "\n".join(result["violations"])
