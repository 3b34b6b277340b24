"""Run a function on N local processes that form one torch.distributed world.

Each process gets the environment a launcher such as ``torchrun`` would give it (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so code under test — a
Lightning ``Trainer`` included — sees an externally launched world and starts no processes of
its own. Processes are never forked from the caller (no inherited threads or process groups),
and always torn down, even when one fails or the run times out.

A spawned rank imports torch and Lightning again: ~4 s of CPU a rank, most of a small test's
time on a 2-core machine. With ``start_method="forkserver"`` (what the test suite sets, through
:data:`START_METHOD_ENV`), ranks are forked from a server process that imported :data:`PRELOAD`
once and has run nothing else (no threads, no process group); each rank then takes what a
spawned one would have from the caller as it is now: environment variables, working directory,
``sys.path``, and stdout / stderr (so ``capfd`` sees a rank's output), and runs the
interpreter's exit handlers when it is done, as a spawned rank's exit does (a forked process
leaves through ``os._exit``). What a module read from the environment when the server imported
it stays as it read it then: pass ``"spawn"`` for a rank that must start from nothing (the
benchmarks' memory readings do).

The rendezvous store is hosted by the calling process, as ``torchrun``'s agent hosts it
(:func:`lightning_3d.app.launch.hosted_store`): a ``TCPStore`` created on port 0, so the OS picks a
port that it keeps listening on until the world is torn down, and every rank, rank 0 included,
joins it as a client (``TORCHELASTIC_USE_AGENT_STORE=True``, which torch's ``env://`` rendezvous
reads). Choosing a free port first and letting rank 0 bind it later is racy: another program
can take the port in between, and concurrent worlds can be handed the same port, so that rank 0
fails with "address already in use" or ranks join another world's store. Here there is no such
window, so nothing needs retrying. As under ``torchrun``, the store outlives process groups:
initialize the default group once per world (one ``Trainer`` after another is fine; Lightning
keeps the group), not again after ``destroy_process_group``.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any, Optional

import torch.multiprocessing as mp

from lightning_3d.app.launch import hosted_store, local_rank_env, signal_name

START_METHOD_ENV = "LIGHTNING3D_WORLD_START"  # "spawn" (default) or "forkserver"
START_METHODS = ("spawn", "forkserver")
# What the fork server imports once for all the ranks it starts.
PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "tools.harness.runs")


def _context(start_method: Optional[str]) -> Any:
    method = start_method or os.environ.get(START_METHOD_ENV) or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts
    return ctx


class _CallerFd:
    """One of the caller's file descriptors, handed to a forked rank as it is now (its stdout and
    stderr: where a test's ``capfd`` reads them), not as the fork server inherited it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        # Pickled while the rank is being started: multiprocessing sends a duplicate along.
        return _CallerFd._received, (reduction.DupFd(self.fd),)

    @staticmethod
    def _received(dup: Any) -> _CallerFd:
        return _CallerFd(dup.detach())


@dataclass(frozen=True)
class _Caller:
    """What a forked rank takes from its caller: a spawned one inherits all of it."""

    environ: dict[str, str]
    cwd: str
    path: list[str]
    fds: tuple[tuple[int, _CallerFd], ...]  # (fd number in the rank, the caller's descriptor)

    @classmethod
    def now(cls) -> _Caller:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        return cls(
            dict(os.environ), os.getcwd(), list(sys.path), ((1, _CallerFd(1)), (2, _CallerFd(2)))
        )

    def adopt(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        for number, fd in self.fds:
            os.dup2(fd.fd, number)
            os.close(fd.fd)


def _entry(
    fn: Callable,
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    results: Any,
    caller: Optional[_Caller],
) -> None:
    if caller is not None:  # forked: the server's environment, directory and stdio until now
        caller.adopt()
    # A rank killed by SIGABRT / SIGSEGV (a corrupted heap: docs/testing.md) prints every
    # thread's Python stack to the caller's stderr first: which thread was where.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    os.environ.update(local_rank_env(rank, world_size, port, threads=1, agent_store=True))
    import torch

    torch.set_num_threads(1)  # 2 cores here: ranks must not fight over intra-op threads
    try:
        # Plain pickle bytes: torch.multiprocessing would share tensors by file descriptor,
        # which dies with this process before the parent reads it.
        results.put((rank, "ok", pickle.dumps(fn(rank, *args))))
    except BaseException:  # noqa: BLE001 - report everything, SystemExit included, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if caller is not None:
            # A forked process leaves through os._exit, past the interpreter's exit handlers;
            # run them as a spawned rank's exit would (the offload store removes its files there).
            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()


# Errors a rank sees only because another rank went away first: not the cause of a failure.
_SECONDARY = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Socket closed",
)
_GRACE_SECONDS = 15.0  # how long the other ranks get to report once one has failed
_POLL_SECONDS = 1.0  # how often a waiting caller checks that every unreported rank is still alive


