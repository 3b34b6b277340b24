"""What a rank says when a run fails: its own setup step, or a peer that stopped.

A peer that died (killed, out of memory, lost node) surfaces on the other ranks as a failed
collective: gloo's "Connection closed by peer" at once, or after the collective timeout if the
peer just went silent. A failure while building the layout is this rank's own and says which
step of the recipe failed.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist


def is_collective_failure(exception: BaseException) -> bool:
    """A failed collective (a peer stopped or went silent), as gloo and NCCL report it."""
    if isinstance(exception, dist.DistError):
        return True
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and any(
        word in text for word in ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout")
    )


def describe_failure(exception: BaseException, rank: int, setup_step: Optional[str], module: Any,
                     layout: Any) -> Optional[str]:
    """One line for stderr, or ``None`` when there is nothing to add to the traceback."""
    first_line = str(exception).splitlines()[0] if str(exception) else ""
    if setup_step is not None:
        return (f"lightning_3d: rank {rank}: setting up {type(module).__name__} for {layout} failed during "
                f"{setup_step}: {type(exception).__name__}: {first_line[:300]}")
    if is_collective_failure(exception) and dist.is_available() and dist.is_initialized():
        return (f"lightning_3d: rank {rank}: a collective failed ({type(exception).__name__}: {first_line[:200]}). "
                "Another rank has probably stopped; checkpoints already written are complete (saves are atomic): "
                "relaunch with ckpt_path='last' to resume.")
    return None
