"""Start the ranks of one Hydra job on this machine, for single runs and ``-m`` sweeps alike.

Lightning's own launcher re-runs ``sys.argv``, which under ``-m`` would make every child run the
whole sweep. Here the parent re-runs the script with the current job's overrides only, in the
job's output directory, with the environment ``torchrun`` would set (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); Lightning then sees an externally launched
world. Transport is torch.distributed's; this only starts and watches processes. When one rank
fails, the others are stopped rather than left hanging in a collective.

The rendezvous store is hosted here, in the launching process, as ``torchrun``'s agent hosts it
(:func:`hosted_store`): its port is one the OS assigned to a socket that listens for the whole
job, so it cannot be taken by another program, or shared with another job, between being chosen
and being used. The ranks connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


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


def local_rank_env(rank: int, world_size: int, port: int, threads: int, agent_store: bool = False) -> dict[str, str]:
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


def already_launched() -> bool:
    """True inside a rank started by us, torchrun, SLURM or any launcher that sets ``LOCAL_RANK``."""
    return "LOCAL_RANK" in os.environ or "SLURM_PROCID" in os.environ


def launch_job(world_size: int, script: str, overrides: list[str], output_dir: str, threads: int) -> int:
    """Run ``script`` with ``overrides`` on ``world_size`` local ranks; return the worst exit code."""
    with hosted_store() as port:
        return _run_ranks(world_size, script, overrides, output_dir, threads, port)


def _run_ranks(world_size: int, script: str, overrides: list[str], output_dir: str, threads: int, port: int) -> int:
    procs = []
    for rank in range(world_size):
        env = {**os.environ, **local_rank_env(rank, world_size, port, threads, agent_store=True)}
        command = [
            sys.executable, script, *overrides,
            f"hydra.run.dir={output_dir}", "hydra.output_subdir=null", f"hydra.job.name=rank{rank}",
        ]
        procs.append(subprocess.Popen(command, env=env))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]  # its peers would wait in a collective until the timeout
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
