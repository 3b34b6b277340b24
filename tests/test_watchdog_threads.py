"""The watchdog's store calls from two threads at once (docs/testing.md, "Known intermittent
failure"): the watchdog's own thread beats while the training thread asks it which peers went
silent (``failure_line`` after a failed collective) or stops it. Each store call runs in a helper
thread (``Watchdog._bounded``); two callers used to share that helper's slot unguarded, so one
could join the other's thread before it had started ("cannot join thread before it is started",
raised in the training thread's error handling or ending the heartbeat thread) and two calls ran
on the one store connection at once."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from lightning_3d.runtime.watchdog import Watchdog


class OneCallAtATime:
    """A store that counts the calls that overlapped another one (from any thread)."""

    def __init__(self, store) -> None:
        self.store, self.inside, self.overlaps, self.calls = store, 0, 0, 0
        self._lock = threading.Lock()

    @contextmanager
    def _call(self):
        with self._lock:
            self.inside += 1
            self.calls += 1
            self.overlaps += self.inside > 1
        try:
            time.sleep(0.0005)  # widen the window a concurrent caller would fall into
            yield
        finally:
            with self._lock:
                self.inside -= 1

    def set(self, key, value):
        with self._call():
            return self.store.set(key, value)

    def get(self, key):
        with self._call():
            return self.store.get(key)

    def check(self, keys):
        with self._call():
            return self.store.check(keys)


def test_store_calls_from_the_training_thread_and_the_heartbeat_thread_never_overlap(
    monkeypatch,
):
    """Catches: ``_bounded`` run by two threads at once (a RuntimeError in either, or two calls
    on the one store connection at once)."""
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = OneCallAtATime(server.clone())
    store.store.set_timeout(timedelta(seconds=5))
    watchdog = Watchdog(store, 0, 2, timeout_s=60.0, exit=errors.append, launcher=None)
    watchdog.interval_s = 0.001  # beat as fast as it can
    watchdog.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and not errors:
            try:
                watchdog.silent_peers(wait_s=0.0)  # what failure_line asks, from this thread
            except RuntimeError as error:  # before the fix: the helper slot raced
                errors.append(error)
    finally:
        watchdog.stop()
    beats = int(server.get("lightning3d/heartbeat/0").split()[0])
    assert not errors, f"a store call raced: {errors[:3]!r}"
    assert store.overlaps == 0, f"{store.overlaps} of {store.calls} store calls overlapped another"
    assert beats > 10 and store.calls > 100  # both threads did call the store
    assert server.get("lightning3d/heartbeat/0").split()[-1] == b"done"  # stop's beat is the last


def _abort(rank: int) -> None:
    import os

    os.abort()  # as glibc does on a corrupted heap


def test_a_rank_killed_by_sigabrt_prints_the_stack_of_every_thread(capfd):
    """Catches: a rank that glibc aborts leaving nothing to read but "killed by SIGABRT" (the
    known intermittent failure needs to know which thread was where)."""
    import pytest

    from tools.harness.world import run_world

    with pytest.raises(RuntimeError, match="killed by SIGABRT"):
        run_world(_abort, 1, timeout=120)
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "in _abort" in err, err[-2000:]
