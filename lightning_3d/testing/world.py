"""Run a function on N local processes that form one torch.distributed world.

Each process gets the environment a launcher such as ``torchrun`` would give it (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so code under test — a
Lightning ``Trainer`` included — sees an externally launched world and starts no processes of
its own. Processes are spawned (not forked: no inherited threads or process groups), and always
torn down, even when one fails or the run times out.

The rendezvous store is hosted by the calling process, as ``torchrun``'s agent hosts it
(:func:`lightning_3d.launch.hosted_store`): a ``TCPStore`` created on port 0, so the OS picks a
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

import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from lightning_3d.launch import hosted_store, local_rank_env


def _entry(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
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


def run_world(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Call ``fn(rank, *args)`` on ``world_size`` processes; return the results in rank order.

    ``fn`` must be importable (a module-level function). Raises ``RuntimeError`` carrying the
    first failing rank's traceback, or ``TimeoutError`` when the world does not finish.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with hosted_store() as port:  # listens until the processes are gone
        procs = [
            ctx.Process(target=_entry, args=(fn, rank, world_size, port, args, results), daemon=False)
            for rank in range(world_size)
        ]
        outputs: dict[int, Any] = {}
        try:
            for p in procs:
                p.start()
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
