"""ZeRO 0-3 at data=2 and data=4 reproduce a single-process run (multi-process gloo worlds).

data=2 runs AdamW with a gradient-clipping threshold that is always hit, so a norm computed over
a local shard instead of globally would show. data=4 runs momentum SGD with gradient
accumulation and no clipping: SGD's update is proportional to the gradient, so a wrong scale (a
sum instead of the mean over ranks, a missing 1/k) shows in the weights, which Adam and an
always-hit clip threshold would both normalise away. (data=4 with AdamW, accumulation and
clipping runs with ``-m slow``.) Every run uses LitGPT's two param groups (decay / no decay) and
its warmup-cosine LR scheduler. Every rank's own weights are compared, not only rank 0's.
"""

import math

import pytest

from lightning_3d.observe.memory import zero_formula_bytes
from tools.harness.parity import assert_same_run, rank_state_mismatches
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks
from tools.harness.world import run_world

STEPS = 5
SEED = 1234
SGD = {"optimizer": "sgd", "lr": 0.3}
SETUPS = {  # name: (data, model options, trainer options)
    "dp2_adamw_clip": (2, None, {"gradient_clip_val": 0.05}),
    "dp4_sgd_accumulate": (4, SGD, {"accumulate_grad_batches": 2}),
    "dp4_adamw_accumulate_clip": (
        4,
        None,
        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    ),
}
FAST = ("dp2_adamw_clip", "dp4_sgd_accumulate")


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(setup: str, stage: int | None):
        key = (setup, stage)
        if key not in cache:
            data, model, trainer = SETUPS[setup]
            if stage is None:  # the single-process reference, Lightning's own strategy
                cache[key] = [fit_gpt(0, Run(steps=STEPS, seed=SEED, model=model, trainer=trainer))]
            else:
                run = Run(
                    strategy={"zero_stage": stage},
                    devices=data,
                    steps=STEPS,
                    seed=SEED,
                    model=model,
                    trainer=trainer,
                )
                cache[key] = run_world(fit_gpt_ranks, data, run)
        return cache[key]

    return get


def _setups(names=tuple(SETUPS)):
    return [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in names]


@pytest.mark.parametrize("setup", _setups())
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_matches_single_process(runs, setup, stage):
    """Catches (dp4_sgd_accumulate): stages 0-2 without the 1/N average of the reduced gradient.
    Catches (every setup): a rank whose weights were not updated with the others' slices (each
    rank's own copy is compared), a local clip norm (dp2), ranks fed the same samples."""
    reference = runs(setup, None)[0]
    world = runs(setup, stage)
    assert len(world[0]["losses"]) == STEPS
    assert_same_run(world[0], reference)
    assert rank_state_mismatches(world, reference) == []
    for step in range(STEPS):  # every rank's loss is the global batch's token mean
        local = [rank["local_losses"][step] for rank in world]
        assert all(math.isclose(x, reference["losses"][step], rel_tol=1e-5) for x in local)


@pytest.mark.parametrize("setup", _setups(FAST))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_memory_follows_the_paper(runs, setup, stage):
    """Per-rank bytes at the end of backward: params / grads / optimizer state as ZeRO predicts
    (Adam keeps 2 fp32 tensors per parameter, momentum SGD 1)."""
    data, model = SETUPS[setup][:2]
    adam = model is None
    world = runs(setup, stage)
    psi = world[0]["summary"]["num_params"]
    full = {
        "param_bytes": 4 * psi,
        "grad_bytes": 4 * psi,
        "optimizer_state_bytes": (8 if adam else 4) * psi,
    }
    sharded = {
        0: (),
        1: ("optimizer_state_bytes",),
        2: ("optimizer_state_bytes", "grad_bytes"),
        3: ("optimizer_state_bytes", "grad_bytes", "param_bytes"),
    }[stage]
    expected = {key: value / data if key in sharded else value for key, value in full.items()}
    for rank in world[0]["summary"]["ranks"]:
        for key, value in expected.items():
            assert math.isclose(rank[key], value, rel_tol=0.10), (key, rank[key], value)
        total = rank["param_bytes"] + rank["grad_bytes"] + rank["optimizer_state_bytes"]
        assert math.isclose(total, sum(expected.values()), rel_tol=0.10)
        if adam:
            assert math.isclose(total, zero_formula_bytes(psi, stage, data), rel_tol=0.10)
        assert rank["unsharded_param_bytes"] == (0 if stage == 3 else rank["param_bytes"])


