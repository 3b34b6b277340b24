"""Mixed precision through Lightning's own ``precision=`` flag, mapped onto the sharding.

bf16-mixed keeps fp32 master weights and optimizer state (autocast computes in bf16; under
ZeRO-3 FSDP2 gathers parameters in bf16 and reduces gradients in fp32): every rank's weights
equal a one-process bf16 run's within a tolerance derived from bf16's precision, and the losses
track fp32's. 16-mixed scales the loss dynamically: the first steps overflow and are skipped on
every rank, the rest train, exactly as in one process; every rank must agree on skipping a step
whose gradients overflowed, wherever the overflow was seen.

Both use momentum SGD without clipping, whose update is proportional to the gradient: a rank
that steps with its own (unreduced) gradient, or with twice the mean, moves its weights
differently by O(1) of the update, far above rounding.
"""

import math

import pytest
import torch

from tools.harness.parity import update_mismatches
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

SEED = 1234
SGD = {"optimizer": "sgd", "lr": 0.3}
BF16_STEPS = 6
# bf16 keeps 8 significant bits: unit roundoff u = 2**-8 (0.39%). Between layouts every step's
# gradient differs by a few u (each rank rounds its own part of the batch in its bf16 matmuls);
# those errors add up in the update, so after k steps we allow 2 k u = 4.7% relative error of
# each tensor's update (measured: 1.3%). A ZeRO-1 engine that does not reduce gradients steps
# each slice with one rank's half-batch gradient: tens of percent.
BF16_UNIT = 2.0**-8
BF16_UPDATE_RTOL = 2 * BF16_STEPS * BF16_UNIT
# ZeRO-3 adds a rounding the one-process run does not have: FSDP2 gathers the parameters in bf16,
# norm weights included (autocast keeps those in fp32), so each forward also sees every weight
# rounded. Worst tensor measured (the final norm's weight; 2026-12-02): 1.43% at ZeRO-1 and 4.70%
# at ZeRO-3; medians 0.33% and 0.85%. Twice the bound still fails a missing reduction (tens of
# percent) or a skipped 1/N average (100%).
BF16_GATHERED_UPDATE_RTOL = 2 * BF16_UPDATE_RTOL
BF16_LOSS_VS_FP32 = 0.02  # relative, per step's loss: bf16 autocast still trains the fp32 model


@pytest.fixture(scope="module")
def fp32_sgd():
    return fit_gpt(0, Run(steps=BF16_STEPS, seed=SEED, model=SGD))


@pytest.fixture(scope="module")
def bf16_sgd():
    return _bf16(0, None, 1)


def _bf16(rank, strategy, devices):
    return fit_gpt(
        rank,
        Run(
            strategy=strategy,
            devices=devices,
            steps=BF16_STEPS,
            seed=SEED,
            model=SGD,
            trainer={"precision": "bf16-mixed"},
            rank_state=True,
        ),
    )


@pytest.mark.parametrize(
    "strategy, world",
    [
        ({"zero_stage": 1}, 2),
        pytest.param({"zero_stage": 3}, 2, marks=pytest.mark.slow),
        pytest.param({"pipeline": 2, "micro_batches": 2}, 2, marks=pytest.mark.slow),
    ],
    ids=["zero1_dp2", "zero3_dp2", "pp2"],
)
def test_bf16_mixed_matches_one_process_and_keeps_fp32_masters(fp32_sgd, bf16_sgd, strategy, world):
    """Catches: a ZeRO-1 engine that never reduces gradients (each rank steps its slice with its
    own gradient), and one that skips the 1/N average (SGD's update doubles: 100% error); both
    fail the update tolerance of 2 k u = 4.7% (ZeRO-3: twice that, see above), which bf16 rounding
    stays inside (1.4%; ZeRO-3: 4.7%)."""
    runs = run_world(_bf16, world, strategy, world)
    initial = bf16_sgd["initial_state"]
    rtol = BF16_GATHERED_UPDATE_RTOL if strategy.get("zero_stage") == 3 else BF16_UPDATE_RTOL
    for rank, run in enumerate(runs):  # each rank's own weights, not only rank 0's gathered ones
        assert run["rank_state"], rank
        assert all(t.dtype == torch.float32 for t in run["rank_state"].values())  # master weights
        assert update_mismatches(run["rank_state"], bf16_sgd["state"], initial, rtol) == [], rank
    assert update_mismatches(runs[0]["state"], bf16_sgd["state"], initial, rtol) == []
    assert len(runs[0]["losses"]) == BF16_STEPS
    for step, (got, want) in enumerate(zip(runs[0]["losses"], fp32_sgd["losses"])):
        assert abs(got - want) / want < BF16_LOSS_VS_FP32, (step, got, want)
    assert runs[0]["losses"] != fp32_sgd["losses"]  # autocast really computed in bf16
    assert runs[0]["summary"]["layout"]["precision"] == "bf16-mixed"


