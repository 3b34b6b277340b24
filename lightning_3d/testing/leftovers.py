"""What a test may leave behind in the process that runs the suite, and how to tell.

A default process group left initialised makes the next test's fake world or ranks fail far
from the cause; a ``MASTER_PORT`` left in the environment sends the next world to a dead store;
a rank or app still running steals the two cores from every test after it. ``tests/conftest.py``
takes :meth:`Leftovers.now` before each test and fails the test with :meth:`Leftovers.left_behind`
after it, undoing what it can so the tests after it are not failed by it too.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

LAUNCHER_KEYS = ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def children(pid: Optional[int] = None) -> set[int]:
    """The live (not zombie) children of ``pid`` (this process), less those multiprocessing keeps
    on purpose: the fork server ranks are started from, and the resource tracker."""
    import multiprocessing.forkserver as forkserver
    import multiprocessing.resource_tracker as resource_tracker

    pid = os.getpid() if pid is None else pid
    kept = {
        getattr(forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
    }
    found: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(child) for child in f.read().split())
        except OSError:  # the thread ended meanwhile
            continue
    alive = set()
    for child in found - kept:
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":  # a zombie has exited
                    alive.add(child)
        except OSError:
            continue
    return alive


@dataclass(frozen=True)
class Leftovers:
    """The state of this process that a test must give back as it found it."""

    environ: tuple[tuple[str, Optional[str]], ...]
    children: frozenset[int]

    @classmethod
    def now(cls) -> Leftovers:
        return cls(
            tuple((key, os.environ.get(key)) for key in LAUNCHER_KEYS), frozenset(children())
        )

    def left_behind(self, grace_s: float = 10.0) -> list[str]:
        """What differs from then, each undone where it can be (the group destroyed, the
        variables restored); children get ``grace_s`` to exit (ranks torn down at a fixture's
        end take a moment). Empty when nothing was left."""
        import torch.distributed as dist

        problems = []
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            problems.append("a default process group")
        for key, value in self.environ:
            if os.environ.get(key) != value:
                problems.append(f"{key}={os.environ.get(key)!r} (was {value!r})")
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        deadline = time.monotonic() + grace_s
        left = children() - self.children
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = children() - self.children
        if left:
            problems.append(f"child processes {sorted(left)} still running")
        return problems
