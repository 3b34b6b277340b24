"""Start the ranks of one Hydra job on this machine, for single runs and ``-m`` sweeps alike.

Lightning's own launcher re-runs ``sys.argv``, which under ``-m`` would make every child run the
whole sweep. Here the parent re-runs the app as it was started (:func:`rank_command`: ``python -m
lightning_3d.app.train``, ``python examples/train.py``, a console script) with the current job's
overrides only, in the
job's output directory, with the environment ``torchrun`` would set (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); Lightning then sees an externally launched
world. Transport is torch.distributed's; this only starts and watches processes.

No rank outlives the launcher, and what a rank could not clean up is cleaned here:

* SIGTERM / SIGINT / SIGHUP to the launcher (a scheduler's preemption, Ctrl-C, a closed
  terminal) are forwarded to every rank, which stop together at the end of the step with a
  checkpoint (:class:`~lightning_3d.runtime.preemption.StopOnSignal`); ranks still running
  :data:`GRACE_S` later (a fixed bound: schedulers kill outright after their own grace period,
  30 s by default for SLURM and Kubernetes, so a longer one would rarely be used), or at a second
  signal, are killed. The launcher then exits with ``128 + signal``, never 0. The ranks run in a
  session of their own, so a terminal's Ctrl-C reaches them once, through the launcher.
* When a rank fails, the others get :data:`FAILURE_GRACE_S` to fail by themselves (a lost peer
  fails their collectives at once) and say why, then SIGTERM (and SIGCONT, should one be
  stopped) and as long again to exit, removing their own files, before they are killed; a rank
  killed by a signal is named, as it could not say anything itself.
* Afterwards the NVMe offload directories of its ranks (named after their pids, in the paths
  the ranks recorded in the store: :func:`lightning_3d.runtime.watchdog.record_offload_path`) are
  removed: a SIGKILLed rank leaves its own behind.
* Should the launcher itself be killed outright, each rank's watchdog notices (its parent
  changed) and stops the rank as if it had been sent SIGTERM (:mod:`lightning_3d.runtime.watchdog`).

The rendezvous store is hosted here, in the launching process, as ``torchrun``'s agent hosts it
(:func:`hosted_store`): its port is one the OS assigned to a socket that listens for the whole
job, so it cannot be taken by another program, or shared with another job, between being chosen
and being used. The ranks connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what a scheduler or a terminal sends
GRACE_S = 60.0  # after forwarding a signal: time for the ranks to finish the step and save
# After a rank failed: for the others to exit by themselves, then again after SIGTERM.
FAILURE_GRACE_S = 5.0
POLL_S = 0.2


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now.

    Racy by nature: the port is free again when this returns, so another program, or another
    call of this function, can take it before the caller binds it. To start a world, use
    :func:`hosted_store` instead.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def hosted_store() -> Iterator[int]:
    """Host a world's rendezvous ``TCPStore`` in this process while the block runs; yield its port.

    The store listens on a port the OS picks (port 0) from before its number is known until the
    block exits, so no other program or world can hold or reuse it meanwhile. Give the ranks
    ``local_rank_env(..., port, ..., agent_store=True)``: torch's ``env://`` rendezvous then makes
    every rank, rank 0 included, a client of this store, as under ``torchrun``. Like ``torchrun``'s
    store it outlives process groups, so a rank initializes the default group once per world.
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store  # the last reference: the server stops and the port is released


def local_rank_env(
    rank: int, world_size: int, port: int, threads: int, agent_store: bool = False
) -> dict[str, str]:
    """The variables ``torchrun`` sets for one rank of a single-node world.

    ``agent_store``: the store on ``port`` is up already (:func:`hosted_store`), and rank 0 joins
    it as a client; otherwise rank 0 starts it on ``port``.
    """
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
        "GROUP_RANK": "0",
        "OMP_NUM_THREADS": str(threads),
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),  # read by torch's env:// rendezvous
    }


def quoted(value: str) -> str:
    """``value`` as a quoted Hydra override value, so that a ``,`` (a sweep), ``=``, a space or
    a bracket in it reach the ranks as they are. ``ValueError`` for a value holding both kinds
    of quote, or a backslash before one (Hydra's grammar would change it)."""
    quote = "'" if "'" not in value else '"'
    if quote in value or "\\'" in value or '\\"' in value or value.endswith("\\"):
        raise ValueError(
            f"hydra.run.dir={value!r}: a path holding both ' and \", or a backslash "
            "before a quote, cannot be handed to the ranks; give another run dir"
        )
    return f"{quote}{value}{quote}"


