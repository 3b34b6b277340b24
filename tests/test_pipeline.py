"""Pipeline parallelism inside Lightning's loop reproduces a single-process run (gloo worlds).

The reference GPT has 4 blocks here. Parity runs use momentum SGD without clipping, which (unlike
Adam) changes with the gradient's scale, so a wrong micro-batch or accumulation factor shows; a
separate run uses AdamW with an always-hit clip threshold, which shows a norm that is not global
across stages. Besides the gathered weights, every rank's own parameters (its stages', gathered
over tensor-parallel peers) are compared with the reference: under pipeline x data, the second
data-parallel replica of each stage is checked too. (The per-step loss is broadcast from the last
stage, so it is the same on every rank by construction and is not compared rank by rank.)
"""

import time

import pytest
import torch

from lightning_3d.parallel.stages import stage_blocks, stage_ids
from tools.harness.parity import assert_same_run, rank_state_mismatches
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks
from tools.harness.world import run_world

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
            cache[key] = fit_gpt(0, Run(steps=STEPS, seed=SEED, model=model, trainer=trainer))
        return cache[key]

    return get


def _pipeline_run(strategy, world, model, trainer):
    """Every rank's result (``rank_state``: the rank's own parameters)."""
    return run_world(
        fit_gpt_ranks,
        world,
        Run(strategy=strategy, devices=world, steps=STEPS, seed=SEED, model=model, trainer=trainer),
    )


def _assert_every_rank(runs, reference):
    """Rank 0's gathered weights and losses, then each rank's own parameters, and together the
    ranks hold every parameter of the model."""
    assert_same_run(runs[0], reference)
    assert rank_state_mismatches(runs, reference) == []
    assert set().union(*(r["rank_state"] for r in runs)) == set(reference["state"])


@pytest.fixture(scope="module")
def case_runs():
    """Each parity case's run, shared by the tests that look at it from different sides."""
    cache = {}

    def get(case):
        if case not in cache:
            strategy, world = CASES[case]
            cache[case] = _pipeline_run(strategy, world, SGD, {})
        return cache[case]

    return get


CASES = {
    "gpipe": ({"pipeline": 2, "schedule": "gpipe", "micro_batches": 4}, 2),
    "1f1b": ({"pipeline": 2, "schedule": "1f1b", "micro_batches": 4}, 2),
    "interleaved_1f1b": ({"pipeline": 2, "schedule": "interleaved_1f1b", "micro_batches": 4}, 2),
    "zero_bubble": ({"pipeline": 2, "schedule": "zero_bubble", "micro_batches": 4}, 2),
    "pp4": ({"pipeline": 4, "micro_batches": 4}, 4),
    "pp2_dp2_zero1": ({"pipeline": 2, "data": 2, "zero_stage": 1, "micro_batches": 2}, 4),
    "pp2_dp2_zero3": ({"pipeline": 2, "data": 2, "zero_stage": 3, "micro_batches": 2}, 4),
    # 1 block on the first stage, 3 on the second
    "explicit_split": ({"pipeline": 2, "micro_batches": 2, "split": ["model.blocks.1"]}, 2),
}
# Run with -m slow.
SLOW_CASES = {"balanced_split": ({"pipeline": 2, "micro_batches": 2, "split": "params"}, 2)}
CASES.update(SLOW_CASES)


# Wall-clock shares on a shared 2-core machine (4 ranks oversubscribe it) move by +-0.2 around a
# schedule's ideal bubble, so the parity runs only check that it is a fraction; the measurement
# itself is checked against a wait that cannot be mistaken for work (a sleeping last stage).
HEAD_DELAY_S = 0.1


