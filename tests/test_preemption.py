"""SIGTERM / SIGINT to any rank, as a scheduler preempting a job: every rank stops within one
step (no collective left hanging), a checkpoint is saved together, the run ends with an error
(not a silent success), and resuming from that checkpoint continues exactly."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from support.faults import fit_until_killed
from tools.harness.world import run_world

STEPS, STOP_AT = 4, 2


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_world(fit_until_killed, 2, str(tmp_path_factory.mktemp("full")), STEPS, None)


@pytest.mark.parametrize(
    "signum,victim",
    [
        (signal.SIGTERM, 1),
        pytest.param(signal.SIGINT, 0, marks=pytest.mark.slow),
    ],
    ids=["sigterm_rank1", "sigint_rank0"],
)
def test_a_signal_to_one_rank_stops_every_rank_with_a_checkpoint_that_resumes(
    tmp_path, uninterrupted, signum, victim
):
    root = str(tmp_path)
    start = time.monotonic()
    stopped = run_world(fit_until_killed, 2, root, STEPS, STOP_AT, victim, 30.0, False, signum)
    assert time.monotonic() - start < 120  # not the collective timeout of a hung peer
    name = signal.Signals(signum).name
    for rank, out in enumerate(stopped):
        assert out["global_step"] == STOP_AT, out
        assert name in out["preempted"] and "preempted.ckpt" in out["preempted"], out
        assert ("received here" in out["preempted"]) == (rank == victim), out["preempted"]
    checkpoint = tmp_path / "preempted.ckpt"
    assert torch.load(checkpoint, map_location="cpu", weights_only=False)["global_step"] == STOP_AT
    resumed = run_world(fit_until_killed, 2, root, STEPS, None, victim, 30.0, str(checkpoint))
    for out, full in zip(resumed, uninterrupted):
        assert out["global_step"] == STEPS
        assert out["losses"] == pytest.approx(full["losses"][STOP_AT:], rel=1e-6)


def test_a_one_process_run_stops_on_sigterm_with_a_checkpoint(tmp_path):
    (out,) = run_world(
        fit_until_killed, 1, str(tmp_path), STEPS, STOP_AT, 0, 30.0, False, signal.SIGTERM, 1
    )
    assert out["global_step"] == STOP_AT and "SIGTERM received here" in out["preempted"]
    assert (tmp_path / "preempted.ckpt").is_file()
