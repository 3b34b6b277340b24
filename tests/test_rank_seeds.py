"""Ranks seeded differently still train the model of one process.

A script that seeds by rank (or not at all) builds different initial weights on every rank.
The strategy makes the first rank's weights everyone's: the ZeRO 0-2 engine broadcasts each
bucket from data-parallel rank 0; under tensor parallelism or ZeRO-3 the recipe broadcasts the
whole stage first (``replicas.broadcast_start``). Each layout below runs with
``Run(rank_seeds=True)`` (rank r builds its model under ``seed + r``) and is compared, losses
and every tensor's weights, with one process seeded like rank 0; every rank's own copy too.

Found by this test: ZeRO-3 trained each rank's shard of its own initialisation (first loss 5.570
against 5.552), and under tensor=2 the weights no plan entry splits (norms, position
embedding) started apart, which the replica guard stopped as a gradient mismatch. Broken
variants caught (seen failing): the bucket broadcast in ``parallel/zero.py`` deleted (ZeRO 0-2
fail), ``broadcast_start`` not called (ZeRO-3 and tp2 fail). Context ranks (cp2) hold the
same weights and get rank 0's through the ZeRO engines over data × context (seen failing with
the engines over the data axis alone).

Pipeline stages are left out on purpose: each stage's layers exist on one rank only, built
under that rank's seed, so a rank-seeded pipeline is a different (valid) model; seed every rank
alike, as ``seed_everything`` does, to compare it with one process.
"""

from __future__ import annotations

import pytest

from tools.harness.parity import assert_same_run, rank_state_mismatches
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks
from tools.harness.world import run_world

LAYOUTS = {
    "dp2_zero0": {"zero_stage": 0},
    "dp2_zero1": {"zero_stage": 1},
    "dp2_zero2": {"zero_stage": 2},
    "dp2_zero3": {"zero_stage": 3},
    "tp2": {"tensor": 2},
    "cp2_zero1": {"context": 2, "zero_stage": 1},  # context ranks hold the same weights
    "cp2_zero3": {"context": 2, "zero_stage": 3},
}


@pytest.fixture(scope="module")
def reference():
    return fit_gpt(0, Run(steps=4))


def test_ranks_build_different_weights_when_seeded_by_rank():
    runs = run_world(
        fit_gpt, 2, Run(strategy={"zero_stage": 1}, devices=2, steps=1, rank_seeds=True)
    )
    first, second = (run["initial_state"] for run in runs)
    assert any(not first[name].equal(second[name]) for name in first)  # the variation is real


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rank_zero_initial_weights_become_every_ranks(layout, reference):
    runs = run_world(
        fit_gpt_ranks, 2, Run(strategy=LAYOUTS[layout], devices=2, steps=4, rank_seeds=True)
    )
    assert_same_run(runs[0], reference, rtol=2e-5, atol=2e-5)
    assert rank_state_mismatches(runs, reference, rtol=2e-5, atol=2e-5) == []
