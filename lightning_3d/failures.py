"""What a rank says when a run fails: its own setup step, its own error, or a peer that stopped.

A peer that died (killed, out of memory, lost node) surfaces on the other ranks as a failed
collective: gloo's "Connection closed by peer" at once, or a timeout if the peer just went silent.
Only then does the rank say so, with the advice to resume. Anything else is this rank's own error
and is reported as what it is (the exception's type, the rank, and for an I/O error the file:
``No space left on device`` is a full disk here, not a lost peer), so that nobody relaunches a run
that will fail the same way.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

# What gloo, NCCL and the TCP store say when the other side of a collective is gone or silent
# (gloo's timeout: "Application timeout caused pair closure").
_PEER_LOST = ("connection closed", "connection reset", "closed by peer", "broken pipe", "timed out",
              "collective operation timeout", "socket timeout", "application timeout")


def _chain(exception: BaseException) -> list[BaseException]:
    """``exception`` and what caused it (``raise ... from``, or raised while handling)."""
    chain: list[BaseException] = []
    while exception is not None and exception not in chain:
        chain.append(exception)
        exception = exception.__cause__ or exception.__context__
    return chain


def _own_os_error(exception: BaseException) -> Optional[OSError]:
    """The I/O error (a full disk, a read-only or missing path) behind ``exception``, if any: a
    ``ConnectionError`` or ``TimeoutError`` is a peer's, not this rank's."""
    for err in _chain(exception):
        if isinstance(err, OSError) and not isinstance(err, (ConnectionError, TimeoutError)):
            return err
    return None


def is_collective_failure(exception: BaseException) -> bool:
    """A failed collective because a peer stopped or went silent, as gloo, NCCL and the store
    report it; not this rank's own I/O error or bad value, whatever its message mentions."""
    if _own_os_error(exception) is not None:
        return False
    if isinstance(exception, (ConnectionError, TimeoutError)):
        return True
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and any(words in text for words in _PEER_LOST)


def describe_failure(exception: BaseException, rank: int, setup_step: Optional[str], module: Any,
                     layout: Any) -> Optional[str]:
    """One line for stderr saying what failed on this rank (a setup step, a lost peer, or the
    rank's own error with the file of an I/O error); ``None`` for an interrupt (Ctrl-C)."""
    first_line = str(exception).splitlines()[0] if str(exception) else ""
    if getattr(exception, "agreed_stop", False):  # NonFiniteError, Preempted: one message says it all
        return None
    if setup_step is not None:
        return (f"lightning_3d: rank {rank}: setting up {type(module).__name__} for {layout} failed during "
                f"{setup_step}: {type(exception).__name__}: {first_line[:300]}")
    if is_collective_failure(exception) and dist.is_available() and dist.is_initialized():
        from lightning_3d.resume import resume_hint, written_checkpoint

        return (f"lightning_3d: rank {rank}: a collective failed ({type(exception).__name__}: {first_line[:200]}). "
                "Another rank has probably stopped; checkpoints already written are complete (saves are atomic); "
                f"{resume_hint(written_checkpoint(getattr(module, '_trainer', None)))}")
    if not isinstance(exception, Exception):
        return None  # KeyboardInterrupt, SystemExit: the user's or the launcher's doing
    io_error = _own_os_error(exception)
    if io_error is not None:
        where = f" ({io_error.filename})" if io_error.filename else ""
        return (f"lightning_3d: rank {rank}: {type(io_error).__name__}{where}: "
                f"{io_error.strerror or first_line[:300]} (this rank's own I/O error, not a lost peer)")
    return f"lightning_3d: rank {rank}: {type(exception).__name__}: {first_line[:300]}"
