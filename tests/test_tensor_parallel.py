"""Tensor parallelism reproduces a single-process run, for every built-in plan (gloo worlds).

Each case trains 5 fp32 steps with a gradient-clipping threshold that is always hit (so the
global norm must count tensor-parallel shards once and replicated norms once) and compares
per-step losses and the gathered weights with Lightning's single-device run, then checks every
rank on its own: each tensor-parallel peer computes the whole loss itself (its local loss,
before any reduction over ranks, is the reference's), and each rank's own weights, gathered over
its mesh, are the reference's (a replicated parameter that one rank updates differently, e.g. a
sequence-parallel norm whose gradient is not summed over the sequence shards, shows there).
"""

import math

import pytest

from tools.harness.parity import assert_same_run, rank_state_mismatches
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks
from tools.harness.world import run_world

STEPS, SEED = 5, 1234
TRAINER = {"gradient_clip_val": 0.05}
# tensor=4 needs 4 k/v heads for the Llama-style model: 8 q heads share them (GQA).
MODEL = {("llama", 4): {"n_head": 8, "n_kv_head": 4}}


def _model(arch, tensor):
    return MODEL.get((arch, tensor), {})


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(arch, tensor):
        key = (arch, tensor)
        if key not in cache:
            model = _model(arch, tensor)
            cache[key] = fit_gpt(
                0, Run(steps=STEPS, seed=SEED, model=model, trainer=TRAINER, arch=arch)
            )
        return cache[key]

    return get


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tensor", [2, 4])
@pytest.mark.parametrize("arch", ["gpt", "llama", "gpt2"])
def test_tensor_parallel_matches_single_process(reference, arch, tensor, sequence_parallel):
    """Catches: sequence-parallel norms whose weight gradients are not reduced over the sequence
    shards (ranks' norm weights drift apart), a vocab-parallel loss that is one rank's part."""
    strategy = {"tensor": tensor, "sequence_parallel": sequence_parallel}
    run = Run(
        strategy=strategy,
        devices=tensor,
        steps=STEPS,
        seed=SEED,
        model=_model(arch, tensor),
        trainer=TRAINER,
        arch=arch,
    )
    world = run_world(fit_gpt_ranks, tensor, run)
    ref = reference(arch, tensor)
    assert world[0]["summary"]["layout"]["tensor"] == tensor
    assert_same_run(world[0], ref)
    for rank in world:  # each peer's own loss, before the reduction, is the whole batch's
        local = rank["local_losses"]
        assert len(local) == STEPS and all(
            math.isclose(a, b, rel_tol=1e-5) for a, b in zip(local, ref["losses"])
        ), local
    assert rank_state_mismatches(world, ref) == []


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_data_2_x_tensor_2_with_zero(reference, zero_stage):
    strategy = {"tensor": 2, "data": 2, "zero_stage": zero_stage}
    world = run_world(
        fit_gpt_ranks, 4, Run(strategy=strategy, devices=4, steps=STEPS, seed=SEED, trainer=TRAINER)
    )
    layout = world[0]["summary"]["layout"]
    assert (layout["data"], layout["tensor"], layout["zero_stage"]) == (2, 2, zero_stage)
    ref = reference("gpt", 2)
    assert_same_run(world[0], ref)
    assert rank_state_mismatches(world, ref) == []
    for rank in world:  # every rank's loss is the global batch's token mean
        assert all(
            math.isclose(a, b, rel_tol=1e-5) for a, b in zip(rank["local_losses"], ref["losses"])
        )


def test_tensor_parallel_memory_per_rank():
    """Split layers hold 1/tensor of their dense bytes per rank; logits hold vocab/tensor columns."""
    world = run_world(
        fit_gpt, 2, Run(strategy={"tensor": 2}, devices=2, steps=1, seed=SEED, trainer=TRAINER)
    )
    for rank in world[0]["summary"]["ranks"]:
        assert rank["tp_split_param_bytes"] > 0
        assert rank["tp_split_param_bytes"] * 2 == rank["tp_split_dense_bytes"]
        assert rank["logits_bytes"] > 0
        assert rank["logits_bytes"] * 2 == rank["logits_dense_bytes"]


def test_validation_metrics_match_single_process():
    """validate() under tensor=2 + sequence parallel: vocab-parallel loss, torchmetrics synced."""
    reference = fit_gpt(0, Run(steps=2, seed=SEED, trainer=TRAINER, validate=True))["val"]
    run = Run(
        strategy={"tensor": 2, "sequence_parallel": True},
        devices=2,
        steps=2,
        seed=SEED,
        trainer=TRAINER,
        validate=True,
    )
    world = run_world(fit_gpt, 2, run)
    for rank in world:
        assert set(rank["val"]) == {"val_loss", "val_ppl"}
        for key, value in reference.items():
            assert rank["val"][key] == pytest.approx(value, rel=1e-5), key
