"""Mixed precision through Lightning's own ``precision=`` flag, mapped onto the sharding.

bf16-mixed keeps fp32 master weights and optimizer state (autocast computes in bf16; under
ZeRO-3 FSDP2 gathers parameters in bf16 and reduces gradients in fp32) and stays within a stated
tolerance of fp32 over 20 steps. 16-mixed scales the loss dynamically; every rank must agree on
skipping a step whose gradients overflowed, wherever the overflow was seen.
"""

import pytest
import torch

from lightning_3d.testing.parity import assert_same_run
from lightning_3d.testing.runs import fit_gpt
from lightning_3d.testing.world import run_world

SEED = 1234
BF16_TOLERANCE = 0.02  # relative, per step's loss, over 20 steps


@pytest.fixture(scope="module")
def fp32_20_steps():
    return fit_gpt(0, None, 1, 20, SEED)


@pytest.mark.parametrize("strategy, world", [
    pytest.param({"zero_stage": 1}, 2, marks=pytest.mark.slow),
    ({"zero_stage": 3}, 2),
    pytest.param({"pipeline": 2, "micro_batches": 2}, 2, marks=pytest.mark.slow),
], ids=["zero1_dp2", "zero3_dp2", "pp2"])
def test_bf16_mixed_tracks_fp32_and_keeps_fp32_masters(fp32_20_steps, strategy, world):
    run = run_world(fit_gpt, world, strategy, world, 20, SEED, None, None, {"precision": "bf16-mixed"})[0]
    ref = fp32_20_steps["losses"]
    assert len(run["losses"]) == 20
    for step, (got, want) in enumerate(zip(run["losses"], ref)):
        assert abs(got - want) / want < BF16_TOLERANCE, (step, got, want)
    assert run["losses"] != ref  # autocast really computed in bf16
    assert all(t.dtype == torch.float32 for t in run["state"].values())  # master weights
    assert run["summary"]["layout"]["precision"] == "bf16-mixed"


def _fp16(rank, strategy, devices, init_scale):
    from lightning.pytorch.plugins.precision import MixedPrecision

    # Lightning maps precision="16-mixed" to bf16 on CPU; the fp16 plugin is passed explicitly.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))
    return fit_gpt(rank, strategy, devices, 6, SEED, None, None, {"plugins": [plugin]})


@pytest.mark.parametrize("strategy", [
    {"zero_stage": 2},
    pytest.param({"pipeline": 2, "micro_batches": 2}, marks=pytest.mark.slow),
], ids=["zero2", "pp2"])
def test_16_mixed_skips_overflowing_steps_on_every_rank(strategy):
    """An initial scale of 2**40 overflows fp16 gradients: the first steps are skipped and the
    scale halves each time, exactly as in one process, on every rank."""
    single = _fp16(0, None, 1, 2.0**40)
    runs = run_world(_fp16, 2, strategy, 2, 2.0**40)
    assert single["loss_scale"] < 2.0**40  # overflows happened and were skipped
    assert [r["loss_scale"] for r in runs] == [single["loss_scale"]] * 2
    assert_same_run(runs[0], single, rtol=1e-3, atol=1e-3)


def _overflow_on_rank_0_only(rank):
    import torch.distributed as dist
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_3d import ThreeDStrategy

    dist.init_process_group("gloo")
    try:
        strategy = ThreeDStrategy(precision_plugin=MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
        strategy._share_overflow_checks()
        scaler = strategy.precision_plugin.scaler
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
