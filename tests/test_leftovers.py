"""The suite's own guard (tests/conftest.py): each thing a test can leave behind is seen, and
undone so the tests after it are not failed by it. Broken variants caught (seen failing): the
group check, the variable check or the child check deleted from ``Leftovers.left_behind``."""

from __future__ import annotations

import os
import subprocess
import sys

import torch.distributed as dist

from lightning_3d.parallel.fake_world import _fake_store
from support.leftovers import Leftovers


def test_a_process_group_left_initialised_is_seen_and_destroyed():
    before = Leftovers.now()
    dist.init_process_group("fake", store=_fake_store(), rank=0, world_size=2)
    assert before.left_behind() == ["a default process group"]
    assert not dist.is_initialized()


def test_a_launcher_variable_left_set_is_seen_and_restored(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    before = Leftovers.now()
    os.environ["MASTER_PORT"] = "29512"
    assert before.left_behind() == ["MASTER_PORT='29512' (was None)"]
    assert "MASTER_PORT" not in os.environ


def test_a_child_still_running_is_seen_and_one_that_exits_is_not():
    before = Leftovers.now()
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert before.left_behind(grace_s=5.0) == [f"child processes {[slow.pid]} still running"]
    finally:
        slow.kill()
        slow.wait(), quick.wait()
    assert before.left_behind(grace_s=0.0) == []
    assert Leftovers.now().left_behind() == []
