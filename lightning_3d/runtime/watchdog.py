"""Heartbeats through the rendezvous store: which rank stalled or died, and an orphaned rank.

A rank stopped by SIGSTOP (or frozen in the kernel, or swapped out) keeps its sockets open, so
its peers' collectives do not fail: they wait for the process group's timeout, and the
sub-groups of a ``DeviceMesh`` are made with torch's default of 30 minutes whatever
``init_process_group`` was given. A rank that died surfaces as "Connection closed by peer" on
whichever rank talked to it, which does not say who died either.

So every rank of a multi-process world runs a :class:`Watchdog`: a daemon thread that writes a
heartbeat (a counter, the step, a state) into the rendezvous store every ``interval_s`` and
reads those of a few peers (its ring successors, at most :data:`WATCHED_PEERS`, so the store's
load grows with the world size, not with its square). A peer whose heartbeat has not changed
for ``timeout_s`` (``parallelism.timeout_s``) is stalled or dead: the watchdog prints one line
naming it and, when the training thread has not stopped by itself ``grace_s`` later (it is
blocked in a collective that only a 30-minute timeout would end), ends this process with exit
code 1, so the launcher stops the rest. The thread only sets and reads store keys: no
collective, no signal handler. When a collective fails, :meth:`Watchdog.silent_peers` names the
peers that stopped beating, for the strategy's failure line.

In a rank started by :func:`lightning_3d.app.launch.launch_job` (:data:`LAUNCHER_PID_ENV` names its
parent), the thread also notices when the launcher has gone (killed outright, so it could not
stop its ranks) or has been stopped (SIGSTOP, a suspended job: ``T`` in ``/proc``) for
``timeout_s``, and sends this process SIGTERM: :class:`~lightning_3d.runtime.preemption.StopOnSignal`
then stops every unsupervised rank together with a checkpoint instead of letting them train on.
Ranks started otherwise (a shell that may exit under ``nohup``, torchrun) are left alone.

The watchdog uses its own connection to the store (a clone), so its short timeouts never touch
the process group's. Its store calls run in a thread of their own that it waits on for at most
:data:`STORE_TIMEOUT` (a store whose host is stopped does not answer, and a client's ``set``
waits on it past any timeout): a store that does not answer counts as silence, never blocks it.
Both the watchdog's thread and the training thread (:meth:`Watchdog.silent_peers` after a failed
collective, :meth:`Watchdog.stop`) make such calls: one lock lets one call at a time use the
connection, and a call abandoned on timeout keeps the others off it until it returns.
:func:`record_offload_path` / :func:`recorded_offload_paths` tell the
launcher, which hosts the store, where the ranks keep NVMe offload files.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

HEARTBEAT_KEY = "lightning3d/heartbeat/{rank}"
LAUNCHER_PID_ENV = "LIGHTNING3D_LAUNCHER_PID"  # set by launch_job in its ranks' environment
OFFLOAD_KEY = "lightning3d/offload_path/{rank}"
WATCHED_PEERS = 8  # each rank reads this many ring successors' heartbeats
STORE_TIMEOUT = timedelta(seconds=5)  # the watchdog's own store operations
FINISHED = ("done", "failed")  # states a rank writes when it stops on purpose: not silent


@dataclass(frozen=True)
class Silence:
    """A peer whose heartbeat has not changed for ``seconds`` (its last ``state`` and ``step``)."""

    rank: int
    seconds: float
    state: str
    step: int

    def describe(self) -> str:
        if self.rank < 0:
            return (
                f"the rendezvous store (hosted by the launcher or rank 0) has not answered for "
                f"{self.seconds:.0f} s (its host stalled or died)"
            )
        if self.state in FINISHED:
            return f"rank {self.rank} stopped ({self.state}) after step {self.step}"
        return (
            f"rank {self.rank} has not made progress for {self.seconds:.0f} s after step {self.step} "
            "(stalled or dead: no heartbeat)"
        )


def interval_for(timeout_s: float) -> float:
    """Seconds between heartbeats: a tenth of the timeout, between 0.2 s and 2 s."""
    return min(2.0, max(0.2, timeout_s / 10))


def root_store(store: Any) -> Any:
    """The store under any ``PrefixStore`` wrappers (the rendezvous store itself)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def default_group_store() -> Optional[Any]:
    """A connection of its own to the default process group's rendezvous store, or ``None``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = root_store(dist.distributed_c10d._get_default_store())
    try:
        store = store.clone()  # a TCPStore: a new connection, its own timeout
    except (AttributeError, RuntimeError):  # older torch, or a store that cannot be cloned
        return None
    store.set_timeout(STORE_TIMEOUT)
    return store


def record_offload_path(store: Any, rank: int, path: str) -> None:
    """Tell whoever hosts ``store`` (the launcher) that ``rank`` keeps offload files in ``path``."""
    store.set(OFFLOAD_KEY.format(rank=rank), os.path.abspath(path))


def recorded_offload_paths(store: Any, world_size: int) -> set[str]:
    """The offload paths the ranks recorded with :func:`record_offload_path`."""
    keys = [OFFLOAD_KEY.format(rank=rank) for rank in range(world_size)]
    return {store.get(key).decode() for key in keys if store.check([key])}


def watch_world(
    rank: int, world_size: int, plan: Any, progress: Callable[[], int]
) -> Optional[Watchdog]:
    """A started :class:`Watchdog` for this rank of the default group's world, with the plan's
    ``timeout_s``, having recorded the plan's NVMe offload path for the launcher; ``None`` for
    one process or a store that cannot be cloned. ``progress``: this rank's step."""
    store = default_group_store() if world_size > 1 else None
    if store is None:
        return None
    if plan.offload.device == "nvme" and plan.offload.path is not None:
        record_offload_path(store, rank, plan.offload.path)
    return Watchdog(store, rank, world_size, plan.dist.timeout_s, progress=progress).start()


