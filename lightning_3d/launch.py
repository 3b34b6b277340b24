"""Start the ranks of one Hydra job on this machine, for single runs and ``-m`` sweeps alike.

Lightning's own launcher re-runs ``sys.argv``, which under ``-m`` would make every child run the
whole sweep. Here the parent re-runs the script with the current job's overrides only, in the
job's output directory, with the environment ``torchrun`` would set (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); Lightning then sees an externally launched
world. Transport is torch.distributed's; this only starts and watches processes. When one rank
fails, the others are stopped rather than left hanging in a collective.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_rank_env(rank: int, world_size: int, port: int, threads: int) -> dict[str, str]:
    """The variables ``torchrun`` sets for one rank of a single-node world."""
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
    }


def already_launched() -> bool:
    """True inside a rank started by us, torchrun, SLURM or any launcher that sets ``LOCAL_RANK``."""
    return "LOCAL_RANK" in os.environ or "SLURM_PROCID" in os.environ


def launch_job(world_size: int, script: str, overrides: list[str], output_dir: str, threads: int) -> int:
    """Run ``script`` with ``overrides`` on ``world_size`` local ranks; return the worst exit code."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, **local_rank_env(rank, world_size, port, threads)}
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
