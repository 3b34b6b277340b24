"""What a rank says when a run fails: its own setup step, its own error, or a peer that stopped.

A peer that died (killed, out of memory, lost node) surfaces on the other ranks as a failed
collective: gloo's "Connection closed by peer" at once, or a timeout if the peer just went silent.
Only then does the rank say so, with the advice to resume. Anything else is this rank's own error
and is reported as what it is (the exception's type, the rank, and for an I/O error the file:
``No space left on device`` is a full disk here, not a lost peer), so that nobody relaunches a run
that will fail the same way.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from lightning_3d.runtime.exit_codes import IO_ERROR, PEER_LOST, RANK_ERROR
from lightning_3d.runtime.resume_hint import resume_hint, written_checkpoint

# What gloo, NCCL and the TCP store say when the other side of a collective is gone or silent
# (gloo's timeout: "Application timeout caused pair closure").
_PEER_LOST = (
    "connection closed",
    "connection reset",
    "closed by peer",
    "broken pipe",
    "timed out",
    "collective operation timeout",
    "socket timeout",
    "application timeout",
)


# While the app reports failures (lightning_3d.app.rank_report), the strategy's on_exception keeps
# its lines on the exception, under LINES_ATTR, instead of printing them.
REPORTS_ENV = "LIGHTNING3D_APP_REPORTS"
LINES_ATTR = "lightning_3d_lines"

# What each I/O error means for the user: the cause in words, and what to do.
_ELSEWHERE = "free space there, or write to another disk"
_IO_ADVICE = {
    errno.ENOSPC: ("no space left on device", _ELSEWHERE),
    errno.EDQUOT: ("disk quota exceeded", _ELSEWHERE),
    errno.EROFS: ("read-only file system", "write to a writable path"),
    errno.EACCES: ("permission denied", "write to a path this user may write"),
    errno.EPERM: ("operation not permitted", "write to a path this user may write"),
}
# What torch.save's zip writer says when a write fell short (it drops the OSError).
_SHORT_WRITE = ("unexpected pos", "failed writing file")


def _chain(exception: BaseException) -> list[BaseException]:
    """``exception``, what caused it (``raise ... from``, or raised while handling), and the
    per-rank exceptions a ``torch.distributed.checkpoint`` ``CheckpointException`` wraps."""
    chain: list[BaseException] = []
    todo = [exception]
    while todo:
        err = todo.pop(0)
        if err is None or any(err is seen for seen in chain):
            continue
        chain.append(err)
        todo.append(err.__cause__ or err.__context__)
        failures = getattr(err, "failures", None)  # CheckpointException: rank -> (exception, stack)
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items()))
    return chain


def _own_os_error(exception: BaseException) -> Optional[OSError]:
    """The I/O error (a full disk, a read-only or missing path) behind ``exception``, if any: a
    ``ConnectionError`` or ``TimeoutError`` is a peer's, not this rank's. One that names its
    file is preferred."""
    found = [
        err
        for err in _chain(exception)
        if isinstance(err, OSError) and not isinstance(err, (ConnectionError, TimeoutError))
    ]
    return next((err for err in found if err.filename), found[0] if found else None)


def io_error_of(exception: BaseException) -> Optional[OSError]:
    """The I/O error behind ``exception`` (see :func:`_own_os_error`), or ``None``."""
    return _own_os_error(exception)


def io_error_words(error: OSError) -> str:
    """``no space left on device: /runs/a/final.ckpt; free space there, ...``: the cause, the
    file, and what to do."""
    cause, advice = _IO_ADVICE.get(error.errno, (error.strerror or str(error), "check that path"))
    where = f": {error.filename}" if error.filename else ""
    return f"{cause}{where}; {advice}"


def exit_code_of(exception: BaseException) -> int:
    """The exit code for a rank that failed with ``exception``
    (:mod:`lightning_3d.runtime.exit_codes`): an I/O error, a lost peer, or the rank's own error."""
    if _own_os_error(exception) is not None:
        return IO_ERROR
    return PEER_LOST if is_collective_failure(exception) else RANK_ERROR


def _no_room(path: Path) -> bool:
    """The file system of ``path`` (or of its nearest existing parent) has no space left."""
    for where in (path, *path.parents):
        if where.exists():
            try:
                return shutil.disk_usage(where).free < 1 << 16
            except OSError:
                return False
    return False


@contextmanager
def naming_path(path: Any) -> Iterator[None]:
    """Re-raise an I/O error of the block that does not name its file (a write that failed when
    its file was closed; one inside a ``CheckpointException``; torch.save's short write on a
    full disk) as an ``OSError`` naming ``path``, from the original."""
    try:
        yield
    except BaseException as err:
        os_error = _own_os_error(err)
        if os_error is None and any(w in str(err) for w in _SHORT_WRITE) and _no_room(Path(path)):
            os_error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if os_error is None or (os_error is err and os_error.filename):
            raise
        raise OSError(os_error.errno, os_error.strerror, os_error.filename or str(path)) from err


def is_collective_failure(exception: BaseException) -> bool:
    """A failed collective because a peer stopped or went silent, as gloo, NCCL and the store
    report it; not this rank's own I/O error or bad value, whatever its message mentions."""
    if _own_os_error(exception) is not None:
        return False
    if isinstance(exception, (ConnectionError, TimeoutError)):
        return True
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and any(words in text for words in _PEER_LOST)


def describe_failure(
    exception: BaseException, rank: int, setup_step: Optional[str], module: Any, layout: Any
) -> Optional[str]:
    """One line for stderr saying what failed on this rank (a setup step, a lost peer, or the
    rank's own error with the file of an I/O error); ``None`` for an interrupt (Ctrl-C)."""
    first_line = str(exception).splitlines()[0] if str(exception) else ""
    # NonFiniteError, Preempted: one message says it all.
    if getattr(exception, "agreed_stop", False):
        return None
    if getattr(exception, "peer_setup_failure", False):  # PeerSetupError: the peers' causes
        return f"lightning_3d: rank {rank}: stopping with the other ranks: {first_line[:600]}"
    if setup_step is not None:
        return (
            f"lightning_3d: rank {rank}: setting up {type(module).__name__} for {layout} failed during "
            f"{setup_step}: {type(exception).__name__}: {first_line[:300]}"
        )
    if is_collective_failure(exception) and dist.is_available() and dist.is_initialized():
        return (
            f"lightning_3d: rank {rank}: a collective failed ({type(exception).__name__}: {first_line[:200]}). "
            "Another rank has probably stopped; checkpoints already written are complete (saves are atomic); "
            f"{resume_hint(written_checkpoint(getattr(module, '_trainer', None)))}"
        )
    if not isinstance(exception, Exception):
        return None  # KeyboardInterrupt, SystemExit: the user's or the launcher's doing
    return rank_line(exception, rank)


def rank_line(exception: BaseException, rank: int) -> str:
    """``lightning_3d: rank R: ...``: the rank's own error, the file and cause of an I/O error."""
    io_error = _own_os_error(exception)
    if io_error is not None:
        return (
            f"lightning_3d: rank {rank}: {io_error_words(io_error)} (this rank's own I/O error, "
            "not a lost peer)"
        )
    first_line = str(exception).splitlines()[0] if str(exception) else ""
    return f"lightning_3d: rank {rank}: {type(exception).__name__}: {first_line[:300]}"