def rank_command() -> list[str]:
    """The command that starts one rank of this app: as this process was started, with this
    interpreter — ``python -m NAME`` for a module run with ``-m`` (its ranks import it the same
    way, not as a file whose folder would shadow top-level modules), else ``python SCRIPT`` (an
    example, or a console script, which is a Python script too)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return [sys.executable, "-m", spec.name.removesuffix(".__main__")]
    return [sys.executable, os.path.abspath(sys.argv[0])]


def typed_command() -> list[str]:
    """This process's app as a user types it: ``python -m lightning_3d.app.train``, a console
    script's name where ``PATH`` finds it (``lightning3d-train``), else ``python SCRIPT``
    (``examples/train.py``, relative where it lies under the working directory)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return ["python", "-m", spec.name.removesuffix(".__main__")]
    script = sys.argv[0]
    name = os.path.basename(script)
    found = shutil.which(name)
    if (
        not name.endswith(".py")
        and found
        and os.path.exists(script)
        and os.path.samefile(found, script)
    ):
        return [name]
    if os.path.isabs(script) and not os.path.relpath(script).startswith(".."):
        script = os.path.relpath(script)
    return ["python", script]


def resume_override(path: Path) -> str:
    """``resume=<path>`` as a Hydra command-line override, quoted so that spaces, ``=`` and ``,``
    parse (Hydra's quoted strings escape only quotes)."""
    quoted = str(path).replace("'", "\\'")
    return f"resume='{quoted}'"


def already_launched() -> bool:
    """True inside a rank started by us, torchrun, SLURM or any launcher that sets ``LOCAL_RANK``."""
    return "LOCAL_RANK" in os.environ or "SLURM_PROCID" in os.environ


def launch_job(
    world_size: int,
    command: Sequence[str],
    overrides: list[str],
    output_dir: str,
    threads: int,
    grace_s: float = GRACE_S,
) -> int:
    """Run ``command`` (``[python, script]``, see :func:`rank_command`) with ``overrides`` on
    ``world_size`` local ranks; return the worst exit code
    (``128 + n`` for a rank killed by signal ``n``, or for this launcher signalled with ``n``).

    SIGTERM / SIGINT / SIGHUP to the launcher are forwarded to every rank (SIGHUP as SIGTERM), so
    they stop together with a checkpoint (:class:`~lightning_3d.runtime.preemption.StopOnSignal`); ranks
    still running ``grace_s`` later, or at a second signal, are killed. When a rank fails, the
    others get :data:`FAILURE_GRACE_S` to exit, then SIGTERM and as long again before they are
    killed. No rank outlives this call, and the NVMe offload directories of its ranks are
    removed afterwards.
    """
    if not grace_s >= 0:
        raise ValueError(f"grace_s must be a number of seconds >= 0, got {grace_s!r}")
    with hosted_store() as port:
        return _run_ranks(world_size, command, overrides, output_dir, threads, port, grace_s)


def _run_ranks(
    world_size: int,
    command: Sequence[str],
    overrides: list[str],
    output_dir: str,
    threads: int,
    port: int,
    grace_s: float = GRACE_S,
) -> int:
    from torch.distributed import TCPStore

    from lightning_3d.runtime.watchdog import LAUNCHER_PID_ENV, STORE_TIMEOUT

    # What the ranks record.
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
    received: list[int] = []
    previous = {}
    # Only the main thread is where Python lets signals be handled.
    if threading.current_thread() is threading.main_thread():
        previous = {
            signum: signal.signal(signum, lambda signum, _: received.append(signum))
            for signum in FORWARDED
        }
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world_size):
            env = {
                **os.environ,
                **local_rank_env(rank, world_size, port, threads, agent_store=True),
                LAUNCHER_PID_ENV: str(os.getpid()),
            }  # its watchdog stops the rank should this process die
            argv = [
                *command,
                *overrides,
                f"hydra.run.dir={quoted(output_dir)}",
                "hydra.output_subdir=null",
                f"hydra.job.name=rank{rank}",
            ]
            # A session of their own: Ctrl-C in a terminal reaches the launcher only, which
            # forwards it once (a second SIGINT would interrupt a rank before it saves).
            procs.append(subprocess.Popen(argv, env=env, start_new_session=True))
        pids = [p.pid for p in procs]
        return _watch(
            procs,
            received,
            grace_s,
            lambda code, codes, signalled: _reported(
                store, output_dir, code, codes, signalled, pids
            ),
        )
    finally:
        _end(procs, signal.SIGKILL, 0.0)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _remove_offload_dirs(store, world_size, [p.pid for p in procs])


def _watch(
    procs: list[subprocess.Popen],
    received: list[int],
    grace_s: float,
    reported: Callable[[int, list, set], int] = lambda code, codes, signalled: code,
) -> int:
    """Wait for the ranks; stop them all when one fails or this process is signalled. Once they
    have all ended after a failure, ``reported(code, codes, signalled)`` (the first failed
    rank's exit code, ``128 + n`` for signal ``n``; every rank's return code; the ranks this
    launcher had to signal) says what failed and returns the exit code."""
    while True:
        if received:
            signum = received[0]
            forwarded = signal.SIGTERM if signum == signal.SIGHUP else signum
            print(
                f"lightning_3d: launcher: {signal.Signals(signum).name} received; forwarded to every rank, "
                f"which stop at the end of their step with a checkpoint (killed after {grace_s:g} s)",
                file=sys.stderr,
                flush=True,
            )
            # Only the first signal is acted on here: a second one already received (a double
            # Ctrl-C faster than this loop polls) ends the grace at once.
            _end(procs, forwarded, grace_s, received=received, handled=1)
            return 128 + signum
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                if code < 0:  # a signal: the rank could not say anything itself (the report will)
                    print(
                        f"lightning_3d: launcher: rank {rank} (pid {procs[rank].pid}) was killed "
                        f"by {signal_name(-code)}; stopping the other ranks",
                        file=sys.stderr,
                        flush=True,
                    )
                # First a moment to fail by themselves (a lost peer fails their collective at once)
                # and say why: a SIGTERM during their error handling would only interrupt it.
                signalled = _end(
                    procs,
                    signal.SIGTERM,
                    FAILURE_GRACE_S,
                    received=received,
                    patience_s=FAILURE_GRACE_S,
                )
                return reported(
                    128 - code if code < 0 else code, [p.returncode for p in procs], signalled
                )
        if all(code == 0 for code in codes):
            return 0
        time.sleep(POLL_S)


