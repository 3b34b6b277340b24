"""Tensor parallelism reproduces a single-process run, for every built-in plan (gloo worlds).

Each case trains 5 fp32 steps with a gradient-clipping threshold that is always hit (so the
global norm must count tensor-parallel shards once and replicated norms once) and compares
per-step losses and the gathered weights with Lightning's single-device run.
"""

import pytest

from lightning_3d.testing.parity import assert_same_run
from lightning_3d.testing.runs import fit_gpt
from lightning_3d.testing.world import run_world

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
            cache[key] = fit_gpt(0, None, 1, STEPS, SEED, model, None, TRAINER, arch)
        return cache[key]

    return get


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tensor", [2, 4])
@pytest.mark.parametrize("arch", ["gpt", "llama", "gpt2"])
def test_tensor_parallel_matches_single_process(reference, arch, tensor, sequence_parallel):
    strategy = {"tensor": tensor, "sequence_parallel": sequence_parallel}
    world = run_world(fit_gpt, tensor, strategy, tensor, STEPS, SEED, _model(arch, tensor), None, TRAINER, arch)
    assert world[0]["summary"]["layout"]["tensor"] == tensor
    for rank in world[1:]:
        assert rank["losses"] == world[0]["losses"]
    assert_same_run(world[0], reference(arch, tensor))


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_data_2_x_tensor_2_with_zero(reference, zero_stage):
    strategy = {"tensor": 2, "data": 2, "zero_stage": zero_stage}
    world = run_world(fit_gpt, 4, strategy, 4, STEPS, SEED, None, None, TRAINER, "gpt")
    layout = world[0]["summary"]["layout"]
    assert (layout["data"], layout["tensor"], layout["zero_stage"]) == (2, 2, zero_stage)
    assert_same_run(world[0], reference("gpt", 2))


def test_tensor_parallel_memory_per_rank():
    """Split layers hold 1/tensor of their dense bytes per rank; logits hold vocab/tensor columns."""
    world = run_world(fit_gpt, 2, {"tensor": 2}, 2, 1, SEED, None, None, TRAINER, "gpt")
    for rank in world[0]["summary"]["ranks"]:
        assert rank["tp_split_param_bytes"] > 0
        assert rank["tp_split_param_bytes"] * 2 == rank["tp_split_dense_bytes"]
        assert rank["logits_bytes"] > 0
        assert rank["logits_bytes"] * 2 == rank["logits_dense_bytes"]


def test_validation_metrics_match_single_process():
    """validate() under tensor=2 + sequence parallel: vocab-parallel loss, torchmetrics synced."""
    reference = fit_gpt(0, None, 1, 2, SEED, None, None, TRAINER, "gpt", True)["val"]
    world = run_world(fit_gpt, 2, {"tensor": 2, "sequence_parallel": True}, 2, 2, SEED, None, None, TRAINER, "gpt", True)
    for rank in world:
        assert set(rank["val"]) == {"val_loss", "val_ppl"}
        for key, value in reference.items():
            assert rank["val"][key] == pytest.approx(value, rel=1e-5), key
