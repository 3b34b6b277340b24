"""ZeRO 1-2 for expert weights (``parallel/expert_zero.py``): at ep2 on 4 data ranks (two ranks
hold each expert), the experts' optimizer state (and at ZeRO-2 their gradients) is split over
the two ranks holding the same experts by a second flat-bucket engine, which reduce-scatters
their gradients over that replica group and divides by the data size.

Parity with one process (same losses, every tensor's update, every rank's copy of every weight)
under ZeRO-1 and ZeRO-2, with momentum SGD (an update proportional to the gradient: a wrong
scale shows) and AdamW (its state is what is sharded); a per-rank count of the experts'
optimizer state (1/G of the experts', not 1/ep); consolidated and sharded checkpoints saved at
ep2 x dp2 resume exactly at ep1 and at ep2 x dp2, under either stage.

Broken variants caught (each planted and reverted, seen failing): the experts' summed gradient
divided by the replica group's size instead of the data size (``zero.py``'s ``divide`` left at
its default: the parity cases, the HF one too); the replica-sum hook left on the bucketed
experts (reduced twice: the parity cases); no expert engine, the experts stepped whole as before
(the byte count); the expert engine's slices left out of the consolidated optimizer state (the
consolidated resume) or of the sharded one (the sharded resume). With AdamW alone a uniform
gradient scale nearly passes (the divide bug moved an expert update by 4e-4 of its size), so the
CI case uses momentum SGD.
"""

from __future__ import annotations

import dataclasses

import pytest

from tools.harness.parity import (
    loss_mismatches,
    rank_state_mismatches,
    update_mismatches,
    weight_mismatches,
)
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks
from tools.harness.world import run_world

SEED = 1234
STEPS = 3
MOE = {"lr": 0.3, "n_experts": 4, "top_k": 2, "shared_expert": True, "aux_loss_coef": 0.1}
OPTIMIZERS = {"sgd": {"optimizer": "sgd", "lr": 0.3}, "adamw": {"optimizer": "adamw", "lr": 3e-3}}


@pytest.fixture(scope="module")
def runs():
    cache: dict = {}

    def get(name: str, optimizer: str, stage: int = 1, trainer: tuple = ()) -> object:
        key = (name, optimizer, stage, trainer)
        if key not in cache:
            model = {**MOE, **OPTIMIZERS[optimizer]}
            base = Run(arch="moe", steps=STEPS, seed=SEED, model=model, trainer=dict(trainer))
            if name == "one":  # Lightning's own single device: the independent reference
                cache[key] = fit_gpt(0, base)
            elif name == "one_3d":  # one process under the strategy: losses recorded alike
                cache[key] = run_world(fit_gpt_ranks, 1, dataclasses.replace(base, strategy={}))[0]
            else:  # ep2 on 4 data ranks: replica groups of 2
                strategy = {"expert": 2, "zero_stage": stage}
                run = dataclasses.replace(base, strategy=strategy, devices=4, rank_seeds=True)
                cache[key] = run_world(fit_gpt_ranks, 4, run)
        return cache[key]

    return get


# Two micro-batches a step (ZeRO-1 reduces once after the last, ZeRO-2 after each) and a
# clipping threshold every step hits (the global norm counts each expert element once).
ACCUMULATE_CLIP = (("accumulate_grad_batches", 2), ("gradient_clip_val", 0.05))


