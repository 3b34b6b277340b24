"""Expert parallelism under ZeRO-2 with context and with tensor parallelism, and checkpoints of
those layouts resumed elsewhere: the reference MoE GPT on 4 gloo ranks against one process.

ZeRO-2 reduce-scatters the dense weights' gradients into slices over the data ranks; the expert
weights (``DTensor`` s sharded on ``ep``) are summed over the ranks holding the same experts: at
ep2 x cp2 the two context ranks, bucketed in a second engine there (``parallel/expert_zero.py``);
at ep2 x tp2 none (a replica group of one rank), so they stay whole, set aside from the engine,
their gradient hook dividing by the data size (``parallel/expert.py``). ep2 x cp2: two data
ranks split the experts, each sequence cut in two; ep2 x tp2: attention split over two tensor
ranks, router and experts replicated on them. Parity as in ``tests/test_expert_parallel_tp_cp.py``:
momentum SGD (an update proportional to the gradient, so a wrong scale shows), a shared expert,
a load-balancing loss weighted 0.1, ranks seeded differently; losses step by step, every
tensor's update and every rank's copy compared with one process.

Checkpoints written at ep2 x tp2 after 2 steps (consolidated: one file with every expert whole;
sharded: ``torch.distributed.checkpoint``'s directory) and resumed for 2 more steps at ep1 (two
data ranks, no tensor split) or at ep1 x tp2 give the uninterrupted ep2 x tp2 run's losses and
weights (the momentum of every expert restored: momentum SGD shows a lost one).

Broken variants caught (each planted and reverted, seen failing): the expert engine of ZeRO-2
dividing the summed expert gradients by the replica group's size instead of the data size
(``expert_zero.py``'s ``divide``: ``ep2_cp2``); the expert gradient hook not dividing by the data
size (``ep2_tp2``, whose replica group is one rank: no expert engine); the set-aside expert
weights' optimizer state left out of the consolidated gather (both consolidated resumes) and of
the sharded optimizer state (both sharded resumes): the expert momentum restarts at zero.
"""

from __future__ import annotations

import dataclasses

import pytest

from tools.harness.parity import (
    loss_mismatches,
    rank_state_mismatches,
    update_mismatches,
    weight_mismatches,
)
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks
from tools.harness.world import run_world

SEED = 1234
STEPS = 3
MOE = {
    "optimizer": "sgd",
    "lr": 0.3,
    "n_experts": 4,
    "top_k": 2,
    "shared_expert": True,
    "aux_loss_coef": 0.1,
}
ZERO2 = {
    "ep2_cp2": {"expert": 2, "context": 2, "zero_stage": 2},
    "ep2_tp2": {"expert": 2, "tensor": 2, "zero_stage": 2},
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n == "ep2_cp2" else pytest.mark.slow) for n in ZERO2]
)
def test_zero2_with_experts_matches_one_process(name):
    """ZeRO-2 at ep2 x cp2 and ep2 x tp2 (4 ranks) against one process: the losses, every
    tensor's update, every rank's copy of every weight."""
    one = fit_gpt(0, Run(arch="moe", steps=STEPS, seed=SEED, model=MOE))
    one_3d = run_world(
        fit_gpt_ranks, 1, Run(arch="moe", strategy={}, steps=STEPS, seed=SEED, model=MOE)
    )[0]
    run = Run(
        arch="moe",
        strategy=ZERO2[name],
        devices=4,
        steps=STEPS,
        seed=SEED,
        model=MOE,
        rank_seeds=True,
    )
    world = run_world(fit_gpt_ranks, 4, run)
    problems = loss_mismatches(world[0]["losses"], one_3d["losses"])
    problems += update_mismatches(world[0]["state"], one["state"], one["initial_state"], 1e-4)
    problems += rank_state_mismatches(world, one)
    assert problems == [], "\n".join(problems)


def _fit(strategy: dict, devices: int, steps: int, **kwargs) -> dict:
    run = Run(arch="moe", strategy=strategy, devices=devices, steps=steps, seed=SEED, model=MOE)
    return run_world(fit_gpt, devices, dataclasses.replace(run, **kwargs))[0]


RESUMED = {  # id -> (strategy, devices) of the resumed run
    "ep1": ({"zero_stage": 1}, 2),
    "ep1_tp2": ({"tensor": 2, "zero_stage": 1}, 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("resumed", list(RESUMED))
@pytest.mark.parametrize("checkpoint_format", ["consolidated", "sharded"])
def test_checkpoint_at_ep2_tp2_resumes_elsewhere_exactly(tmp_path, checkpoint_format, resumed):
    """2 steps at ep2 x tp2 (ZeRO-1), saved, 2 more at ``resumed``: the uninterrupted ep2 x tp2
    run's losses and weights."""
    saved = {"expert": 2, "tensor": 2, "zero_stage": 1, "checkpoint_format": checkpoint_format}
    straight = _fit(saved, 4, 4)
    first = _fit(saved, 4, 2, save_to=str(tmp_path / "run.ckpt"), save_every_n_steps=1)
    path = tmp_path / "run-step=2.ckpt"
    assert path.is_dir() == (checkpoint_format == "sharded")
    strategy, devices = RESUMED[resumed]
    strategy = {**strategy, "checkpoint_format": checkpoint_format}
    second = _fit(strategy, devices, 4, resume_from=str(path))
    problems = loss_mismatches(first["losses"] + second["losses"], straight["losses"])
    problems += weight_mismatches(second["state"], straight["state"], 1e-5, 1e-6)
    assert problems == [], "\n".join(problems)