def test_parity_check_detects_a_one_percent_learning_rate_change(runs):
    """The comparison used above is sharp enough to see a small real difference."""
    reference = runs("dp2_adamw_clip", None)[0]
    perturbed = fit_gpt(
        0,
        Run(steps=STEPS, seed=SEED, model={"lr": 3e-3 * 1.01}, trainer=SETUPS["dp2_adamw_clip"][2]),
    )
    with pytest.raises(AssertionError, match="relative error"):
        assert_same_run(perturbed, reference)


def _engine_slices(rank: int) -> dict:
    """Stage-1 and stage-2 gradient slices with the reduce-scatter collective (NCCL's path, forced
    on gloo), with the point-to-point exchange that replaces it on gloo, and the slices of the
    mean of every rank's full gradients."""
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
    for stage in (1, 2):
        for scatter in ("point_to_point", "reduce_scatter"):
            model, loss = model_and_loss()
            # 3 buckets, padded.
            engine = ZeroDataParallel(mesh, stage=stage, bucket_numel=20, scatter=scatter)
            assert engine._point_to_point == (scatter == "point_to_point")
            engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
            engine.prepare_backward(sync=True)
            loss().backward()
            engine.finish_backward()
            own = [b.shard_grad if stage == 2 else engine._own(b.grad, b) for b in engine.buckets]
            out[stage, scatter] = [g.clone() for g in own]
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


def test_both_reduce_scatter_paths_give_each_rank_the_mean_of_its_slice():
    """On gloo the engine reduce-scatters point to point + local sum (faster there); NCCL runs the
    reduce-scatter collective, forced here with ``scatter="reduce_scatter"``. Both ways give every
    rank the mean gradient of its own slice, padding included, at an odd world size, at stages 1
    and 2. Catches a reduce-scatter path that sums without the 1/N, or keeps another rank's slice."""
    import torch

    for rank_out in run_world(_engine_slices, 3):
        assert len(rank_out["expected"]) == 3
        for stage in (1, 2):
            for scatter in ("point_to_point", "reduce_scatter"):
                for got, expected in zip(rank_out[stage, scatter], rank_out["expected"]):
                    torch.testing.assert_close(
                        got, expected, rtol=1e-6, atol=1e-7, msg=f"{stage} {scatter}"
                    )


def test_unknown_scatter_mode_is_refused():
    from lightning_3d.parallel.zero import ZeroDataParallel

    with pytest.raises(ValueError, match="scatter must be one of .*'reduce_scatter'.*got 'ring'"):
        ZeroDataParallel(None, stage=1, scatter="ring")


def _gathered_after_step(rank: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.parallel.zero import ZeroDataParallel

    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("dp",))
    out = {}
    for scatter in ("point_to_point", "reduce_scatter"):
        for stage in (1, 2):
            torch.manual_seed(0)  # the same weights on every rank
            model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
            engine = ZeroDataParallel(mesh, stage=stage, bucket_numel=20, scatter=scatter)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            engine.attach(optimizer)
            torch.manual_seed(10 + rank)  # a different batch per rank
            engine.prepare_backward(sync=True)
            model(torch.randn(4, 7)).square().sum().backward()
            engine.finish_backward()
            optimizer.step()
            engine.after_step()
            out[scatter, stage] = [p.detach().clone() for p in model.parameters()]
    return out


def test_both_all_gather_paths_give_every_rank_every_stepped_slice():
    """After the step, ZeRO 1-2 gather each rank's stepped slice into every rank's parameters:
    on gloo by point-to-point exchanges received in place, elsewhere by the all-gather collective
    (forced here with ``scatter="reduce_scatter"``). Both give every rank the same parameters, at
    an odd world size with padded buckets cut through parameters. Catches a slice received into
    the wrong place, or a rank's own slice left out."""
    import torch

    results = run_world(_gathered_after_step, 3)
    for stage in (1, 2):
        for scatter in ("point_to_point", "reduce_scatter"):
            for rank_out in results:  # every rank holds exactly rank 0's parameters
                for got, expected in zip(rank_out[scatter, stage], results[0][scatter, stage]):
                    torch.testing.assert_close(got, expected, rtol=0, atol=0)
        # the two ways of summing the gradient rows differ in rounding only
        for got, expected in zip(
            results[0]["point_to_point", stage], results[0]["reduce_scatter", stage]
        ):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