@pytest.mark.parametrize(
    ("stage", "optimizer", "trainer"),
    [
        pytest.param(2, "sgd", (), id="zero2_sgd"),
        pytest.param(1, "sgd", (), id="zero1_sgd", marks=pytest.mark.slow),
        pytest.param(1, "adamw", (), id="zero1_adamw", marks=pytest.mark.slow),
        pytest.param(2, "adamw", (), id="zero2_adamw", marks=pytest.mark.slow),
        pytest.param(
            1, "sgd", ACCUMULATE_CLIP, id="zero1_sgd_accumulate_clip", marks=pytest.mark.slow
        ),
        pytest.param(
            2, "sgd", ACCUMULATE_CLIP, id="zero2_sgd_accumulate_clip", marks=pytest.mark.slow
        ),
    ],
)
def test_ep2_dp4_matches_one_process(runs, stage, optimizer, trainer):
    """ep=2 x 4 data ranks under ZeRO-``stage``: the one process's losses, every tensor's update
    and every rank's copy of every weight. Catches: the experts' gradient divided by the replica
    size (2) instead of the data size (4), or reduced twice (hook and engine)."""
    world = runs("ep2", optimizer, stage, trainer)
    one, one_3d = (
        runs("one", optimizer, trainer=trainer),
        runs("one_3d", optimizer, trainer=trainer),
    )
    problems = loss_mismatches(world[0]["losses"], one_3d["losses"])
    problems += update_mismatches(world[0]["state"], one["state"], one["initial_state"], 1e-4)
    problems += rank_state_mismatches(world, one)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    ("expert", "stage", "precision"),
    [
        pytest.param(2, 2, "bf16-true", id="ep2_zero2_bf16_masters"),
        pytest.param(2, 1, "32-true", id="ep2_zero1", marks=pytest.mark.slow),
        pytest.param(4, 2, "32-true", id="ep4_zero2_nothing_to_split", marks=pytest.mark.slow),
    ],
)
def test_expert_state_is_split_over_every_data_rank(expert, stage, precision):
    """Per rank, counted from the tensors before the second AdamW step on 4 data ranks: the
    experts' two moments take 8 bytes per element over ``G`` = 4 ranks (fp32 masters 4 more),
    not over ``ep`` = 2; ZeRO-2 holds a 1/G gradient shard (bf16 under ``bf16-true``), ZeRO-1 a
    full-size gradient of its ``ep`` slice. With ``expert`` = data there is no replica to split
    over: the experts are stepped whole (8 bytes per element over ``ep``) and have no engine."""
    from support.expert_bytes import fit_counting_expert_zero

    model = {**MOE, **OPTIMIZERS["adamw"]}
    run = Run(
        arch="moe",
        strategy={"expert": expert, "zero_stage": stage},
        devices=4,
        steps=2,
        seed=SEED,
        model=model,
        trainer={"precision": precision},
    )
    for counts in run_world(fit_counting_expert_zero, 4, run):
        elements = counts["elements"]
        assert elements == 2 * 4 * 2 * 32 * 128  # two layers' w_in and w_out of 4 experts
        if expert == 4:
            assert counts["replicas"] == 0 and counts["grads"] == 0
            assert counts["state"] == 8 * elements // 4
            continue
        assert counts["replicas"] == 2 and counts["bucketed"] == elements // 2
        assert counts["state"] == 8 * elements // 4
        grad_bytes = 2 if precision == "bf16-true" else 4
        shards = 4 if stage == 2 else 2
        assert counts["grads"] == grad_bytes * elements // shards
        assert counts["full_grad"] == (stage == 1)
        assert counts["masters"] == (4 * elements // 4 if precision == "bf16-true" else 0)


@pytest.fixture(scope="module")
def straight():
    """The uninterrupted 4-step ep2 x dp2 run at each ZeRO stage (shared by the resume cases)."""
    cache: dict = {}

    def get(stage: int) -> dict:
        if stage not in cache:
            cache[stage] = _fit(2, stage, 4)
        return cache[stage]

    return get


def _fit(expert: int, stage: int, steps: int, fmt: str = "consolidated", **kwargs) -> dict:
    strategy = {"expert": expert, "zero_stage": stage, "checkpoint_format": fmt}
    model = {**MOE, **OPTIMIZERS["sgd"]}
    run = Run(arch="moe", strategy=strategy, devices=4, steps=steps, seed=SEED, model=model)
    return run_world(fit_gpt, 4, dataclasses.replace(run, **kwargs))[0]


@pytest.mark.parametrize(
    ("fmt", "saved_stage", "resumed"),
    [
        pytest.param("consolidated", 2, (1, 1), id="consolidated_zero2_to_ep1_zero1"),
        pytest.param("sharded", 2, (2, 1), id="sharded_zero2_to_ep2_zero1"),
        pytest.param(
            "consolidated", 1, (2, 2), id="consolidated_zero1_to_ep2_zero2", marks=pytest.mark.slow
        ),
        pytest.param("sharded", 1, (1, 2), id="sharded_zero1_to_ep1_zero2", marks=pytest.mark.slow),
    ],
)
def test_checkpoint_at_ep2_dp2_resumes_exactly(tmp_path, straight, fmt, saved_stage, resumed):
    """2 momentum-SGD steps at ep2 x dp2 (4 ranks) under ZeRO-``saved_stage``, saved in ``fmt``;
    2 more at ``resumed`` (expert, zero_stage): the uninterrupted run's losses and weights.
    Catches: the expert engine's slices (their momentum) left out of the saved optimizer state,
    or not loaded back into them (the momentum restarts at zero)."""
    first = _fit(2, saved_stage, 2, fmt, save_to=str(tmp_path / "run.ckpt"), save_every_n_steps=1)
    path = tmp_path / "run-step=2.ckpt"
    assert path.is_dir() == (fmt == "sharded")
    second = _fit(*resumed, 4, fmt, resume_from=str(path))
    whole = straight(saved_stage)
    problems = loss_mismatches(first["losses"] + second["losses"], whole["losses"])
    problems += weight_mismatches(second["state"], whole["state"], 1e-5, 1e-6)
    assert problems == [], "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_hf_qwen3_moe_ep2_dp4_matches_one_process(stage):
    """A tiny random Qwen3-MoE (its experts found by the family's ep plan, ``expert_hf.py``) at
    ep=2 on 4 data ranks under ZeRO-``stage``, momentum SGD: one process's losses, every
    tensor's update and every rank's copy, with the experts bucketed over their replica pairs."""
    pytest.importorskip("transformers")
    from tools.harness.hf_configs import tiny_config

    def run(strategy, world):
        model = {**OPTIMIZERS["sgd"], "hf": tiny_config("qwen3_moe")}
        return Run(
            arch="hf",
            strategy=strategy,
            devices=world,
            steps=STEPS,
            seed=SEED,
            model=model,
            rank_seeds=strategy is not None,
        )

    one = fit_gpt(0, run(None, 1))
    ranks = run_world(fit_gpt_ranks, 4, run({"expert": 2, "zero_stage": stage}, 4))
    problems = loss_mismatches(ranks[0]["losses"], one["losses"], 1e-5)
    problems += update_mismatches(ranks[0]["state"], one["state"], one["initial_state"], 1e-4)
    problems += rank_state_mismatches(ranks, one, 1e-5)
    assert problems == [], "\n".join(problems)