def _is_secondary(report: str) -> bool:
    return any(marker in report for marker in _SECONDARY)


def _exit_note(process: Any) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    return f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}"


def _failure(errors: dict[int, str], procs: list[Any], outputs: dict[int, Any]) -> RuntimeError:
    """One message for a failed world: the rank whose error caused it first (an error that is not
    a lost connection), then every other rank's report, and how each silent rank ended."""
    parts = []
    if errors:
        first = min(errors, key=lambda r: (_is_secondary(errors[r]), r))
        parts.append(f"rank {first} failed:\n{errors[first]}")
        parts += [f"rank {r} also failed:\n{errors[r]}" for r in sorted(errors) if r != first]
    silent = [r for r in range(len(procs)) if r not in errors and r not in outputs]
    parts += [f"rank {r} reported nothing ({_exit_note(procs[r])})" for r in silent]
    return RuntimeError("\n".join(parts))


def _died_silently(procs: list[Any], errors: dict[int, str], outputs: dict[int, Any]) -> bool:
    """A rank's process has ended without reporting (killed, or exited before its ``try``)."""
    return any(
        p.exitcode is not None and r not in errors and r not in outputs for r, p in enumerate(procs)
    )


def _record(report: tuple[int, str, Any], errors: dict[int, str], outputs: dict[int, Any]) -> bool:
    """File one rank's report (a traceback, or its pickled result); whether it was an error."""
    rank, status, value = report
    if status == "error":
        errors[rank] = value
        return True
    outputs[rank] = pickle.loads(value)
    return False


def _drain(results: Any, errors: dict[int, str], outputs: dict[int, Any], procs: list[Any]) -> None:
    """Collect what the other ranks still report within the grace period, after one failed."""
    deadline = time.monotonic() + _GRACE_SECONDS
    while len(errors) + len(outputs) < len(procs) and time.monotonic() < deadline:
        try:
            _record(results.get(timeout=0.5), errors, outputs)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                return


def run_world(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 600.0,
    start_method: Optional[str] = None,
) -> list[Any]:
    """Call ``fn(rank, *args)`` on ``world_size`` processes; return the results in rank order.

    ``fn`` must be importable (a module-level function). Raises ``RuntimeError`` carrying the
    failing ranks' tracebacks, the root cause first (a rank whose peer died sees only a lost
    connection, and may report before the rank that died) and how each rank that reported nothing
    ended, as soon as one rank fails or dies; or ``TimeoutError`` when the world does not finish
    within ``timeout`` seconds. ``start_method``: ``"spawn"`` or ``"forkserver"`` (see the module's
    docstring); default: :data:`START_METHOD_ENV`, else ``"spawn"``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    ctx = _context(start_method)
    results = ctx.Queue()
    caller = _Caller.now() if ctx.get_start_method() == "forkserver" else None
    with hosted_store() as port:  # listens until the processes are gone
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, rank, world_size, port, args, results, caller),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            while len(outputs) < world_size:
                try:
                    report = results.get(
                        timeout=min(_POLL_SECONDS, max(0.0, deadline - time.monotonic()))
                    )
                except queue.Empty:
                    if _died_silently(procs, errors, outputs):  # its peers may wait on it for ever
                        # (or its report is still in the pipe).
                        _drain(results, errors, outputs, procs)
                        if errors or _died_silently(procs, errors, outputs):
                            raise _failure(errors, procs, outputs) from None
                    if time.monotonic() >= deadline:
                        waiting = [r for r in range(world_size) if r not in outputs]
                        raise TimeoutError(
                            f"world of {world_size} did not finish within {timeout}s "
                            f"(no result yet from ranks {waiting})"
                        ) from None
                    continue
                if _record(report, errors, outputs):
                    _drain(results, errors, outputs, procs)
                    raise _failure(errors, procs, outputs)
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    return [outputs[r] for r in range(world_size)]
