"""NCCL's fail-fast settings (``lightning_3d/runtime/nccl_env.py``), on a fake environment: set
only under NCCL, only where torch's default is not already fail-fast, never over the user's
value; and the strategy sets them before its process group exists. No GPU needed."""

from __future__ import annotations

import pytest

from lightning_3d.runtime import nccl_env
from lightning_3d.runtime.nccl_env import (
    ASYNC_ERROR_HANDLING,
    ENABLE_MONITORING,
    HEARTBEAT_TIMEOUT,
    nccl_fail_fast,
)


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_a_short_timeout_brings_the_heartbeat_down_under_nccl(backend):
    """Catches: NCCL's monitor holding a rank whose watchdog thread hangs for torch's 8 minutes
    when the user asked collectives to fail after 30 s."""
    env: dict[str, str] = {}
    assert nccl_fail_fast(backend, 30.0, env) == []
    assert env == {HEARTBEAT_TIMEOUT: str(nccl_env.MIN_HEARTBEAT_S)}  # 30 s is under the floor
    env = {}
    nccl_fail_fast(backend, 120.5, env)
    assert env == {HEARTBEAT_TIMEOUT: "121"}


def test_torch_defaults_that_already_fail_fast_are_left_alone():
    """The default ``timeout_s`` (600 s) is above the 480 s heartbeat: nothing to set; and the
    error handling, blocking wait and monitoring are never set (torch's defaults tear down)."""
    env: dict[str, str] = {}
    assert nccl_fail_fast("nccl", 600.0, env) == [] and env == {}


@pytest.mark.parametrize("backend", ["gloo", None, "", "mpi"])
def test_other_backends_are_untouched(backend):
    env = {ASYNC_ERROR_HANDLING: "0"}
    assert nccl_fail_fast(backend, 5.0, env) == []
    assert env == {ASYNC_ERROR_HANDLING: "0"}


def test_the_users_values_are_kept_and_the_harmful_ones_named():
    env = {HEARTBEAT_TIMEOUT: "900", ASYNC_ERROR_HANDLING: "0", ENABLE_MONITORING: "0"}
    warnings = nccl_fail_fast("nccl", 30.0, env)
    assert env == {HEARTBEAT_TIMEOUT: "900", ASYNC_ERROR_HANDLING: "0", ENABLE_MONITORING: "0"}
    assert len(warnings) == 2
    assert warnings[0].startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING=0 leaves a rank")
    assert warnings[1].startswith("TORCH_NCCL_ENABLE_MONITORING=0: ")
    for fine in ("1", "3"):  # both tear the process down
        assert nccl_fail_fast("nccl", 30.0, {ASYNC_ERROR_HANDLING: fine}) == []


class _Stop(Exception):
    pass


def test_the_strategy_sets_them_before_the_process_group_exists(monkeypatch):
    """``setup_environment`` with ``process_group_backend="nccl"`` on the CPU, stopped where it
    would create the group: the heartbeat is already in the environment it is created from; with
    gloo the environment is as it was."""
    import lightning as L

    from lightning_3d import ThreeDStrategy
    from lightning_3d.strategy import three_d

    seen = {}

    def init(cluster_environment, backend, timeout, device_id):
        seen[backend] = nccl_env.os.environ.get(HEARTBEAT_TIMEOUT)
        raise _Stop

    monkeypatch.setattr(three_d, "_init_dist_connection", init)
    monkeypatch.delenv(HEARTBEAT_TIMEOUT, raising=False)
    for backend in ("gloo", "nccl"):
        strategy = ThreeDStrategy(process_group_backend=backend, timeout_s=90)
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
        with pytest.raises(_Stop):
            strategy.setup_environment()
    monkeypatch.delenv(HEARTBEAT_TIMEOUT, raising=False)  # set by the nccl call: undo it
    assert seen == {"gloo": None, "nccl": "90"}
