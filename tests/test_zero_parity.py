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


def _engine_slices(rank: int) -> dict:
    """Stage-2 gradient slices with gloo's reduce-scatter, with the all-to-all that replaces it,
    and the slices of the mean of every rank's full gradients."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.parallel.zero import ZeroDataParallel

    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("dp",))

    def model_and_loss():
        torch.manual_seed(0)  # the same weights on every rank
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        torch.manual_seed(10 + rank)  # a different batch per rank
        return model, lambda: model(torch.randn(4, 7)).square().sum()

    out = {}
    for all_to_all in (True, False):
        model, loss = model_and_loss()
        engine = ZeroDataParallel(mesh, stage=2, bucket_numel=20)  # 3 buckets, padded to multiples of 3
        engine._scatter_by_all_to_all = all_to_all
        engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        engine.prepare_backward(sync=True)
        loss().backward()
        engine.finish_backward()
        out[all_to_all] = [b.shard_grad.clone() for b in engine.buckets]
    plain, loss = model_and_loss()
    loss().backward()
    grad = dict(zip((id(p) for p in model.parameters()), (p.grad for p in plain.parameters())))
    out["expected"] = []
    for b in engine.buckets:
        full = torch.zeros_like(b.flat)
        for p, offset in zip(b.params, b.offsets):
            full[offset : offset + p.numel()] = grad[id(p)].reshape(-1)
        dist.all_reduce(full)
        out["expected"].append(full[rank * b.shard_numel : (rank + 1) * b.shard_numel] / 3)
    return out


@pytest.mark.slow  # the all-to-all path itself is in every CI parity run above
def test_gloo_all_to_all_reduce_scatter_equals_reduce_scatter():
    """On gloo the engine reduce-scatters by all-to-all + local sum (faster there); both ways give
    every rank the mean gradient of its own slice, padding included, at an odd world size."""
    import torch

    for rank_out in run_world(_engine_slices, 3):
        assert len(rank_out["expected"]) == 3
        for a, b, expected in zip(rank_out[True], rank_out[False], rank_out["expected"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(a, expected, rtol=1e-6, atol=1e-7)