def _fit_with_a_slow_head(rank, run):
    """``fit_gpt`` with the model's head sleeping ``HEAD_DELAY_S`` per call: only the last stage
    runs it, so the first waits on every micro-batch while using no CPU."""
    from lightning_3d.models.gpt import GPT

    head = GPT.head

    def slow_head(self, x):
        time.sleep(HEAD_DELAY_S)
        return head(self, x)

    GPT.head = slow_head  # this rank's process only
    return fit_gpt(rank, run)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES]
)
def test_pipeline_matches_single_process(reference, case_runs, case):
    """Catches: a wrong micro-batch or accumulation factor (SGD: weights scale with it), a
    data-parallel replica of a stage left stale (its own parameters are compared)."""
    strategy, world = CASES[case]
    runs = case_runs(case)
    assert runs[0]["summary"]["layout"]["pipeline"] == strategy["pipeline"]
    assert all(0.0 <= rank["bubble_fraction"] < 1.0 for rank in runs[0]["summary"]["ranks"])
    _assert_every_rank(runs, reference(SGD, {}))


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_bubble_counts_waiting_for_another_stage_as_idle(schedule):
    """Catches a bubble measurement that counts waiting as work, or the other stage's work as
    this one's. The last stage sleeps 0.1 s in each micro-batch's forward (m = 4): the first
    stage, whose own chunks take milliseconds, waits for at least 0.4 s of a step and must read
    mostly idle; the last stage, busy sleeping, must read less idle than the first."""
    strategy = {"pipeline": 2, "schedule": schedule, "micro_batches": 4}
    runs = run_world(
        _fit_with_a_slow_head, 2, Run(strategy=strategy, devices=2, steps=3, seed=SEED, model=SGD)
    )
    first, last = (rank["bubble_fraction"] for rank in runs[0]["summary"]["ranks"])
    assert first > 0.5, (first, last)
    assert last < first, (first, last)


def test_1f1b_holds_fewer_activations_than_gpipe(case_runs):
    """Measured in the runs: micro-batches between their forward and backward, and bytes of
    activations saved for backward, at their peak in a step (m = 4 micro-batches, p = 2)."""
    gpipe, one_f_one_b = (
        case_runs("gpipe")[0]["summary"]["ranks"],
        case_runs("1f1b")[0]["summary"]["ranks"],
    )
    assert [r["in_flight_peak"] for r in gpipe] == [4, 4]
    assert [r["in_flight_peak"] for r in one_f_one_b] == [2, 1]  # rank r: p - r
    for g, f in zip(gpipe, one_f_one_b):
        # Every micro-batch saves the same activations; 1F1B holds p - r micro-batches' worth, GPipe
        # m (within one micro-batch's worth: what is sent / received next is also alive).
        ratio = f["activation_peak_bytes"] / g["activation_peak_bytes"]
        assert ratio <= (f["in_flight_peak"] + 1) / g["in_flight_peak"]


def test_pipeline_clips_by_the_norm_over_all_stages(reference):
    runs = _pipeline_run({"pipeline": 2, "micro_batches": 4}, 2, ADAM, CLIP)
    _assert_every_rank(runs, reference(ADAM, CLIP))


def test_micro_batches_times_accumulation(reference):
    """accumulate_grad_batches=2 with 2 micro-batches each: one optimizer step sees 2 Lightning
    batches of 2 micro-batches, the same as 2 accumulated batches in one process."""
    trainer = {"accumulate_grad_batches": 2}
    runs = _pipeline_run({"pipeline": 2, "micro_batches": 2}, 2, SGD, trainer)
    _assert_every_rank(runs, reference(SGD, trainer))


@pytest.mark.slow
def test_three_d_pipeline_x_data_x_tensor(reference):
    """pipeline 2 x data 2 x tensor 2 on 8 processes, ZeRO 1."""
    strategy = {"pipeline": 2, "data": 2, "tensor": 2, "zero_stage": 1, "micro_batches": 2}
    runs = _pipeline_run(strategy, 8, SGD, {})
    _assert_every_rank(runs, reference(SGD, {}))


@pytest.fixture(scope="module")
def evaluated():
    cache = {}

    def get(model):
        key = tuple(sorted(model.items()))
        if key not in cache:
            cache[key] = fit_gpt(0, Run(steps=2, seed=SEED, model=model, validate=True))
        return cache[key]

    return get


