"""Run a function on N local processes that form one torch.distributed world.

Each process gets the environment a launcher such as ``torchrun`` would give it (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so code under test — a
Lightning ``Trainer`` included — sees an externally launched world and starts no processes of
its own. Processes are spawned (not forked: no inherited threads or process groups), and always
torn down, even when one fails or the run times out.
"""

from __future__ import annotations

import os
import pickle
import queue
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from lightning_3d.launch import free_port, local_rank_env


def _entry(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
    os.environ.update(local_rank_env(rank, world_size, port, threads=1))
    import torch

    torch.set_num_threads(1)  # 2 cores here: ranks must not fight over intra-op threads
    try:
        # Plain pickle bytes: torch.multiprocessing would share tensors by file descriptor,
        # which dies with this process before the parent reads it.
        results.put((rank, "ok", pickle.dumps(fn(rank, *args))))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Call ``fn(rank, *args)`` on ``world_size`` processes; return the results in rank order.

    ``fn`` must be importable (a module-level function). Raises ``RuntimeError`` carrying the
    first failing rank's traceback, or ``TimeoutError`` when the world does not finish.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, args, results), daemon=False)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    try:
        while len(outputs) < world_size:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"world of {world_size} did not finish within {timeout}s") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            outputs[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [outputs[r] for r in range(world_size)]
