"""Atomic checkpoint files: a killed save never leaves a half-written file under the final name.

A save writes ``.<name>.tmp-<pid>`` in the target directory, fsyncs it, ``os.replace``s it onto
``<name>`` (atomic on POSIX within one file system) and fsyncs the directory so the rename itself
survives a power loss. The temporary name starts with a dot and does not end in ``.ckpt``, so
Lightning never takes it for a checkpoint: ``ModelCheckpoint._find_last_checkpoints`` (what
``ckpt_path="last"`` resolves through) keeps only files whose suffix is ``.ckpt`` and whose stem
starts with ``last``. Temporary files left by a killed save are removed by the next save into
the same directory.

Example::

    trainer = L.Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    # or ThreeDStrategy(checkpoint_io=AtomicCheckpointIO())
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from lightning_3d.checkpoint.checks import load_lightning_checkpoint

_TEMP_NAME = re.compile(r"^\..+\.tmp-(\d+)$")


def temp_path_for(path: Path) -> Path:
    """Where a save of ``path`` writes before the rename (same directory: ``os.replace`` is atomic)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _process_start_time() -> float | None:
    """When this process started (seconds since the epoch), from /proc on Linux; else ``None``."""
    try:
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
        with open("/proc/self/stat") as f:
            ticks = float(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _is_stale(entry: Path, pid: int) -> bool:
    if pid != os.getpid():
        return not _pid_alive(pid)
    # Our own id: either another thread of ours is writing it now (keep), or a killed process
    # had the same id before a restart (pid reuse in containers): then it predates us.
    started = _process_start_time()
    return started is not None and entry.stat().st_mtime < started - 1.0


def remove_stale_temps(directory: Path) -> list[Path]:
    """Delete temporary files of saves that were killed; returns what was removed.

    Stale: the process that wrote it is gone, or it carries this process's id but is older
    than this process. Files of live writers are kept.
    """
    removed = []
    for entry in directory.iterdir() if directory.is_dir() else ():
        match = _TEMP_NAME.match(entry.name)
        if match and _is_stale(entry, int(match.group(1))):
            if entry.is_dir() and not entry.is_symlink():  # a sharded checkpoint's directory
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    """This process's umask, read without changing it (Linux), else the usual 0o022."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return 0o022


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(temp_path)``, fsync the result, then rename it onto ``path`` atomically.

    On any error (or an exception in ``write``) the temp file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent)
    temp = temp_path_for(path)
    try:
        write(temp)
        # Writers that make their own temp file (safetensors) leave it 0600: use the usual mode.
        os.chmod(temp, 0o666 & ~_umask())
        with open(temp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _is_local(path: _PATH) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` checkpoints written atomically; loads are weights-only and checked.

    Lightning's ``TorchCheckpointIO`` (the class ``lightning.pytorch.plugins.io`` re-exports from
    ``lightning.fabric``), so it is accepted as ``Trainer(plugins=[AtomicCheckpointIO()])`` or as a
    strategy's ``checkpoint_io``. Remote (fsspec URL) paths fall back to Lightning's own save.

    Loading refuses arbitrary pickled objects (``torch.load(weights_only=True)``) and raises a
    ``ValueError`` naming the file when it is missing, a directory, not a Lightning checkpoint,
    or corrupted/truncated.
    """

    def write(self, checkpoint: dict[str, Any], file: BinaryIO) -> None:
        """Serialize ``checkpoint`` into an open binary file (a hook: tests slow it down)."""
        torch.save(checkpoint, file)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint does not take storage_options, got {storage_options!r}"
            )
        if not _is_local(path):
            super().save_checkpoint(checkpoint, path)
            return
        target = Path(str(path).removeprefix("file://"))

        def write(temp: Path) -> None:
            with open(temp, "wb") as f:
                self.write(checkpoint, f)

        atomic_write(target, write)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError(
                f"{type(self).__name__} loads weights only (no arbitrary unpickling); got weights_only=False "
                f"for {path}. Use Lightning's TorchCheckpointIO for a trusted checkpoint that needs it."
            )
        if not _is_local(path):
            return super().load_checkpoint(path, weights_only=True)
        local = Path(str(path).removeprefix("file://"))
        return load_lightning_checkpoint(local, map_location=map_location if map_location is not None else "cpu")

