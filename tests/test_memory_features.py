"""Offload and activation checkpointing through the strategy: the same run as without them.

Offloading Adam's state to CPU RAM or to NVMe files (streamed in chunks of 10 kB here, so every
parameter spans several chunks) and recomputing activations in backward must not change a
single number beyond float noise: losses and updated weights within 1e-6 of the same layout
without the feature (fp32, 5 steps).
"""

import pytest

from tools.harness.parity import assert_same_run
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

STEPS, SEED, TIGHT = 5, 1234, 1e-6


def _run(strategy, world, trainer=None, model=None):
    return run_world(
        fit_gpt,
        world,
        Run(
            strategy=strategy,
            devices=world,
            steps=STEPS,
            seed=SEED,
            model=model,
            trainer=trainer or {},
        ),
    )[0]


@pytest.fixture(scope="module")
def baseline():
    cache = {}

    def get(strategy, world):
        key = (tuple(sorted(strategy.items())), world)
        if key not in cache:
            cache[key] = _run(strategy, world)
        return cache[key]

    return get


def _offload(device, tmp_path):
    extra = {"offload": device}
    if device == "nvme":
        extra.update(offload_path=str(tmp_path), offload_chunk_mb=0.01)
    return extra


# CI: each offload device at dp2 with ZeRO-1 or ZeRO-2 (the flat-bucket engine's slices), and
# NVMe under ZeRO-3 (FSDP2's shards); the rest of the matrix runs with -m slow.
FAST = [("nvme", 2, 1), ("nvme", 2, 3), ("cpu", 2, 2)]
SLOW = [
    (d, n, z) for d in ("cpu", "nvme") for n in (1, 2) for z in (1, 2, 3) if (d, n, z) not in FAST
]


def _case(device, data, stage, baseline, tmp_path):
    layout = {"zero_stage": stage}
    run = _run({**layout, **_offload(device, tmp_path)}, data)
    assert_same_run(run, baseline(layout, data), rtol=TIGHT, atol=TIGHT)
    if device == "nvme":  # only a bounded window of the state was ever in RAM
        rank = run["summary"]["ranks"][0]
        assert (
            rank["optimizer_state_bytes"]
            < baseline(layout, data)["summary"]["ranks"][0]["optimizer_state_bytes"]
        )
        assert list(tmp_path.iterdir()) == []  # the private state directory is gone


@pytest.mark.parametrize(
    "device, data, stage", FAST, ids=[f"{d}-data{n}-zero{z}" for d, n, z in FAST]
)
def test_offload_changes_nothing(device, data, stage, baseline, tmp_path):
    _case(device, data, stage, baseline, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "device, data, stage", SLOW, ids=[f"{d}-data{n}-zero{z}" for d, n, z in SLOW]
)
def test_offload_changes_nothing_full_matrix(device, data, stage, baseline, tmp_path):
    _case(device, data, stage, baseline, tmp_path)


def test_offload_keeps_global_norm_clipping(tmp_path):
    clip = {"gradient_clip_val": 0.05}  # always hit: a norm over one shard only would show
    run = _run({"zero_stage": 2, **_offload("nvme", tmp_path)}, 2, clip)
    assert_same_run(run, _run({"zero_stage": 2}, 2, clip), rtol=TIGHT, atol=TIGHT)


def test_zero3_parameter_offload_changes_nothing(baseline):
    """``offload_params``: FSDP2 keeps the sharded parameters in CPU memory (on this CPU-only
    machine the same memory, but through FSDP2's offload path), the offloaded Adam steps them
    in place. Same run as ZeRO 3 without offload."""
    layout = {"zero_stage": 3}
    run = _run({**layout, "offload": "cpu", "offload_params": True}, 2)
    assert_same_run(run, baseline(layout, 2), rtol=TIGHT, atol=TIGHT)
    for rank in run["summary"]["ranks"]:  # every sharded parameter was under the offload policy
        assert rank["offloaded_param_bytes"] == rank["param_bytes"] > 0
    assert all(
        rank["offloaded_param_bytes"] == 0 for rank in baseline(layout, 2)["summary"]["ranks"]
    )


@pytest.mark.parametrize(
    "strategy, world",
    [
        ({"zero_stage": 3, "ac_policy": "full"}, 2),
        pytest.param(
            {"pipeline": 2, "micro_batches": 2, "ac_policy": "every_n", "ac_every_n": 2},
            2,
            marks=pytest.mark.slow,
        ),
        pytest.param({"tensor": 2, "ac_policy": "selective"}, 2, marks=pytest.mark.slow),
    ],
    ids=["zero3-full", "pp2-every_n", "tp2-selective"],
)
def test_activation_checkpointing_changes_nothing(strategy, world):
    model = {"n_layer": 4, "dropout": 0.1}  # recomputed dropout must draw the same masks
    plain = {k: v for k, v in strategy.items() if k not in ("ac_policy", "ac_every_n")}
    assert_same_run(
        _run(strategy, world, model=model), _run(plain, world, model=model), rtol=TIGHT, atol=TIGHT
    )


def test_offload_delay_update_reaches_the_optimizer():
    """``offload_delay_update=True`` through the strategy: the first step is the same, the next
    forwards see weights one step old (so the losses part), and a plain layout refuses it. The
    delayed update's own numerics are tested in test_offload_delayed.py."""
    from lightning_3d import ThreeDStrategy

    with pytest.raises(ValueError, match="offload_delay_update=True needs offload"):
        ThreeDStrategy(offload_delay_update=True)
    plain, delayed = (
        _run({"offload": "cpu"}, 1),
        _run({"offload": "cpu", "offload_delay_update": True}, 1),
    )
    assert delayed["losses"][0] == pytest.approx(plain["losses"][0], rel=TIGHT)
    assert delayed["losses"][1] != pytest.approx(plain["losses"][1], rel=1e-4)
    # Finite: no NaN from a half-written weight.
    assert all(loss == loss for loss in delayed["losses"])
