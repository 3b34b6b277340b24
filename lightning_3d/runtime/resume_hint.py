"""What a stopped run can be resumed from, and how to say so: the checkpoint names a run leaves
(``last.ckpt``, ``preempted.ckpt``) and the one phrase every stop message ends with.

Outside the apps the phrase is the Lightning call (``trainer.fit(..., ckpt_path=...)``). An app
that knows its own command line hands it in for the length of its run (:func:`resume_command`;
the Hydra apps do, :func:`lightning_3d.app.run.run`), and the phrase becomes that command with
``resume=<checkpoint>``: the library itself knows no command-line parser.

Example::

    with resume_command(["python", "examples/train.py", "trainer.max_steps=50"]):
        resume_hint(Path("runs/a/preempted.ckpt"))
        # 'resume with: python examples/train.py trainer.max_steps=50 resume=runs/a/preempted.ckpt'
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Optional

LAST_NAME = "last.ckpt"  # ModelCheckpoint's save_last file
# Saved on SIGTERM / SIGINT by lightning_3d.runtime.preemption.StopOnSignal.
PREEMPTED = "preempted.ckpt"
RESUMABLE = (LAST_NAME, PREEMPTED)  # what a run leaves to resume from, in its checkpoint directory

# The command line (without any resume=) of the app whose run this is; None outside an app.
_COMMAND: ContextVar[Optional[tuple[str, ...]]] = ContextVar("resume_command", default=None)


@contextmanager
def resume_command(command: Sequence[str]) -> Iterator[None]:
    """Within the block, :func:`resume_hint` tells the user to run ``command`` with
    ``resume=<checkpoint>`` appended (``command``: the app as typed, its overrides but
    ``resume=``)."""
    token = _COMMAND.set(tuple(command))
    try:
        yield
    finally:
        _COMMAND.reset(token)


def resume_hint(checkpoint: Optional[Path]) -> str:
    """How to continue the run this process belongs to from ``checkpoint``, as one phrase: inside
    :func:`resume_command` that command with ``resume=checkpoint``; elsewhere the Lightning call
    (``ckpt_path='last'`` for ``None``)."""
    command = _COMMAND.get()
    if command is None:
        ckpt_path = str(checkpoint) if checkpoint is not None else "last"  # Lightning's newest
        return f"resume with trainer.fit(..., ckpt_path={ckpt_path!r})"
    if checkpoint is None:
        return "this run wrote no checkpoint to resume from (see checkpoint.every_n_steps): start it again"
    return "resume with: " + shlex.join([*command, f"resume={checkpoint}"])


def written_at(path: Path) -> float:
    """When a checkpoint was written: a file's mtime; a sharded directory's newest entry's."""
    if path.is_dir():
        return max([path.stat().st_mtime, *(p.stat().st_mtime for p in path.iterdir())])
    return path.stat().st_mtime


def written_checkpoint(trainer: Any) -> Optional[Path]:
    """What a run that stopped can be resumed from: the newest ``last.ckpt`` / ``preempted.ckpt``
    it wrote (in its checkpoint directory), else the checkpoint it resumed from itself, else ``None``."""
    if trainer is None:
        return None
    callback = getattr(trainer, "checkpoint_callback", None)
    directory = Path(getattr(callback, "dirpath", None) or trainer.default_root_dir)
    found = [directory / name for name in RESUMABLE if (directory / name).exists()]
    resumed_from = getattr(trainer, "ckpt_path", None)
    newest = max(found, key=written_at, default=None)
    return newest if newest is not None else (Path(resumed_from) if resumed_from else None)
