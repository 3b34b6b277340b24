"""Clipping by value (``gradient_clip_algorithm="value"``) under every gradient layout.

Catches: with ``tensor=2`` a parameter list mixes plain tensors (replicated parameters) and
DTensors (split parameters), and torch's ``clip_grad_value_`` (what Lightning calls) crashed
on the mix; clamping is elementwise, so each gradient's local shard is clamped in place. Each
case trains a few fp32 steps with a threshold small enough that most elements are clamped, and
compares losses and weights, tensor by tensor, with one process.
"""

import pytest

from tools.harness.parity import assert_same_run
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

STEPS, SEED = 3, 1234
TRAINER = {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}


@pytest.fixture(scope="module")
def reference():
    return fit_gpt(0, Run(steps=STEPS, seed=SEED, trainer=TRAINER))


@pytest.mark.parametrize("strategy", [{"tensor": 2}, {"zero_stage": 3}], ids=["tp2", "zero3-dp2"])
def test_clip_by_value_matches_one_process(reference, strategy):
    run = Run(strategy=strategy, devices=2, steps=STEPS, seed=SEED, trainer=TRAINER)
    result = run_world(fit_gpt, 2, run, timeout=300)[0]
    assert_same_run(result, reference)
