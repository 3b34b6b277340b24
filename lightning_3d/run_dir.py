"""A run directory belongs to one run at a time, and a finished run in it is not overwritten.

The apps write ``summary.json``, ``last.ckpt`` / ``preempted.ckpt`` and ``final.ckpt`` into their
run directory. Hydra gives each run a new one by default, but an explicit ``hydra.run.dir`` may
name a directory that another run is writing, or that holds an earlier run: two runs given the
same directory used to both exit 0 with one ``summary.json`` left and the earlier
``final.ckpt`` overwritten. Now the launching process (:func:`hold`):

- takes ``<run dir>/.lightning_3d.lock`` (created exclusively, holding its pid, host and start
  time) for the whole run; a directory whose lock is held by a live process is refused, naming
  it; a lock left by a process that is gone (same host) is taken over, with a message;
- refuses a directory that holds an earlier run's files unless the run resumes
  (``resume=``) or is told to replace them (``overwrite=true``);
- removes the temporary checkpoint directories of saves killed part-way (``.last.ckpt.tmp-<pid>``
  of processes that are gone), as the next save into that directory would.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LOCK = ".lightning_3d.lock"
RUN_FILES = ("final.ckpt", "last.ckpt", "preempted.ckpt", "summary.json")  # what a run leaves


class RunDirInUse(ValueError):
    """The run directory is another run's, live or finished (the message says which and what to do)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _holder(lock: Path) -> dict[str, Any]:
    try:
        holder = json.loads(lock.read_text())
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}  # half-written or unreadable: see the caller


def _take(lock: Path) -> bool:
    """Create ``lock`` exclusively with this process as its holder; ``False`` if it exists."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            f,
        )
    return True


def acquire(run_dir: Path) -> None:
    """Take ``run_dir``'s lock (see the module docstring); :class:`RunDirInUse` if a live run holds it."""
    lock = run_dir / LOCK
    for _ in range(2):  # a stale lock: removed, then taken like a fresh one
        if _take(lock):
            return
        holder = _holder(lock)
        pid, host = holder.get("pid"), holder.get("host")
        if host != socket.gethostname() or not isinstance(pid, int):
            raise RunDirInUse(
                f"{run_dir} is in use by another run ({LOCK}: pid {pid} on host {host}, since "
                f"{holder.get('since')}); give this run another hydra.run.dir, or delete the lock if "
                "you know that run has ended"
            )
        if _alive(pid):
            raise RunDirInUse(
                f"{run_dir} is in use by another run (pid {pid}, since {holder.get('since')}); give "
                "this run another hydra.run.dir, or wait for that one to end"
            )
        print(
            f"lightning_3d: {run_dir}: took over the lock of pid {pid}, which is no longer running",
            file=sys.stderr,
            flush=True,
        )
        lock.unlink(missing_ok=True)
    raise RunDirInUse(
        f"{run_dir}: another run took its lock at the same moment; give this run another "
        "hydra.run.dir"
    )


def release(run_dir: Path) -> None:
    """Remove ``run_dir``'s lock if this process holds it."""
    lock = run_dir / LOCK
    if _holder(lock).get("pid") == os.getpid():
        lock.unlink(missing_ok=True)


def check_earlier_run(run_dir: Path, resuming: bool, overwrite: bool) -> None:
    """:class:`RunDirInUse` if ``run_dir`` holds an earlier run's files and this run neither resumes
    nor may overwrite them."""
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if found and not resuming and not overwrite:
        resumable = next((n for n in ("last.ckpt", "preempted.ckpt") if n in found), None)
        hint = f"resume it with resume={run_dir / resumable}, " if resumable else ""
        raise RunDirInUse(
            f"{run_dir} holds an earlier run ({', '.join(found)}): {hint}give this run another "
            "hydra.run.dir, or pass overwrite=true to replace it"
        )


@contextmanager
def hold(run_dir: Path, resuming: bool = False, overwrite: bool = False) -> Iterator[None]:
    """The run directory for this run alone while the body runs (see the module docstring)."""
    from lightning_3d.checkpoint.files import remove_stale_temps

    run_dir.mkdir(parents=True, exist_ok=True)
    acquire(run_dir)
    try:
        check_earlier_run(run_dir, resuming, overwrite)
        remove_stale_temps(run_dir)
        yield
    finally:
        release(run_dir)
