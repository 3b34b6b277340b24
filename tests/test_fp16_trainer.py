"""fp16 autocast with dynamic loss scaling (``16-mixed``) through the Trainer, on CPUs.

Lightning turns ``precision="16-mixed"`` into bf16 on a CPU, so the fp16 path a GPU run takes —
fp16 matmuls, a ``GradScaler`` whose overflowing steps every rank must skip together, gradients
unscaled after the ZeRO reduction — never runs in CI unless the plugin is passed explicitly:
``MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", ...))``, built inside each rank
(tests/test_precision.py's ``_fp16``: its scale, back-off and step counts, so that the first 3
steps overflow and are skipped everywhere and the other 5 train). Each layout must give one
process's losses and every rank's weight updates within fp16's rounding, reach the same loss
scale, and show that the matmuls really ran in fp16.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_precision import (
    FP16_BACKOFF,
    FP16_INIT,
    FP16_SKIPPED,
    FP16_STEPS,
    FP16_UPDATE_RTOL,
    _fp16,
)

from tools.harness.parity import update_mismatches
from tools.harness.world import run_world

# A step's loss is a mean of cross-entropies of fp16 logits, each layout rounding its own parts
# of the batch: a few units of fp16's rounding (u = 2**-11), 4 u = 0.2% (measured: 0.02%, ZeRO-3).
# A step skipped on one rank only, or a rank's weights left behind: the loss of another model.
FP16_LOSS_RTOL = 4 * 2.0**-11


def fp16_with_matmul_dtypes(rank: int, strategy, devices: int) -> dict:
    """``_fp16`` (tests/test_precision.py) with the output dtypes of every ``nn.Linear`` that
    ran in training, recorded by a global forward hook."""
    from torch.nn.modules.module import register_module_forward_hook

    seen: set = set()

    def hook(module, args, output):
        if isinstance(module, torch.nn.Linear) and module.training and torch.is_grad_enabled():
            seen.add(str(output.dtype))

    handle = register_module_forward_hook(hook)
    try:
        result = _fp16(rank, strategy, devices)
    finally:
        handle.remove()
    result["linear_dtypes"] = sorted(seen)
    return result


@pytest.fixture(scope="module")
def single():
    return fp16_with_matmul_dtypes(0, None, 1)


def test_one_process_runs_fp16_and_scales_the_loss(single):
    """The reference itself: fp16 matmuls, and exactly 3 overflowing steps skipped. Catches a
    plugin that silently runs bf16 (Lightning's CPU mapping) or no autocast at all: no step
    would overflow and the scale would grow or stay."""
    assert single["linear_dtypes"] == ["torch.float16"]
    assert single["loss_scale"] == FP16_INIT * FP16_BACKOFF**FP16_SKIPPED


@pytest.mark.parametrize(
    "strategy",
    [{"zero_stage": 1}, {"zero_stage": 3}, {"pipeline": 2, "micro_batches": 2}],
    ids=["dp2_zero1", "dp2_zero3", "pp2"],
)
def test_16_mixed_matches_one_process(single, strategy):
    """Catches: a rank that unscales its gradients before the ZeRO reduction and another after
    (the update off by the loss scale), a step skipped on one rank only (its weights part from
    the others': each rank's own copy is compared), a loss scale that backs off on one rank
    only, fp16 autocast lost under a layout (FSDP2's gathered parameters, a pipeline stage's
    forward outside the plugin's autocast), and the 1/N mean of ZeRO's reduce-scatter skipped
    (SGD's update doubles)."""
    world = run_world(fp16_with_matmul_dtypes, 2, strategy, 2)
    initial = single["initial_state"]
    for rank, run in enumerate(world):
        assert run["linear_dtypes"] == ["torch.float16"], rank  # autocast ran fp16 here too
        assert run["loss_scale"] == single["loss_scale"], rank  # the same 3 steps skipped
        own = run["rank_state"]
        assert own and all(t.dtype == torch.float32 for t in own.values()), rank  # fp32 masters
        assert all(not torch.equal(own[n], initial[n]) for n in own), rank  # it trained
        assert update_mismatches(own, single["state"], initial, FP16_UPDATE_RTOL) == [], rank
    assert update_mismatches(world[0]["state"], single["state"], initial, FP16_UPDATE_RTOL) == []
    losses, want = world[0]["losses"], single["losses"]
    assert len(losses) == FP16_STEPS and all(math.isfinite(x) for x in losses)
    for step, (got, expected) in enumerate(zip(losses, want)):
        assert math.isclose(got, expected, rel_tol=FP16_LOSS_RTOL), (step, got, expected)
