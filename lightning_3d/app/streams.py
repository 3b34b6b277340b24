"""Output whose reader went away never stops a run.

``python examples/train.py | head`` closes the pipe once ``head`` has its lines; the next write
to stdout raises ``BrokenPipeError``, which Rich's console (Lightning's progress bar and model
summary) turns into ``SystemExit(1)``: the run ended with no checkpoint and no word. Here each
process wraps ``sys.stdout`` and ``sys.stderr`` (:func:`guard_streams`, called by the apps'
entry point in the launcher and in every rank): the first write that finds its pipe closed
points the file descriptor at ``/dev/null`` (so every other writer of that descriptor, and the
interpreter's flush at exit, succeed from then on), says so once on the other stream if that
one is still open, and the run goes on, its output discarded.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, TextIO

NOTICE = (
    "lightning_3d: {name} was closed by its reader (a pipe into head, say): the run goes on and "
    "its {name} is discarded\n"
)


class ClosedPipeSafe:
    """A text stream that turns a closed pipe into ``/dev/null`` instead of an error."""

    def __init__(self, stream: TextIO, name: str) -> None:
        self._stream = stream
        self._name = name
        self.closed_by_reader = False
        self.partner: ClosedPipeSafe | None = None  # the other stream, told when this one closes

    def _closed(self) -> None:
        if self.closed_by_reader:
            return
        self.closed_by_reader = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        # No descriptor (a test's capture): the writes are dropped below.
        except (OSError, ValueError):
            pass
        other = self.partner
        if other is not None and not other.closed_by_reader:
            other.write(NOTICE.format(name=self._name))
            other.flush()

    def _guarded(self, call: Any, *args: Any) -> Any:
        """``call(*args)``, a closed pipe turned into ``/dev/null``; ``None`` once it is."""
        if self.closed_by_reader:
            return None
        try:
            return call(*args)
        except OSError as error:  # BrokenPipeError is the EPIPE one
            if error.errno != errno.EPIPE:
                raise
            self._closed()
        return None

    def write(self, text: str) -> int:
        self._guarded(self._stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, ...
        return getattr(self._stream, name)


def guard_streams() -> None:
    """Wrap this process's ``sys.stdout`` and ``sys.stderr`` (once; call it before anything
    else wraps them)."""
    if isinstance(sys.stdout, ClosedPipeSafe) or isinstance(sys.stderr, ClosedPipeSafe):
        return
    out, err = ClosedPipeSafe(sys.stdout, "stdout"), ClosedPipeSafe(sys.stderr, "stderr")
    out.partner, err.partner = err, out
    sys.stdout, sys.stderr = out, err
