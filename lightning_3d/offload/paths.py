"""Where NVMe-offloaded optimizer state may be written, and making sure it goes away again.

Two rules, both checked before the first byte is written:

* the offload ``path`` must be an existing, writable directory whose filesystem has room for
  all of the state (:func:`check_offload_path`);
* the state lives in a *private* directory created inside ``path`` (mode ``0o700``, files
  ``0o600``, so other users on a shared workstation cannot read the model's optimizer state),
  removed with its files on :meth:`PrivateDirectory.close`, when the owner is garbage
  collected, and at interpreter exit (``weakref.finalize``). A process killed outright (SIGKILL,
  out of memory) cannot clean up: its directory is named after the host and process id, and the
  next private directory made in the same ``path`` removes those of dead processes of this host
  (:func:`remove_stale`).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import weakref
from typing import Optional, Union

PathLike = Union[str, "os.PathLike[str]"]

DIR_MODE = 0o700
FILE_MODE = 0o600
DIR_PREFIX = "lightning3d-offload-"


def check_offload_path(path: Optional[PathLike], needed_bytes: int) -> str:
    """Raise ``ValueError`` unless ``path`` can hold ``needed_bytes`` of offloaded state.

    Returns the absolute path. Nothing is created or written.

    Example::

        check_offload_path("/mnt/nvme", needed_bytes=12 * 2**30)
    """
    if path is None:
        raise ValueError(
            "offload device 'nvme' needs a path: a directory on the NVMe drive, got path=None"
        )
    if needed_bytes < 0:
        raise ValueError(f"needed_bytes must be >= 0, got {needed_bytes}")
    if not os.fspath(path).strip():  # abspath('') is the working directory: never what was meant
        raise ValueError(
            f"offload path {os.fspath(path)!r} is empty: give a directory on the NVMe drive "
            "(offload.path=/mnt/nvme), or leave it unset for the default"
        )
    text = os.path.abspath(os.fspath(path))
    if not os.path.exists(text):
        raise ValueError(f"offload path {text!r} does not exist")
    if not os.path.isdir(text):
        raise ValueError(f"offload path {text!r} is not a directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise ValueError(f"offload path {text!r} is not writable by this process")
    free = shutil.disk_usage(text).free
    if free < needed_bytes:
        raise ValueError(
            f"offload path {text!r} has {free} bytes free, the optimizer state needs {needed_bytes} bytes"
        )
    return text


def _remove(directory: str, fds: list[int]) -> None:
    """Close the open files and delete the directory tree (idempotent)."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass
    shutil.rmtree(directory, ignore_errors=True)


def _owner_prefix(host: str, pid: int) -> str:
    return f"{DIR_PREFIX}{host}-{pid}-"


def remove_stale(parent: PathLike) -> list[str]:
    """Remove the private directories in ``parent`` left by processes of this host that no
    longer exist (killed before they could clean up); returns the removed paths. Directories of
    live processes, of other hosts, or not named by this module are left alone."""
    host = socket.gethostname()
    pattern = re.compile(rf"^{re.escape(DIR_PREFIX + host)}-(\d+)-")
    removed = []
    for name in os.listdir(parent):
        match = pattern.match(name)
        if match and not _alive(int(match.group(1))):
            path = os.path.join(os.fspath(parent), name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove_owned(parent: PathLike, pids: "list[int]") -> list[str]:
    """Remove the private directories in ``parent`` made on this host by the processes ``pids``
    (a launcher's ranks, once it has reaped them); returns the removed paths. Used by the
    process that outlives them, as a SIGKILLed rank cannot clean up."""
    host = socket.gethostname()
    prefixes = tuple(_owner_prefix(host, pid) for pid in pids)
    removed = []
    for name in os.listdir(parent):
        if prefixes and name.startswith(prefixes):
            path = os.path.join(os.fspath(parent), name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class PrivateDirectory:
    """A fresh ``0o700`` directory inside ``parent``, deleted with its files when closed,
    garbage collected, or at interpreter exit.

    Example::

        scratch = PrivateDirectory("/mnt/nvme")
        fd = scratch.create_file("state.bin", nbytes=2**20)
        ...
        scratch.close()   # the directory and state.bin are gone
    """

    def __init__(self, parent: PathLike) -> None:
        remove_stale(parent)
        # mkdtemp creates the directory with mode 0o700 atomically (no window where it is open).
        prefix = _owner_prefix(socket.gethostname(), os.getpid())
        self.path = tempfile.mkdtemp(prefix=prefix, dir=os.fspath(parent))
        self._fds: list[int] = []
        self._finalizer = weakref.finalize(self, _remove, self.path, self._fds)
        os.chmod(self.path, DIR_MODE)

    def create_file(self, name: str, nbytes: int) -> int:
        """Create ``name`` (mode ``0o600``, ``nbytes`` long, sparse) and return its open descriptor."""
        if self.closed:
            raise ValueError(f"private directory {self.path!r} is closed")
        if os.sep in name or name in ("", ".", ".."):
            raise ValueError(f"file name must be a plain name, got {name!r}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(os.path.join(self.path, name), flags, FILE_MODE)
        self._fds.append(fd)  # from here on, close() also closes it
        os.fchmod(fd, FILE_MODE)  # the umask may only have removed bits; state it explicitly
        os.ftruncate(fd, nbytes)
        return fd

    def reopen(self, name: str, flags: int) -> int:
        """Open ``name`` (made by :meth:`create_file`) once more with ``flags`` (e.g. ``os.O_RDWR |
        os.O_DIRECT``) and return the new descriptor, closed with the directory; ``OSError`` if
        the OS or file system refuses the flags."""
        if self.closed:
            raise ValueError(f"private directory {self.path!r} is closed")
        if os.sep in name or name in ("", ".", ".."):
            raise ValueError(f"file name must be a plain name, got {name!r}")
        fd = os.open(os.path.join(self.path, name), flags | getattr(os, "O_CLOEXEC", 0))
        self._fds.append(fd)
        return fd

    def close_file(self, fd: int) -> None:
        """Close ``fd``, one of this directory's descriptors, now rather than with the directory
        (a number closed behind the directory's back could be reused by another file, which
        :meth:`close` would then close)."""
        if fd not in self._fds:
            raise ValueError(f"descriptor {fd} is not open in private directory {self.path!r}")
        self._fds.remove(fd)
        os.close(fd)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Close the files and remove the directory. Safe to call more than once."""
        self._finalizer()
