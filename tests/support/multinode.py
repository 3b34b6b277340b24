"""Several "nodes" on one machine: a world started the way a cluster starts it, for multi-node tests.

Two ways, each through Lightning's own cluster environment detection, none through ``run_world``:

* :func:`torchrun_nodes`: one ``torchrun`` launcher per node (``--nnodes N --nproc-per-node P``)
  meeting at a c10d rendezvous on localhost, as ``torchrun`` is run on each machine of a cluster.
  Lightning sees ``TorchElasticEnvironment``.
* :func:`slurm_nodes`: ``N * P`` processes started by hand with the variables ``srun`` would set
  (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_NTASKS``, ...; ``srun`` itself is
  not needed). Lightning sees ``SLURMEnvironment`` and resolves the main address from the node list.

Every process runs :func:`_worker`: it records which cluster environment a ``Trainer`` built with
``num_nodes`` picked and the ranks it read, then trains :func:`~tools.harness.runs.fit_gpt_ranks`
with ``num_nodes`` and returns its result and the size and rank of the world that trained.

The rendezvous store is hosted by the calling process on a port the OS assigned
(:func:`lightning_3d.app.launch.hosted_store`), so no port is chosen and bound later by someone else:
the launchers join it as clients (``is_host=false``), and the SLURM ranks through
``TORCHELASTIC_USE_AGENT_STORE``. On a real SLURM cluster rank 0 would host it on ``MASTER_PORT``
instead; that one step is torch's ``env://`` rendezvous, not Lightning's environment, and is not
what these helpers check.

No process outlives a call: launchers and ranks run in sessions of their own and each rank writes
its pid before it starts work, so on a failure or a timeout every launcher's and rank's process
group is killed (torchrun starts its workers in new sessions, out of its own group's reach).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from lightning_3d.app.launch import hosted_store
from tools import pythonpath
from tools.harness.runs import Run

POLL_S = 0.2
# Variables of the calling environment that would make a child look launched already, or belong
# to another world: the children get only what their launcher (or the simulated srun) gives them.
_FOREIGN = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
)


def _base_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = pythonpath()  # the children run from work/ and import tools.*
    return env


def _check(nodes: int, procs_per_node: int, timeout: float) -> None:
    if not (isinstance(nodes, int) and nodes >= 1):
        raise ValueError(f"nodes must be a positive int, got {nodes!r}")
    if not (isinstance(procs_per_node, int) and procs_per_node >= 1):
        raise ValueError(f"procs_per_node must be a positive int, got {procs_per_node!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")


def _write_run(run: Run, nodes: int, work: Path) -> Path:
    path = work / "run.pkl"
    path.write_bytes(
        pickle.dumps(dataclasses.replace(run, trainer={**(run.trainer or {}), "num_nodes": nodes}))
    )
    return path


def torchrun_nodes(
    run: Run, nodes: int, procs_per_node: int, work: Path, timeout: float = 300.0
) -> list[dict]:
    """Train ``run`` on ``nodes`` ``torchrun`` launchers of ``procs_per_node`` processes each;
    return every rank's :func:`_worker` result in global rank order. ``work``: an empty directory
    for the results and logs."""
    _check(nodes, procs_per_node, timeout)
    run_file = _write_run(run, nodes, work)
    env = _base_env(threads=1)
    # One per world: every launcher must give the same.
    rdzv_id = f"multinode-{uuid.uuid4().hex[:8]}"
    with hosted_store() as port:
        commands = [
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nodes}",
                f"--nproc-per-node={procs_per_node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id={rdzv_id}",
                "--rdzv-conf=is_host=false",
                "--max-restarts=0",
                "--monitor-interval=0.2",
                str(Path(__file__).resolve()),
                str(run_file),
                str(work),
            ]
            for _ in range(nodes)
        ]
        _run_all([(c, env) for c in commands], work, timeout, "launcher")
    return _results(work, nodes * procs_per_node)


def slurm_env(rank: int, nodes: int, procs_per_node: int, port: int, job_id: str) -> dict[str, str]:
    """What ``srun`` sets for task ``rank`` of ``nodes`` nodes × ``procs_per_node`` tasks (the
    subset Lightning's ``SLURMEnvironment`` reads), the nodes named ``127.0.0.[1-N]``: loopback
    addresses, so the main address Lightning resolves from the list (its first node) is this machine."""
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "multinode",  # "bash" / "interactive" would turn SLURM detection off
        "SLURM_NTASKS": str(nodes * procs_per_node),
        "SLURM_NTASKS_PER_NODE": str(procs_per_node),
        "SLURM_NNODES": str(nodes),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % procs_per_node),
        "SLURM_NODEID": str(rank // procs_per_node),
        "SLURM_JOB_NODELIST": f"127.0.0.[1-{nodes}]",
        "SLURM_NODELIST": f"127.0.0.[1-{nodes}]",
        "MASTER_PORT": str(port),
    }


def slurm_nodes(
    run: Run, nodes: int, procs_per_node: int, work: Path, timeout: float = 300.0
) -> list[dict]:
    """Train ``run`` on ``nodes * procs_per_node`` processes given ``srun``'s variables
    (:func:`slurm_env`); results in global rank order, as :func:`torchrun_nodes`."""
    _check(nodes, procs_per_node, timeout)
    run_file = _write_run(run, nodes, work)
    slurm_tasks(
        [sys.executable, str(Path(__file__).resolve()), str(run_file), str(work)],
        nodes,
        procs_per_node,
        work,
        timeout,
    )
    return _results(work, nodes * procs_per_node)


def slurm_tasks(
    command: list[str], nodes: int, procs_per_node: int, work: Path, timeout: float = 300.0
) -> None:
    """Run ``command`` (in ``work``) as the ``nodes * procs_per_node`` tasks of a simulated ``srun``:
    each with its :func:`slurm_env`; raise ``RuntimeError`` with the failing task's log (``work /
    "rank<N>.log"``) should one fail or all not finish within ``timeout``."""
    _check(nodes, procs_per_node, timeout)
    job_id = str(10_000 + os.getpid() % 10_000)
    with hosted_store() as port:
        jobs = []
        for rank in range(nodes * procs_per_node):
            env = {
                **_base_env(threads=1),
                **slurm_env(rank, nodes, procs_per_node, port, job_id),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
            }  # join the store hosted here (module docstring)
            jobs.append((command, env))
        _run_all(jobs, work, timeout, "rank")


def _run_all(
    jobs: list[tuple[list[str], dict[str, str]]], work: Path, timeout: float, what: str
) -> None:
    """Start every job in a session of its own; wait for all to succeed. On a failure or past
    ``timeout`` raise, after killing every job's and every recorded rank's process group."""
    procs, logs = [], []
    try:
        for index, (command, env) in enumerate(jobs):
            log = open(work / f"{what}{index}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    command,
                    env=env,
                    cwd=work,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed or time.monotonic() > deadline:
                first = failed[0] if failed else 0
                why = (
                    f"{what} {first} exited with {codes[first]}"
                    if failed
                    else f"timed out after {timeout:g} s"
                )
                raise RuntimeError(
                    f"{why}; last lines of {what} {first}'s log:\n{_tail(work / f'{what}{first}.log')}"
                )
            if all(c == 0 for c in codes):
                return
            time.sleep(POLL_S)
    finally:
        _reap(procs, work)
        for log in logs:
            log.close()


def _reap(procs: list[subprocess.Popen], work: Path) -> None:
    """SIGKILL the process group of every job still running and of every rank that recorded its
    pid (each leads its own session), then wait for the jobs."""
    groups = [p.pid for p in procs if p.poll() is None]
    groups += [int(f.read_text()) for f in work.glob("pid.*") if f.read_text().strip().isdigit()]
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # exited meanwhile
            pass
    for proc in procs:
        proc.wait()


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def _results(work: Path, world: int) -> list[dict]:
    return [pickle.loads((work / f"rank{r}.pkl").read_bytes()) for r in range(world)]


def _worker(run_file: str, work: str) -> None:
    """One rank: the cluster environment a ``Trainer`` picks here, then the training run."""
    # Before any work: the caller kills this process group should the world fail or hang.
    (Path(work) / f"pid.{os.getpid()}").write_text(str(os.getpgid(0)))
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_3d import ThreeDStrategy
    from tools.harness.runs import fit_gpt_ranks

    torch.set_num_threads(1)
    run: Run = pickle.loads(Path(run_file).read_bytes())
    probe = L.Trainer(
        accelerator="cpu",
        devices=run.devices,
        num_nodes=run.trainer["num_nodes"],
        strategy=ThreeDStrategy(**run.strategy),
        logger=False,
        enable_progress_bar=False,
    )
    seen: dict[str, Any] = {
        "environment": type(probe.strategy.cluster_environment).__name__,
        "node_rank": probe.node_rank,
        "local_rank": probe.local_rank,
        "global_rank": probe.global_rank,
        "world_size": probe.world_size,
        "num_nodes": probe.num_nodes,
        "main_address": probe.strategy.cluster_environment.main_address,
    }
    result = fit_gpt_ranks(seen["global_rank"], run)
    seen.update(dist_rank=dist.get_rank(), dist_world_size=dist.get_world_size())
    dist.destroy_process_group()
    with open(Path(work) / f"rank{seen['global_rank']}.pkl", "wb") as f:
        pickle.dump({**result, **seen}, f)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
