"""Sharded checkpoints (``torch.distributed.checkpoint``) of expert-parallel runs under ZeRO 1-2,
whose expert weights sit in no ZeRO slice: their optimizer state is saved whole (``DTensor`` s
sharded on ``ep``) beside the slices' pieces, under one process's names, so a save at ep2 resumes
under another expert size and ZeRO stage exactly.

Broken variant caught (planted and reverted, seen failing): the set-aside parameters left out
of the sharded optimizer state (the expert momentum restarts at zero after the resume).
"""

from __future__ import annotations

import dataclasses

import pytest

from tools.harness.parity import loss_mismatches, weight_mismatches
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

SEED = 1234
MOE = {"n_experts": 4, "top_k": 2, "aux_loss_coef": 0.1, "optimizer": "sgd", "lr": 0.3}


def _fit(tmp_path, expert: int, stage: int, steps: int, **kwargs) -> dict:
    strategy = {"expert": expert, "zero_stage": stage, "checkpoint_format": "sharded"}
    run = Run(arch="moe", strategy=strategy, devices=2, steps=steps, seed=SEED, model=MOE)
    return run_world(fit_gpt, 2, dataclasses.replace(run, **kwargs))[0]


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        pytest.param((2, 1), (1, 2), id="ep2_zero1_to_ep1_zero2"),
        pytest.param((2, 2), (2, 1), id="ep2_zero2_to_ep2_zero1", marks=pytest.mark.slow),
    ],
)
def test_sharded_checkpoint_at_ep2_resumes_exactly(tmp_path, saved, resumed):
    """2 steps at ``saved`` (expert, zero_stage), saved sharded, 2 more at ``resumed``: the
    uninterrupted run's losses and weights (momentum SGD: a lost expert momentum shows)."""
    straight = _fit(tmp_path, *saved, 4)
    first = _fit(tmp_path, *saved, 2, save_to=str(tmp_path / "run.ckpt"), save_every_n_steps=1)
    path = tmp_path / "run-step=2.ckpt"
    assert path.is_dir()  # a sharded checkpoint: a directory
    second = _fit(tmp_path, *resumed, 4, resume_from=str(path))
    problems = loss_mismatches(first["losses"] + second["losses"], straight["losses"])
    problems += weight_mismatches(second["state"], straight["state"], 1e-5, 1e-6)
    assert problems == [], "\n".join(problems)