# 16-mixed: scale 2**36 overflows fp16, so do 2**28 and 2**20 (2**18 still does here); backing off
# by 2**-8 per overflow reaches 2**12 after 3 skipped steps, well below overflow (2**17 trains),
# so every layout skips the same steps. The other 5 steps train.
FP16_STEPS, FP16_INIT, FP16_BACKOFF, FP16_SKIPPED = 8, 2.0**36, 2.0**-8, 3
# fp16 keeps 11 significant bits (u = 2**-11); over 5 trained steps, 4 k u = 1% relative error of
# each tensor's update (measured: 0.16%). A step skipped or taken on one rank only: O(1).
FP16_UPDATE_RTOL = 4 * (FP16_STEPS - FP16_SKIPPED) * 2.0**-11


def _fp16(rank, strategy, devices):
    from lightning.pytorch.plugins.precision import MixedPrecision

    # Lightning maps precision="16-mixed" to bf16 on CPU; the fp16 plugin is passed explicitly.
    scaler = torch.amp.GradScaler("cpu", init_scale=FP16_INIT, backoff_factor=FP16_BACKOFF)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    return fit_gpt(
        rank,
        Run(
            strategy=strategy,
            devices=devices,
            steps=FP16_STEPS,
            seed=SEED,
            model=SGD,
            trainer={"plugins": [plugin]},
            rank_state=True,
        ),
    )


@pytest.fixture(scope="module")
def fp16_single():
    return _fp16(0, None, 1)


@pytest.mark.parametrize(
    "strategy", [{"zero_stage": 2}, {"pipeline": 2, "micro_batches": 2}], ids=["zero2", "pp2"]
)
def test_16_mixed_skips_overflowing_steps_on_every_rank_and_trains(fp16_single, strategy):
    """The first 3 steps overflow and are skipped (the scale backs off 3 times), the other 5
    train: every rank's weights moved, and equal one process's within fp16 rounding.

    Catches: every step skipped (weights never move, the scale backs off 8 times), ZeRO without
    the 1/N average of fp16-scaled gradients (SGD's update doubles). A step skipped on one rank
    only is test_an_overflow_seen_by_one_rank_skips_the_step_on_all's."""
    single = fp16_single
    assert single["loss_scale"] == FP16_INIT * FP16_BACKOFF**FP16_SKIPPED  # exactly 3 skipped steps
    runs = run_world(_fp16, 2, strategy, 2)
    initial = single["initial_state"]
    for rank, run in enumerate(runs):
        assert run["loss_scale"] == single["loss_scale"], rank
        own = run["rank_state"]
        assert own and all(not torch.equal(own[n], initial[n]) for n in own), rank  # trained
        assert update_mismatches(own, single["state"], initial, FP16_UPDATE_RTOL) == [], rank
    assert update_mismatches(runs[0]["state"], single["state"], initial, FP16_UPDATE_RTOL) == []
    losses = runs[0]["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]  # it learned


def _overflow_on_rank_0_only(rank):
    import torch.distributed as dist
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_3d.strategy.precision import distributed_precision

    dist.init_process_group("gloo")
    try:
        # The plugin as ThreeDStrategy.setup adapts it: its scaler's unscale_ shares the check.
        plugin = distributed_precision(
            MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        )
        scaler = plugin.scaler
        weight = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.SGD([weight], lr=0.1)
        scaler.scale(weight.sum()).backward()
        if rank == 0:
            weight.grad[1] = float("inf")  # only this rank's shard overflowed
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        return weight.detach().clone(), scaler.get_scale()
    finally:
        dist.destroy_process_group()


def test_an_overflow_seen_by_one_rank_skips_the_step_on_all():
    (w0, s0), (w1, s1) = run_world(_overflow_on_rank_0_only, 2)
    assert torch.equal(w0, torch.ones(3)) and torch.equal(w1, torch.ones(3))  # no rank stepped
    assert s0 == s1 == 2.0**16 / 2  # both halved the scale
