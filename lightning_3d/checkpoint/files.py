"""Checkpoint files on disk: atomic writes, durable renames, weights-only reads.

The bottom of ``lightning_3d.checkpoint``: it imports nothing from the package, so every other
module (the file formats, the checks, the writers, the exports) can build on it.

A save writes ``.<name>.tmp-<pid>`` in the target directory, fsyncs it, renames it onto
``<name>`` (atomic on POSIX within one file system) and fsyncs the directory so the rename itself
survives a power loss. The temporary name starts with a dot and does not end in ``.ckpt``, so
Lightning never takes it for a checkpoint: ``ModelCheckpoint._find_last_checkpoints`` (what
``ckpt_path="last"`` resolves through) keeps only files whose suffix is ``.ckpt`` and whose stem
starts with ``last``. Temporary files left by a killed save are removed by the next save into
the same directory. Directories (sharded checkpoints, exported models) are swapped in whole by
:func:`publish`.

Reads never unpickle arbitrary objects (:func:`load_weights_only`), and a file that is not a
whole checkpoint raises a ``ValueError`` naming it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_3d.parallel.optimizers import quantized_state_classes

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default (zip) format
_TEMP_NAME = re.compile(r"^\..+\.tmp-(\d+)$")


# ------------------------------------------------------------------------------ temporaries
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
            remove(entry)
            removed.append(entry)
    return removed


# ------------------------------------------------------------------------------ durability
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


def finish_file(file: Path) -> None:
    """Give a file written under a temporary name the usual mode and flush it to disk.

    Writers that make their own temporary file (safetensors, ``save_pretrained``) leave it 0600;
    the checkpoint should get what ``open`` would have given it under this umask."""
    os.chmod(file, 0o666 & ~_umask())
    with open(file, "rb+") as f:
        os.fsync(f.fileno())


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
        finish_file(temp)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


# ------------------------------------------------------------------------------ directories
def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def remove(path: Path) -> None:
    """Delete a file or a whole directory, whichever ``path`` is; nothing if it is absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def publish(temp: Path, path: Path) -> None:
    """Put the complete directory ``temp`` at ``path``, replacing what is there atomically."""
    if not (path.exists() or path.is_symlink()):
        os.rename(temp, path)
    elif _exchange(temp, path):
        remove(temp)  # now the previous checkpoint
    else:  # no atomic exchange: a short window in which ``path`` is absent (old one kept aside)
        old = path.with_name(f".{path.name}.old.tmp-{os.getpid()}")
        os.rename(path, old)
        os.rename(temp, path)
        remove(old)
    fsync_dir(path.parent)


def publish_into(temp: Path, path: Path) -> None:
    """Move the complete directory ``temp``'s entries into the directory ``path``, one atomic
    rename each (a file of the same name replaced, every other file of ``path`` kept), then
    remove ``temp``. For an export written beside a directory that holds other files; a
    directory ``path`` that does not exist or is empty gets :func:`publish`."""
    if not path.is_dir() or not any(path.iterdir()):
        publish(temp, path)
        return
    entries = sorted(temp.iterdir())
    for entry in entries:  # before anything moves: a file never goes onto a directory
        target = path / entry.name
        if not entry.is_dir() and target.is_dir() and not target.is_symlink():
            raise IsADirectoryError(
                errno.EISDIR, f"cannot replace a directory with the file {entry.name}", str(target)
            )
    for entry in entries:
        target = path / entry.name
        if entry.is_dir() and target.is_dir() and not target.is_symlink():
            publish_into(entry, target)
        else:
            os.replace(entry, target)
    remove(temp)
    fsync_dir(path)


def refuse_overlap(source: Path, output: Path) -> None:
    """``ValueError`` if writing ``output`` could touch the checkpoint ``source``: the same
    path (or the same file under another name), ``output`` inside a ``source`` directory, or
    ``source`` inside ``output`` (replacing that directory would delete it). Exports call it
    first, whatever ``force`` says."""
    src, out = Path(source).resolve(), Path(output).resolve()
    same = src == out or (src.exists() and out.exists() and os.path.samefile(src, out))
    if same:
        raise ValueError(
            f"output {output} is the checkpoint {source} itself; write the export elsewhere"
        )
    if src in out.parents:
        raise ValueError(
            f"output {output} is inside the checkpoint {source}; write the export outside it"
        )
    if out in src.parents:
        raise ValueError(
            f"output {output} contains the checkpoint {source}; replacing it would delete the "
            "checkpoint: write the export elsewhere"
        )


# ------------------------------------------------------------------------------ reading
def corrupted(path: Path, error: BaseException) -> ValueError:
    """The error for a file whose bytes are not a whole checkpoint."""
    return ValueError(
        f"{path}: corrupted or truncated checkpoint file ({type(error).__name__}: {error})"
    )


def check_records(path: Path) -> None:
    """Verify the zip CRC-32 of every record of a ``torch.save`` file except the tensors' data
    (``<archive>/data/<key>``, which the checkpoint's own per-tensor checksums cover): the pickle
    with the loop counters, hyperparameters and checksum records. ``torch.load`` does not check
    these CRCs, and a flipped bit there may still unpickle, into other values."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if "/data/" in info.filename:
                    continue
                with archive.open(info) as record:
                    while record.read(1 << 20):
                        pass
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as error:
        raise corrupted(path, error) from error


def load_weights_only(path: Path, mmap: bool, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)`` with errors that name the file and what was refused.
    The zip records that are not tensor data are verified first (:func:`check_records`).

    ``mmap``: tensors are read from the file on first use (zip format only)."""
    with open(path, "rb") as f:
        zipped = f.read(4) == ZIP_MAGIC
    if zipped:
        check_records(path)
    try:
        # mmap: inspecting or exporting a large file does not read every tensor up front.
        load = functools.partial(
            torch.load, path, map_location=map_location, weights_only=True, mmap=mmap and zipped
        )
        try:
            return load()
        except pickle.UnpicklingError as error:
            if "torchao.optim" not in str(error):
                raise
            # Low-bit AdamW's quantized states (parallel/optimizers.py): torchao's own tensor
            # subclasses of codes, scales and map, allowed by name; still no arbitrary object.
            with torch.serialization.safe_globals(quantized_state_classes()):
                return load()
    except pickle.UnpicklingError as error:
        if "weights only" in str(error).lower():
            # torch's message is a page of advice; keep the line that names the refused object.
            reason = next(
                (line.strip() for line in str(error).splitlines() if "WeightsUnpickler" in line), ""
            )
            raise ValueError(
                f"{path}: holds objects other than tensors and plain Python values; refusing to unpickle "
                f"them (weights_only=True): {reason.split('. Please')[0]}"
            ) from error
        raise corrupted(path, error) from error
    except Exception as error:  # torch/zip/EOF errors all mean the bytes are not a whole checkpoint
        raise corrupted(path, error) from error
