"""ZeRO 0-3 at data=2 and data=4 reproduce a single-process run (multi-process gloo worlds).

data=2 runs plain steps; data=4 adds gradient accumulation and a gradient-clipping threshold
that is always hit, so a norm computed over a local shard instead of globally would show. Every
run uses LitGPT's two param groups (decay / no decay) and its warmup-cosine LR scheduler.
"""

import math

import pytest

from lightning_3d.memory import zero_formula_bytes
from lightning_3d.testing.parity import assert_same_run
from lightning_3d.testing.runs import fit_gpt
from lightning_3d.testing.world import run_world

STEPS = 5
SEED = 1234
TRAINER = {2: {}, 4: {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}}


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(data: int, stage: int | None):
        key = (data, stage)
        if key not in cache:
            if stage is None:  # the single-process reference, Lightning's own strategy
                cache[key] = [fit_gpt(0, None, 1, STEPS, SEED, None, None, TRAINER[data])]
            else:
                cache[key] = run_world(fit_gpt, data, {"zero_stage": stage}, data, STEPS, SEED, None, None, TRAINER[data])
        return cache[key]

    return get


@pytest.mark.parametrize("data", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_matches_single_process(runs, data, stage):
    reference = runs(data, None)[0]
    world = runs(data, stage)
    assert len(world[0]["losses"]) == STEPS
    for rank in world[1:]:  # every rank reports the same global loss
        assert rank["losses"] == world[0]["losses"]
    assert_same_run(world[0], reference)


@pytest.mark.parametrize("data", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_memory_follows_the_paper(runs, data, stage):
    """Per-rank bytes at the end of backward: params / grads / Adam state as ZeRO predicts."""
    world = runs(data, stage)
    psi = world[0]["summary"]["num_params"]
    full = {"param_bytes": 4 * psi, "grad_bytes": 4 * psi, "optimizer_state_bytes": 8 * psi}
    sharded = {0: (), 1: ("optimizer_state_bytes",), 2: ("optimizer_state_bytes", "grad_bytes"),
               3: ("optimizer_state_bytes", "grad_bytes", "param_bytes")}[stage]
    for rank in world[0]["summary"]["ranks"]:
        for key, expected in full.items():
            expected = expected / data if key in sharded else expected
            assert math.isclose(rank[key], expected, rel_tol=0.10), (key, rank[key], expected)
        total = rank["param_bytes"] + rank["grad_bytes"] + rank["optimizer_state_bytes"]
        assert math.isclose(total, zero_formula_bytes(psi, stage, data), rel_tol=0.10)
        assert rank["unsharded_param_bytes"] == (0 if stage == 3 else rank["param_bytes"])


def test_parity_check_detects_a_one_percent_learning_rate_change(runs):
    """The comparison used above is sharp enough to see a small real difference."""
    reference = runs(2, None)[0]
    perturbed = fit_gpt(0, None, 1, STEPS, SEED, {"lr": 3e-3 * 1.01}, None, TRAINER[2])
    with pytest.raises(AssertionError, match="relative error"):
        assert_same_run(perturbed, reference)