@pytest.mark.parametrize(
    "strategy, world, model",
    [
        ({"pipeline": 2, "micro_batches": 2}, 2, ADAM),
        ({"pipeline": 2, "tensor": 2, "micro_batches": 2, "schedule": "interleaved_1f1b"}, 4, SGD),
    ],
    ids=["pp2", "pp2_tp2_interleaved"],
)
def test_validate_test_predict_run_forward_only_schedules(evaluated, strategy, world, model):
    """The module's own steps and metrics (val_loss/val_ppl, test_loss/test_ppl, predictions)
    equal one process's, on every rank; with tensor 2 the shared outputs are vocab-sharded.
    The 2 training steps before are compared too: with SGD under pipeline x tensor, CI's
    training parity of that layout (every rank's own, tensor-gathered parameters)."""
    runs = run_world(
        fit_gpt_ranks,
        world,
        Run(strategy=strategy, devices=world, steps=2, seed=SEED, model=model, validate=True),
    )
    evaluated = evaluated(model)
    if model is SGD:  # Adam's first steps amplify last-bit differences of near-zero gradients
        _assert_every_rank(runs, evaluated)
    for rank in runs:
        for split in ("val", "test"):
            assert rank[split].keys() == evaluated[split].keys()
            for key, value in evaluated[split].items():
                assert rank[split][key] == pytest.approx(value, rel=1e-5), (split, key)
        assert torch.equal(rank["predictions"], evaluated["predictions"])


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
        (
            {"pipeline": 2, "schedule": "1f1b", "virtual_stages": 2},
            "virtual_stages=2 needs an interleaved",
        ),
        ({"pipeline": 2, "virtual_stages": 0, "schedule": "interleaved_1f1b"}, "virtual_stages=0"),
    ],
)
def test_bad_pipeline_options(options, message):
    from lightning_3d import ThreeDStrategy

    with pytest.raises(ValueError, match=message):
        ThreeDStrategy(**options)


@pytest.mark.parametrize(
    "strategy",
    [
        {"pipeline": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2, "micro_batches": 3},
        {"pipeline": 2, "schedule": "1f1b", "micro_batches": 3},
    ],
    ids=["interleaved_5_blocks_on_4_stages", "1f1b_5_blocks_on_2_stages"],
)
def test_uneven_splits_and_three_micro_batches_match_single_process(reference, strategy):
    """Real runs' layouts: 5 blocks on 4 interleaved stages (2, 1, 1, 1) or on 2 (3, 2), and 3
    micro-batches of a 6-sample batch. Catches a stage that drops or repeats a block of an uneven
    split, and a micro-batch factor that assumes a power of two (SGD: weights scale with it)."""
    model, data = {**SGD, "n_layer": 5}, {"batch_size": 6}
    runs = run_world(
        fit_gpt_ranks,
        2,
        Run(strategy=strategy, devices=2, steps=3, seed=SEED, model=model, data=data),
    )
    one = fit_gpt(0, Run(steps=3, seed=SEED, model=model, data=data))
    _assert_every_rank(runs, one)


def _bad_split(rank, strategy, model):
    try:
        fit_gpt(rank, Run(strategy=strategy, devices=2, steps=1, seed=SEED, model=model))
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "strategy, model, message",
    [
        (
            {"pipeline": 2, "micro_batches": 4, "schedule": "interleaved_1f1b"},
            {"n_layer": 2},
            "4 pipeline stages for 2 blocks",
        ),
        ({"pipeline": 2, "micro_batches": 3}, {"n_layer": 2}, "not divisible by micro_batches=3"),
    ],
    ids=["more_stages_than_blocks", "micro_batches_do_not_divide_batch"],
)
def test_bad_pipeline_layouts_are_refused(strategy, model, message):
    errors = run_world(_bad_split, 2, strategy, model)
    assert all(message in e for e in errors), errors


# ------------------------------------------------------------------ stage splits (no processes)
def _meta_gpt(**kwargs):
    from lightning_3d.models import LitGPT

    with torch.device("meta"):
        return LitGPT(**{"n_layer": 6, "n_embd": 32, "n_head": 4, **kwargs})


def test_balanced_split_minimises_the_heaviest_stage():
    from lightning_3d.parallel.stages import balanced_blocks

    assert [list(r) for r in balanced_blocks([1, 1, 1, 1], 2)] == [[0, 1], [2, 3]]
    assert [list(r) for r in balanced_blocks([5, 1, 1, 1], 2)] == [[0], [1, 2, 3]]
    # A heavy head on the last stage pushes blocks to the first.
    assert [list(r) for r in balanced_blocks([1] * 6, 2, first_cost=0, last_cost=4)] == [
        [0, 1, 2, 3, 4],
        [5],
    ]
    assert [len(r) for r in balanced_blocks([2, 3, 1, 4, 2, 2], 3)] == [2, 2, 2]


def test_split_by_parameters_counts_embedding_and_head():
    from lightning_3d.parallel.stages import plan_stages

    # Embedding and head of 4096 x 32 each outweigh a block (12k).
    model = _meta_gpt(vocab_size=4096)
    runs = plan_stages(model, model.pipeline_spec(), 3, "params")
    assert [len(r) for r in runs] == [1, 4, 1]
    assert [len(r) for r in plan_stages(model, model.pipeline_spec(), 3, "uniform")] == [2, 2, 2]