def _reported(
    store: Any, output_dir: str, code: int, codes: list[int], signalled: set[int], pids: list[int]
) -> int:
    """After a rank failed with ``code`` and every rank has ended (``codes``): the one
    ``error:`` line for what the ranks reported (:mod:`lightning_3d.app.rank_report`) and its exit
    code; ``code`` if none reported anything (a rank that printed its own ``error:`` line, such
    as a non-finite stop). A rank that exited without a report while the others only lost it
    is named as the cause, with its exit code; so is a rank killed by a signal this launcher
    did not send (``signalled``: the ranks it stopped), with ``128 + n``, before the peers that
    lost it, whose tracebacks go to the log like any rank's."""
    from lightning_3d.app.rank_report import collect, report
    from lightning_3d.runtime.exit_codes import PEER_LOST

    records = collect(store, len(codes))
    reported = {r["rank"] for r in records}
    silent = [
        (rank, c)
        for rank, c in enumerate(codes)
        if c is not None and c > 0 and rank not in reported
    ]
    if records and silent and all(r["code"] == PEER_LOST for r in records):
        rank, own = silent[0]
        records.append(
            {
                "rank": rank,
                "code": own,
                "details": [],
                "traceback": "",
                "line": f"rank {rank} exited with code {own} without saying why (its own "
                "output, above, may); the other ranks lost it",
            }
        )
    for rank, c in enumerate(codes):
        if c is not None and c < 0 and rank not in signalled | reported:
            records.append(
                {
                    "rank": rank,
                    "code": 128 - c,
                    "details": [],
                    "traceback": "",
                    "line": f"rank {rank} (pid {pids[rank]}) was killed by "
                    f"{signal_name(-c)} (out of memory, or by someone)",
                }
            )
    return report(Path(output_dir), records) if records else code


def _end(
    procs: list[subprocess.Popen],
    signum: int,
    grace_s: float,
    received: Optional[list[int]] = None,
    patience_s: float = 0.0,
    handled: Optional[int] = None,
) -> set[int]:
    """After up to ``patience_s`` for the ranks to exit by themselves, send ``signum`` to those
    still running, wait up to ``grace_s``, then SIGKILL and reap every one; the waits end early
    once ``received`` holds more than ``handled`` signals (default: as many as it holds now).
    Returns the ranks (indices into ``procs``) that were sent a signal here."""
    count = handled if handled is not None else len(received) if received is not None else 0
    _wait(procs, patience_s, lambda: received is not None and len(received) > count)
    signalled = set()
    for rank, proc in enumerate(procs):
        if proc.poll() is None:
            signalled.add(rank)
            _send(proc, signum)
            if signum != signal.SIGKILL:
                # A stopped (SIGSTOP) rank acts on it only once continued.
                _send(proc, signal.SIGCONT)
    _wait(procs, grace_s, lambda: received is not None and len(received) > count)
    for rank, proc in enumerate(procs):
        if proc.poll() is None:
            signalled.add(rank)
            _send(proc, signal.SIGKILL)
        proc.wait()
    return signalled


def _wait(procs: list[subprocess.Popen], seconds: float, interrupted: Any) -> None:
    """Until every process has exited, ``seconds`` have passed or ``interrupted()``."""
    deadline = time.monotonic() + seconds
    while (
        time.monotonic() < deadline and any(p.poll() is None for p in procs) and not interrupted()
    ):
        time.sleep(POLL_S)


def _send(proc: subprocess.Popen, signum: int) -> None:
    try:
        proc.send_signal(signum)
    except ProcessLookupError:  # exited meanwhile
        pass


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal N`` for a number Python does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _remove_offload_dirs(store: Any, world_size: int, pids: list[int]) -> None:
    """The ranks' NVMe offload directories, in the paths they recorded in the store: a rank
    killed (or stopped past the grace period) could not remove its own."""
    from lightning_3d.offload.paths import remove_owned
    from lightning_3d.runtime.watchdog import recorded_offload_paths

    for parent in recorded_offload_paths(store, world_size):
        try:
            remove_owned(parent, pids)
        except OSError:  # the path went away or is unreadable: nothing of ours to remove there
            pass
