"""Pipeline parallelism inside Lightning's loop reproduces a single-process run (gloo worlds).

The reference GPT has 4 blocks here. Parity runs use momentum SGD without clipping, which (unlike
Adam) changes with the gradient's scale, so a wrong micro-batch or accumulation factor shows; a
separate run uses AdamW with an always-hit clip threshold, which shows a norm that is not global
across stages.
"""

import pytest

from lightning_3d.parallel.pipeline import stage_blocks, stage_ids
from lightning_3d.testing.parity import assert_same_run
from lightning_3d.testing.runs import fit_gpt
from lightning_3d.testing.world import run_world

STEPS, SEED = 5, 1234
SGD = {"n_layer": 4, "optimizer": "sgd", "lr": 0.3}
ADAM = {"n_layer": 4}
CLIP = {"gradient_clip_val": 0.05}


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(model, trainer):
        key = (tuple(sorted(model.items())), tuple(sorted(trainer.items())))
        if key not in cache:
            cache[key] = fit_gpt(0, None, 1, STEPS, SEED, model, None, trainer)
        return cache[key]

    return get


def _pipeline_run(strategy, world, model, trainer):
    runs = run_world(fit_gpt, world, strategy, world, STEPS, SEED, model, None, trainer)
    for rank in runs[1:]:  # every rank of every stage reports the same loss
        assert rank["losses"] == runs[0]["losses"]
    return runs[0]


CASES = {
    "gpipe": ({"pipeline": 2, "schedule": "gpipe", "micro_batches": 4}, 2),
    "1f1b": ({"pipeline": 2, "schedule": "1f1b", "micro_batches": 4}, 2),
    "interleaved_1f1b": ({"pipeline": 2, "schedule": "interleaved_1f1b", "micro_batches": 4}, 2),
    "zero_bubble": ({"pipeline": 2, "schedule": "zero_bubble", "micro_batches": 4}, 2),
    "pp4": ({"pipeline": 4, "micro_batches": 4}, 4),
    "pp2_dp2_zero1": ({"pipeline": 2, "data": 2, "zero_stage": 1, "micro_batches": 2}, 4),
    "pp2_dp2_zero3": ({"pipeline": 2, "data": 2, "zero_stage": 3, "micro_batches": 2}, 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_single_process(reference, case):
    strategy, world = CASES[case]
    run = _pipeline_run(strategy, world, SGD, {})
    assert run["summary"]["layout"]["pipeline"] == strategy["pipeline"]
    for rank in run["summary"]["ranks"]:  # measured idle share of each schedule step
        assert 0.0 <= rank["bubble_fraction"] < 1.0
    assert_same_run(run, reference(SGD, {}))


def test_pipeline_clips_by_the_norm_over_all_stages(reference):
    run = _pipeline_run({"pipeline": 2, "micro_batches": 4}, 2, ADAM, CLIP)
    assert_same_run(run, reference(ADAM, CLIP))


def test_micro_batches_times_accumulation(reference):
    """accumulate_grad_batches=2 with 2 micro-batches each: one optimizer step sees 2 Lightning
    batches of 2 micro-batches, the same as 2 accumulated batches in one process."""
    trainer = {"accumulate_grad_batches": 2}
    run = _pipeline_run({"pipeline": 2, "micro_batches": 2}, 2, SGD, trainer)
    assert_same_run(run, reference(SGD, trainer))


@pytest.mark.slow
def test_three_d_pipeline_x_data_x_tensor(reference):
    """pipeline 2 x data 2 x tensor 2 on 8 processes, ZeRO 1."""
    strategy = {"pipeline": 2, "data": 2, "tensor": 2, "zero_stage": 1, "micro_batches": 2}
    run = _pipeline_run(strategy, 8, SGD, {})
    assert_same_run(run, reference(SGD, {}))


def test_validation_runs_a_forward_only_schedule(reference):
    ref = fit_gpt(0, None, 1, 2, SEED, ADAM, None, {}, "gpt", True)["val"]
    runs = run_world(fit_gpt, 2, {"pipeline": 2, "micro_batches": 2}, 2, 2, SEED, ADAM, None, {}, "gpt", True)
    for rank in runs:
        assert rank["val"]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)


# ------------------------------------------------------------------ no processes
def test_uniform_split_by_block_count():
    assert [list(r) for r in stage_blocks(4, 2)] == [[0, 1], [2, 3]]
    assert [list(r) for r in stage_blocks(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in stage_blocks(10, 4)] == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="3 pipeline stages for 2 blocks"):
        stage_blocks(2, 3)


def test_looped_stage_placement():
    assert stage_ids(0, 2, 1) == [0] and stage_ids(1, 2, 1) == [1]
    assert stage_ids(0, 2, 2) == [0, 2] and stage_ids(1, 2, 2) == [1, 3]
    assert stage_ids(3, 4, 3) == [3, 7, 11]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"pipeline": 2, "schedule": "zigzag"}, "unknown pipeline schedule 'zigzag'"),
        ({"pipeline": 2, "micro_batches": 0}, "micro_batches=0"),
        ({"pipeline": 2, "schedule": "1f1b", "virtual_stages": 2}, "virtual_stages=2 needs an interleaved"),
        ({"pipeline": 2, "virtual_stages": 0, "schedule": "interleaved_1f1b"}, "virtual_stages=0"),
    ],
)
def test_bad_pipeline_options(options, message):
    from lightning_3d import ThreeDStrategy

    with pytest.raises(ValueError, match=message):
        ThreeDStrategy(**options)


def _bad_split(rank, strategy, model):
    try:
        fit_gpt(rank, strategy, 2, 1, SEED, model, None, {})
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "strategy, model, message",
    [
        ({"pipeline": 2, "micro_batches": 4, "schedule": "interleaved_1f1b"}, {"n_layer": 2},
         "4 pipeline stages for 2 blocks"),
        ({"pipeline": 2, "micro_batches": 3}, {"n_layer": 2}, "not divisible by micro_batches=3"),
    ],
    ids=["more_stages_than_blocks", "micro_batches_do_not_divide_batch"],
)
def test_bad_pipeline_layouts_are_refused(strategy, model, message):
    errors = run_world(_bad_split, 2, strategy, model)
    assert all(message in e for e in errors), errors