def test_explicit_split_points():
    from lightning_3d.parallel.stages import plan_stages

    model = _meta_gpt()
    runs = plan_stages(model, model.pipeline_spec(), 3, ["model.blocks.1", "model.blocks.5"])
    assert [list(r) for r in runs] == [[0], [1, 2, 3, 4], [5]]


@pytest.mark.parametrize(
    "points, message",
    [
        (
            ["model.blocks.9"],
            "'model.blocks.9' names no module in the model; blocks are 'model.blocks'",
        ),
        (["model.lm_head"], "'model.lm_head' is not a block of 'model.blocks'"),
        (["model.blocks.0"], "must be increasing blocks after model.blocks.0"),
        (
            ["model.blocks.1", "model.blocks.2"],
            "2 split point(s) ['model.blocks.1', 'model.blocks.2'] for 2 pipeline",
        ),
    ],
)
def test_bad_split_points(points, message):
    from lightning_3d.parallel.stages import plan_stages

    model = _meta_gpt()
    with pytest.raises(ValueError, match=__import__("re").escape(message)):
        plan_stages(model, model.pipeline_spec(), 2, points)


@pytest.mark.parametrize(
    "split, message",
    [
        ("zigzag", "unknown pipeline split 'zigzag'"),
        (3, "pipeline split 3 must be one of"),
        (["model.blocks.1", "model.blocks.2"], "2 split point(s)"),
    ],
)
def test_bad_split_option_is_refused_by_the_strategy(split, message):
    from lightning_3d import ThreeDStrategy

    with pytest.raises(ValueError, match=__import__("re").escape(message)):
        ThreeDStrategy(pipeline=2, split=split)


def test_virtual_stages_split_the_blocks_unevenly():
    from lightning_3d.parallel.stages import plan_stages

    model = _meta_gpt()  # 6 blocks
    runs = plan_stages(model, model.pipeline_spec(), 4, "uniform", virtual=2)
    assert [len(r) for r in runs] == [2, 2, 1, 1]
    with pytest.raises(ValueError, match=r"8 pipeline stages for 6 blocks"):
        plan_stages(model, model.pipeline_spec(), 8, "uniform", virtual=4)
    assert [len(r) for r in plan_stages(model, model.pipeline_spec(), 4, "params", virtual=2)] == [
        1,
        2,
        2,
        1,
    ]
    assert [len(r) for r in plan_stages(model, model.pipeline_spec(), 3, "uniform", virtual=1)] == [
        2,
        2,
        2,
    ]


def test_tied_weights_across_stages_are_held_by_the_first_and_last_ranks():
    """A tie across stages is kept (one copy per holding rank, gradients summed: see
    tests/test_hf_models.py), so planning reports who holds it instead of refusing."""
    from lightning_3d.parallel.stages import tied_holders

    model = _meta_gpt()  # 6 blocks
    assert tied_holders(model, model.pipeline_spec(), 2, 1) == {}
    model.model.lm_head.weight = model.model.tok_emb.weight  # GPT-2-style tying
    assert tied_holders(model, model.pipeline_spec(), 2, 1) == {"model.tok_emb.weight": [0, 1]}
    # Interleaved: stage 0 on rank 0, the last stage (5) on rank 5 mod 3 = 2.
    assert tied_holders(model, model.pipeline_spec(), 3, 2, "params") == {
        "model.tok_emb.weight": [0, 2]
    }


def test_an_fp64_run_reports_fp64_losses(reference):
    """Under ``64-true`` the losses the strategy returns and the run summary records are fp64:
    a pipeline stage or the summary that rounds them to fp32 makes two fp64 runs that agree to
    1e-15 read as 1e-7 apart (the family matrix tells rounding from a wrong model in fp64)."""
    trainer = {"precision": "64-true"}
    one = reference(SGD, trainer)
    runs = run_world(
        fit_gpt,
        2,
        Run(
            strategy={"pipeline": 2}, devices=2, steps=STEPS, seed=SEED, model=SGD, trainer=trainer
        ),
    )
    for got, want in zip(runs[0]["losses"], one["losses"]):
        assert got == pytest.approx(want, rel=1e-12, abs=0.0)
    # Not fp32 values.
    assert any(float(torch.tensor(x, dtype=torch.float32)) != x for x in one["losses"])