class Watchdog:
    """This rank's heartbeat and its watch over a few peers (see the module's docstring).

    Example::

        watchdog = Watchdog(store, rank=0, world_size=2, timeout_s=60).start()
        ...
        watchdog.stop("done")
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        progress: Callable[[], int] = lambda: 0,
        grace_s: Optional[float] = None,
        exit: Callable[[int], None] = os._exit,
        launcher: Optional[int] = None,
        stop_rank: Optional[Callable[[], None]] = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.interval_s = interval_for(timeout_s)
        self.grace_s = grace_s if grace_s is not None else max(5.0, 2 * self.interval_s)
        self.progress = progress  # this rank's step, for the messages (read by the thread)
        self.verdict: Optional[str] = None  # the line printed when a peer went silent
        self._exit = exit
        self._peers = [
            (rank + i) % world_size for i in range(1, min(world_size, WATCHED_PEERS + 1))
        ]
        self._seen: dict[int, tuple[bytes, float]] = {}  # peer -> (heartbeat, when it last changed)
        self._beats = 0
        if launcher is None:  # the launcher is this rank's parent: launch_job's rank
            named = os.environ.get(LAUNCHER_PID_ENV, "")
            launcher = int(named) if named.isdigit() and int(named) == os.getppid() else None
        self._launcher, self._parent = launcher, os.getppid()
        self._launcher_stopped_since: Optional[float] = None
        self._stop_rank = stop_rank or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._call: Optional[threading.Thread] = None  # the store call under way, should one hang
        # One store call at a time, whichever thread asks (the watchdog's, or the training
        # thread's silent_peers / stop): they share the connection and the slot above.
        self._calling = threading.Lock()

    def start(self) -> Watchdog:
        """Write the first heartbeat and start the thread (once)."""
        if self._thread is None:
            self._beat("running")
            self._thread = threading.Thread(
                target=self._run, name=f"lightning3d-watchdog-rank{self.rank}", daemon=True
            )
            self._thread.start()
            # Never leave the thread inside a store call at interpreter exit.
            atexit.register(self.stop)
        return self

    def stop(self, state: str = "done") -> None:
        """Stop and join the thread; the last heartbeat says ``state`` ("done" or "failed"), so
        peers do not take this rank for a stalled one. Safe to call more than once."""
        if self._thread is None or self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=STORE_TIMEOUT.total_seconds() + self.interval_s)
        atexit.unregister(self.stop)
        # The store's host may be gone: nobody left to read it.
        self._bounded(lambda: self._beat(state))

    def silent_peers(self, wait_s: Optional[float] = None) -> list[Silence]:
        """The watched peers that have not beaten for ``wait_s`` (default: one and a half
        intervals) and have not stopped on purpose; waits at most ``wait_s``. Called after a
        collective failed."""
        deadline = time.monotonic() + (1.5 * self.interval_s + 0.2 if wait_s is None else wait_s)
        before = self._bounded(lambda: {peer: self._read(peer) for peer in self._peers})
        if before is None:  # the store does not answer: nothing can be said about the peers
            return []
        silent = set(before)
        while silent and time.monotonic() < deadline:
            time.sleep(min(0.2, self.interval_s))
            now = self._bounded(lambda silent=silent: {p: self._read(p) for p in silent})
            if now is None:
                return []
            silent = {p for p in silent if now[p] == before[p] and not _finished(before[p])}
        now = time.monotonic()
        return [
            Silence(p, now - self._seen.get(p, (b"", now))[1], *_state_and_step(before[p]))
            for p in sorted(silent)
        ]

    def failure_line(self, exception: BaseException) -> Optional[str]:
        """After ``exception``: one line naming the watched peers that stopped beating, if any
        did (else ``None``); then stops the watchdog. Not only after a recognised collective
        failure: gloo words a timed-out collective in several ways ("Application timeout caused
        pair closure"), and a silent peer is worth naming whatever this rank saw."""
        # Preempted, Ctrl-C.
        agreed = getattr(exception, "agreed_stop", False) or not isinstance(exception, Exception)
        try:
            # By the thread, or by an earlier call.
            said = self.verdict is not None or self._stopped.is_set()
            silent = self.silent_peers() if not (said or agreed) else []
        finally:
            self.stop("failed")
        silent = silent if self.verdict is None else []  # the thread said it meanwhile
        return (
            f"lightning_3d: rank {self.rank}: " + "; ".join(s.describe() for s in silent)
            if silent
            else None
        )

    def _run(self) -> None:
        answered = time.monotonic()  # the last time the store answered
        while not self._stopped.wait(self.interval_s):
            looked = self._bounded(self._beat_and_look)
            if self._stopped.is_set():  # stopped meanwhile: stop() has written the last beat
                return
            if looked is not None:
                stalled = [
                    s for s in looked if s.seconds > self.timeout_s and s.state not in FINISHED
                ]
                answered = time.monotonic()
            else:  # the store's host (the launcher, or rank 0) is gone or stopped
                silent_for = time.monotonic() - answered
                stalled = (
                    [Silence(-1, silent_for, "store", self._progress())]
                    if silent_for > self.timeout_s
                    else []
                )
            if self._launcher is not None:
                self._watch_launcher()
            if stalled:
                self._give_up(stalled)
                return

    def _beat_and_look(self) -> Optional[list[Silence]]:
        """One round of the thread: beat "running" and read the peers; nothing once stopped (the
        call may get its turn after the last beat stop() wrote: "done" must stay the last)."""
        if self._stopped.is_set():
            return None
        self._beat("running")
        return self._look()

    def _beat(self, state: str) -> None:
        self._beats += 1
        self.store.set(
            HEARTBEAT_KEY.format(rank=self.rank), f"{self._beats} {self._progress()} {state}"
        )

    def _progress(self) -> int:
        try:
            return int(self.progress())
        except Exception:  # noqa: BLE001 -- the trainer is being torn down
            return 0

    def _read(self, peer: int) -> bytes:
        key = HEARTBEAT_KEY.format(rank=peer)
        value = self.store.get(key) if self.store.check([key]) else b""
        now = time.monotonic()
        if self._seen.get(peer, (None,))[0] != value:
            self._seen[peer] = (value, now)
        return value

    def _look(self) -> list[Silence]:
        now = time.monotonic()
        for peer in self._peers:
            self._read(peer)
        return [
            Silence(p, now - since, *_state_and_step(value))
            for p, (value, since) in list(self._seen.items())
        ]

    def _bounded(self, call: Callable[[], Any]) -> Optional[Any]:
        """``call()``'s result, run in a thread of its own and waited on for at most
        :data:`STORE_TIMEOUT`; ``None`` if it failed, has not returned by then, or an earlier
        call still hangs (a store whose host is stopped answers nothing). One call at a time
        from any thread: a caller waits at most :data:`STORE_TIMEOUT` for another's to end."""
        if not self._calling.acquire(timeout=STORE_TIMEOUT.total_seconds()):
            return None
        try:
            if self._call is not None and self._call.is_alive():
                return None  # abandoned by an earlier caller and still inside the store
            result: list[Any] = []

            def work() -> None:
                try:
                    result.append(call())
                except Exception:  # noqa: BLE001 -- the store's host is gone or stopped
                    pass

            helper = threading.Thread(
                target=work, name=f"lightning3d-watchdog-store-rank{self.rank}", daemon=True
            )
            self._call = helper
            helper.start()
            helper.join(STORE_TIMEOUT.total_seconds())
            return result[0] if result else None
        finally:
            self._calling.release()

    def _watch_launcher(self) -> None:
        """SIGTERM to this rank once the launcher is gone (this rank's parent changed) or has
        been stopped for ``timeout_s``."""
        if os.getppid() != self._parent:
            why = "is gone"
        elif process_state(self._launcher) in ("T", "t"):
            now = time.monotonic()
            self._launcher_stopped_since = self._launcher_stopped_since or now
            if now - self._launcher_stopped_since <= self.timeout_s:
                return
            why = f"has been stopped for {now - self._launcher_stopped_since:.0f} s (SIGSTOP or a suspended job)"
        else:
            self._launcher_stopped_since = None
            return
        print(
            f"lightning_3d: rank {self.rank}: the launcher (pid {self._launcher}) {why}, so nothing supervises "
            "this rank; stopping it with a checkpoint (SIGTERM)",
            file=sys.stderr,
            flush=True,
        )
        self._launcher = None  # once
        self._stop_rank()

    def _give_up(self, stalled: list[Silence]) -> None:
        self.verdict = (
            f"lightning_3d: rank {self.rank}: "
            + "; ".join(s.describe() for s in stalled)
            + f" (parallelism.timeout_s={self.timeout_s:g}); stopping this rank"
        )
        print(self.verdict, file=sys.stderr, flush=True)
        self._bounded(lambda: self._beat("failed"))
        # The training thread is most likely blocked in a collective with the silent peer; if it
        # does not get out (and stop this watchdog) by itself, nothing in this process will.
        if not self._stopped.wait(self.grace_s):
            self._exit(1)


def process_state(pid: int) -> Optional[str]:
    """The state letter of process ``pid`` in ``/proc`` (``R``, ``S``, ``T`` for stopped, ...);
    ``None`` where there is no ``/proc`` or no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _finished(heartbeat: bytes) -> bool:
    return _state_and_step(heartbeat)[0] in FINISHED


def _state_and_step(heartbeat: bytes) -> tuple[str, int]:
    parts = heartbeat.decode(errors="replace").split()
    if len(parts) != 3:
        return "not started", 0
    return parts[2], int(parts[1]) if parts[1].isdigit() else 0
