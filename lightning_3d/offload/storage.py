"""Chunk stores: where offloaded optimizer state lives between steps.

The optimizer cuts its state into *segments*, one per chunk of a parameter; a segment holds the
chunk's fp32 fields back to back (``exp_avg | exp_avg_sq [| master]``), so one chunk is one
contiguous read and one contiguous write. A store keeps the segments and hands them out:

* :class:`CpuChunkStore` — fp32 blocks of at most 256 MiB in CPU RAM (pinned when CUDA is
  present, so host-device copies of master weights are fast, and in blocks so that the pinned
  allocator's power-of-two rounding costs at most one block); :meth:`stream` yields views,
  nothing moves.
* :class:`FileChunkStore` — one file in a private directory (see ``paths.py``); :meth:`stream`
  reads chunks ``i + 1 .. i + window - 1`` on a reader thread while the caller computes on
  chunk ``i`` and a writer thread writes chunk ``i - 1`` back, through ``window`` preallocated
  buffers. Only those buffers hold state in RAM (``resident_state_bytes_peak``
  reports their size); with direct I/O (``O_DIRECT``, where the file system allows it) not even
  the page cache keeps a copy.

:func:`plan_chunks` decides the layout; segment ``i`` of a store starts at element
``offsets[i]``; all state is float32.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import weakref
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import accumulate
from typing import Optional, Union

import torch
from torch import Tensor

from lightning_3d.offload.paths import PathLike, PrivateDirectory, check_offload_path
from lightning_3d.parallel.tensor import local_tensor

ELEMENT_BYTES = 4  # float32
# Chunks of at least this many elements are cut at multiples of it (64 bytes, a cache line).
# torch's fused CPU Adam splits a tensor across threads and SIMD lanes in such units and steps a
# ragged end element by element, which rounds differently; aligned chunks are split exactly
# where the whole parameter would be, so a chunked step equals a whole-tensor step bit for bit.
ALIGN_ELEMENTS = 16
# O_DIRECT wants buffers, file offsets and lengths at multiples of the device's logical block
# size: 512 or 4096 bytes on today's drives, so 4096 serves both.
DIRECT_IO_ALIGNMENT = 4096
# How the OS or a file system says "no O_DIRECT here" (tmpfs before Linux 6.6: EINVAL at open).
_REFUSED_ERRNOS = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
# The CPU store's blocks: a power of two, so CUDA's pinned allocator rounds none of the full ones
# up; 256 MiB keeps the packing's slack (under one 16 MiB segment) small and the count of
# blocks (and host allocations) at 4 a GiB of state.
PINNED_BLOCK_BYTES = 256 * 2**20

_log = logging.getLogger(__name__)


@dataclass(eq=False)
class ParamSlot:
    """One parameter's place in a store: its chunks' segments, and its Adam step count."""

    param: Tensor
    group: int
    separate_master: bool  # False: the (fp32 CPU) parameter is its own master
    chunks: range  # consecutive chunk (= segment) indices
    step: int = 0  # 0: no state yet (torch creates state at a parameter's first step)
    master_valid: bool = False

    @property
    def fields(self) -> int:
        return 3 if self.separate_master else 2


@dataclass(frozen=True)
class Chunk:
    slot: int  # index of its ParamSlot
    start: int  # element offset inside the parameter's (local) data
    numel: int


def plan_chunks(
    param_groups: Sequence[dict], chunk_bytes: int, always_separate: bool = False
) -> tuple[list[ParamSlot], list[Chunk]]:
    """Cut every parameter of ``param_groups`` into chunks of at most ``chunk_bytes`` of state
    (at least one element), of a multiple of ``ALIGN_ELEMENTS`` elements where that fits.
    ``always_separate``: an fp32 master in the store even for fp32 CPU parameters."""
    slots: list[ParamSlot] = []
    chunks: list[Chunk] = []
    for group_index, group in enumerate(param_groups):
        for p in group["params"]:
            local = local_tensor(p)
            if not local.is_floating_point() or local.is_complex() or local.is_sparse:
                raise ValueError(
                    f"offload needs dense real floating-point parameters, got {local.dtype} "
                    f"{local.layout}"
                )
            if not local.is_contiguous():
                raise ValueError(
                    f"offload needs contiguous parameters, got shape {tuple(local.shape)} "
                    f"with strides {local.stride()}"
                )
            separate = always_separate or local.dtype != torch.float32 or local.device.type != "cpu"
            per_chunk = max(1, chunk_bytes // (ELEMENT_BYTES * (3 if separate else 2)))
            if per_chunk >= ALIGN_ELEMENTS:
                per_chunk -= per_chunk % ALIGN_ELEMENTS
            first = len(chunks)
            for start in range(0, local.numel(), per_chunk):
                chunks.append(Chunk(len(slots), start, min(per_chunk, local.numel() - start)))
            slots.append(ParamSlot(p, group_index, separate, range(first, len(chunks))))
    return slots, chunks


def _pinned() -> bool:
    return torch.cuda.is_available()


class ChunkStore:
    """fp32 segments addressed by index. Subclasses decide where the bytes live."""

    # True: a segment yielded by stream() stays valid (and is kept) after the caller moves on,
    # so the caller may gather many before computing; False: only until the next one is asked for.
    keeps_segments = False

    def __init__(self, segment_numels: Sequence[int]) -> None:
        if any(n <= 0 for n in segment_numels):
            raise ValueError(f"segment sizes must be positive, got {list(segment_numels)}")
        self.segment_numels = list(segment_numels)
        self.offsets = [0, *accumulate(self.segment_numels)][:-1] if self.segment_numels else []
        self.total_numel = sum(self.segment_numels)
        self.resident_state_bytes_peak = 0

    @property
    def nbytes(self) -> int:
        """Bytes of state the store holds (in RAM or on disk)."""
        return self.total_numel * ELEMENT_BYTES

    def stream(self, indices: Iterable[int]) -> Iterator[tuple[int, Tensor]]:
        """Yield ``(index, segment)`` in order; what the caller writes into a segment is kept."""
        raise NotImplementedError

    def read(self, index: int) -> Tensor:
        """A copy of segment ``index`` (for checkpoints)."""
        raise NotImplementedError

    def write(self, index: int, data: Tensor) -> None:
        """Overwrite segment ``index`` with ``data`` (1-D float32, its exact size)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the storage. Idempotent."""

    def read_fields(self, indices: Sequence[int], fields: int) -> list[Tensor]:
        """Consecutive segments of one parameter, each ``fields`` equal parts back to back,
        joined field by field: ``fields`` flat tensors (for checkpoints)."""
        parts = [self.read(i).view(fields, -1) for i in indices]
        return [torch.cat([part[f] for part in parts]) for f in range(fields)]

    def write_fields(self, indices: Sequence[int], fields: int, values: Sequence[Tensor]) -> None:
        """Inverse of :meth:`read_fields`; fields beyond ``len(values)`` are written as zeros."""
        offset = 0
        for index in indices:
            n = self.segment_numels[index] // fields
            segment = torch.zeros(fields, n, dtype=torch.float32)
            for f, value in enumerate(values):
                segment[f] = value[offset : offset + n]
            self.write(index, segment.view(-1))
            offset += n

    def _check(self, index: int, data: Tensor) -> None:
        if data.dtype != torch.float32 or data.numel() != self.segment_numels[index]:
            raise ValueError(
                f"segment {index} holds {self.segment_numels[index]} float32 values, "
                f"got {data.numel()} {data.dtype}"
            )


class CpuChunkStore(ChunkStore):
    """Segments in CPU tensors of at most ``block_bytes`` each (pinned if CUDA is available).

    Why blocks: CUDA's caching host allocator rounds every pinned allocation up to a power of
    two, so the whole state as one tensor would pin up to twice its size (80 GB of state asks
    for 128 GiB). Segments are packed in order into blocks of ``block_bytes`` (a power of two),
    so full blocks pin exactly their size and only the last one is rounded up:
    :attr:`pinned_bytes` is what the allocator holds, :func:`pinned_bytes` what the planner
    counts."""

    keeps_segments = True

    def __init__(
        self, segment_numels: Sequence[int], block_bytes: int = PINNED_BLOCK_BYTES
    ) -> None:
        super().__init__(segment_numels)
        pinned = _pinned()
        self._where, sizes = _pack(self.segment_numels, block_bytes // ELEMENT_BYTES)
        # Not zero-filled (12 bytes a parameter, seconds at billions): the optimizer writes every
        # field of a parameter at its first step or load, and reads none before.
        self._blocks: Optional[list[Tensor]] = [
            torch.empty(n, dtype=torch.float32, pin_memory=pinned) for n in sizes
        ]
        self.pinned_bytes = sum(_power_of_two(n * ELEMENT_BYTES) for n in sizes) if pinned else 0
        self.resident_state_bytes_peak = self.nbytes

    def _segment(self, index: int) -> Tensor:
        if self._blocks is None:
            raise ValueError("the chunk store is closed")
        block, start = self._where[index]
        return self._blocks[block][start : start + self.segment_numels[index]]

    def stream(self, indices: Iterable[int]) -> Iterator[tuple[int, Tensor]]:
        for index in indices:
            yield index, self._segment(index)

    def read(self, index: int) -> Tensor:
        return self._segment(index).clone()

    def write(self, index: int, data: Tensor) -> None:
        self._check(index, data)
        self._segment(index).copy_(data)

    def close(self) -> None:
        self._blocks = None


def _pack(numels: Sequence[int], capacity: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Segments of ``numels`` in order into blocks of at most ``capacity`` elements (a larger
    segment gets a block of its own): each segment's ``(block, start)``, and each block's size."""
    where: list[tuple[int, int]] = []
    sizes: list[int] = []
    for n in numels:
        if not sizes or sizes[-1] + n > capacity:
            sizes.append(0)
        where.append((len(sizes) - 1, sizes[-1]))
        sizes[-1] += n
    return where, sizes


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def pinned_bytes(state_bytes: float, block_bytes: int = PINNED_BLOCK_BYTES) -> float:
    """Pinned host bytes of a CPU store holding ``state_bytes``: whole blocks, then the rest
    rounded up to a power of two, as CUDA's host allocator pins it (the packing's slack, under
    one segment a block, not counted)."""
    full, rest = divmod(int(state_bytes), block_bytes)
    return float(full * block_bytes + (_power_of_two(rest) if rest else 0))


def _bytes_of(t: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    return memoryview(t.numpy()).cast("B")


def _aligned_empty(nbytes: int, alignment: int, pinned: bool = False) -> Tensor:
    """An uninitialised float32 tensor of ``nbytes`` whose first byte sits at a multiple of
    ``alignment`` (over-allocated by ``alignment`` bytes and sliced), as ``O_DIRECT`` needs."""
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pinned)
    skip = -raw.data_ptr() % alignment
    return raw[skip : skip + nbytes].view(torch.float32)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _read_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):  # straight into the buffer
            got = os.preadv(fd, [view[done:]], offset + done)
        else:
            data = os.pread(fd, len(view) - done, offset + done)
            got = len(data)
            view[done : done + got] = data
        if got == 0:
            raise OSError(
                f"offload file ended at byte {offset + done}, expected {offset + len(view)}"
            )
        done += got


def _write_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _release(pools: tuple[ThreadPoolExecutor, ...], directory: PrivateDirectory) -> None:
    for pool in pools:
        pool.shutdown(wait=True)  # pending writes finish before their file is closed
    directory.close()


def _open_direct(directory: PrivateDirectory, name: str, alignment: int) -> int:
    """``name`` opened once more with ``O_DIRECT``, after one aligned read and write of its
    first block through it (some file systems accept the flag and refuse the I/O); ``OSError``
    if the OS or the file system refuses."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        raise OSError(errno.EOPNOTSUPP, f"{sys.platform} has no O_DIRECT")
    fd = directory.reopen(name, os.O_RDWR | flag)
    try:
        probe = _bytes_of(_aligned_empty(alignment, alignment))
        _read_exact(fd, probe, 0)  # the file is new and sparse: zeros, written back unchanged
        _write_exact(fd, probe, 0)
    except BaseException:
        directory.close_file(fd)
        raise
    return fd


class FileChunkStore(ChunkStore):
    """Segments in one file under a private directory inside ``path``, streamed through
    ``window`` preallocated buffers by one reader and one writer thread: while the caller
    computes on segment ``k``, the writer writes ``k - 1`` back and the reader fills the other
    buffers with ``k + 1 .. k + window - 1``, each as soon as its buffer's write-back is done.

    ``direct_io`` (``"auto"``, ``True``, ``False``): with direct I/O the file is read and written
    with ``O_DIRECT``, bypassing the page cache. Buffered, every byte of state streamed also
    lands in the kernel's page cache, so a step that streams N bytes of state through a few
    buffers can still grow host RAM use by N (reclaimable, but it evicts other data and is not
    counted in RSS); direct, host RAM holds only the window. The numbers are identical either
    way. Direct I/O needs buffers and file offsets at multiples of :data:`DIRECT_IO_ALIGNMENT`
    bytes, so each segment starts at such an offset in the file (padding up to
    ``DIRECT_IO_ALIGNMENT - 4`` bytes per segment: ``file_bytes`` may exceed ``nbytes``).
    ``"auto"`` probes the file system when the file is created (Linux only; tmpfs before Linux
    6.6 and some network or FUSE file systems refuse it) and falls back to buffered I/O with
    one ``INFO`` log line; ``True`` raises ``ValueError`` where it is refused. :attr:`direct_io`
    tells which is in effect.

    The file is created sparse (reads as zeros). ``path`` is checked for room first, and if
    anything fails after the private directory exists, it is removed before the error escapes.

    Example::

        store = FileChunkStore("/mnt/nvme", [4096, 1000], direct_io="auto")
        for index, segment in store.stream([0, 1]):
            segment.add_(1)   # written back in the background
        store.close()
    """

    FILE_NAME = "optimizer_state.bin"

    def __init__(
        self,
        path: PathLike,
        segment_numels: Sequence[int],
        window: int = 3,
        direct_io: Union[str, bool] = "auto",
    ) -> None:
        super().__init__(segment_numels)
        if window < 2:
            raise ValueError(
                f"window must be >= 2 (one buffer computing, one reading), got {window}"
            )
        if direct_io != "auto" and not isinstance(direct_io, bool):
            raise ValueError(f"direct_io must be 'auto', True or False, got {direct_io!r}")
        want_direct = direct_io is not False and self.total_numel > 0
        padded = self._layout(DIRECT_IO_ALIGNMENT if want_direct else ELEMENT_BYTES)
        check_offload_path(path, self.nbytes)
        if padded > self.nbytes:  # direct I/O's padding takes disk space too
            check_offload_path(path, padded)
        self.window = window
        self._buffers: list[Optional[Tensor]] = [None] * window
        self.directory = PrivateDirectory(path)
        try:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-read")
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-write")
            self._finalizer = weakref.finalize(
                self, _release, (self._reader, self._writer), self.directory
            )
            self._fd = self.directory.create_file(self.FILE_NAME, padded)
            if want_direct:
                self._open_direct(path, direct_io)
            if not self.direct_io:
                self._layout(ELEMENT_BYTES)
                os.ftruncate(self._fd, self.file_bytes)
                if hasattr(os, "posix_fadvise"):  # segments are visited in file order
                    os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            self.directory.close()
            raise

    def _layout(self, alignment: int) -> int:
        """Place segment ``i`` at byte ``file_offsets[i]``, a multiple of ``alignment``, and
        move ``io_bytes[i]`` (its size rounded up to ``alignment``) per read or write; returns
        the file's size."""
        self.alignment = alignment
        self.direct_io = alignment != ELEMENT_BYTES
        self.io_bytes = [_round_up(n * ELEMENT_BYTES, alignment) for n in self.segment_numels]
        self.file_offsets = [0, *accumulate(self.io_bytes)][:-1] if self.io_bytes else []
        self.file_bytes = sum(self.io_bytes)
        self.buffer_numel = max(self.io_bytes, default=ELEMENT_BYTES) // ELEMENT_BYTES
        return self.file_bytes

    def _open_direct(self, path: PathLike, direct_io: Union[str, bool]) -> None:
        """Switch the store's I/O to an ``O_DIRECT`` descriptor, or record that it stays buffered."""
        buffered = self._fd
        try:
            self._fd = _open_direct(self.directory, self.FILE_NAME, DIRECT_IO_ALIGNMENT)
            self.directory.close_file(buffered)  # every read and write goes through the direct one
        except OSError as error:
            if error.errno not in _REFUSED_ERRNOS:
                raise
            if direct_io is True:
                raise ValueError(
                    f"direct_io=True, but the file system of offload path {os.fspath(path)!r} "
                    f"refuses O_DIRECT: {error}"
                ) from error
            _log.info(
                "offload path %r refuses O_DIRECT (%s): optimizer state goes through the page cache",
                os.fspath(path),
                error,
            )
            self.direct_io = False

    @property
    def file_path(self) -> str:
        return os.path.join(self.directory.path, self.FILE_NAME)

    def _new_buffer(self, numel: int, pinned: bool = False) -> Tensor:
        if self.direct_io:
            return _aligned_empty(numel * ELEMENT_BYTES, self.alignment, pinned)
        return torch.empty(numel, dtype=torch.float32, pin_memory=pinned)

    def _buffer(self, slot: int) -> Tensor:
        if self._buffers[slot] is None:  # allocated on first use, then reused for every step
            self._buffers[slot] = self._new_buffer(self.buffer_numel, pinned=_pinned())
            allocated = sum(b.numel() for b in self._buffers if b is not None)
            self.resident_state_bytes_peak = max(
                self.resident_state_bytes_peak, allocated * ELEMENT_BYTES
            )
        return self._buffers[slot]

    def _load(self, index: int, buffer: Tensor) -> Tensor:
        """Read segment ``index`` into the front of ``buffer``; returns the segment's view."""
        _read_exact(self._fd, _bytes_of(buffer)[: self.io_bytes[index]], self.file_offsets[index])
        return buffer[: self.segment_numels[index]]

    def _store(self, index: int, buffer: Tensor) -> None:
        """Write segment ``index`` from the front of ``buffer`` (with its padding, if any)."""
        _write_exact(self._fd, _bytes_of(buffer)[: self.io_bytes[index]], self.file_offsets[index])

    def _load_after(self, pending: Optional[Future], index: int, buffer: Tensor) -> Tensor:
        if pending is not None:  # the buffer is free once its write-behind is done
            pending.result()
        return self._load(index, buffer)

    def _check_open(self) -> None:
        # A closed descriptor's number may already belong to another file: never touch it.
        if self.directory.closed:
            raise ValueError("the chunk store is closed")

    def stream(self, indices: Iterable[int]) -> Iterator[tuple[int, Tensor]]:
        self._check_open()
        order = list(indices)
        if len(set(order)) != len(order):  # a repeat could be read before its write-behind lands
            raise ValueError(f"stream() visits each segment once, got indices {order}")
        # Every buffer but the caller's is reading ahead: a read queued behind a buffer's write-back
        # starts (on the reader thread) the moment that write ends, not when the caller next asks.
        ahead = self.window - 1
        writes: list[Optional[Future]] = [None] * self.window  # per buffer slot: its last write
        reads: dict[int, Future] = {}
        started = 0
        try:
            for k, index in enumerate(order):
                while started < min(len(order), k + 1 + ahead):  # read-ahead, never blocking here
                    slot = started % self.window
                    reads[started] = self._reader.submit(
                        self._load_after, writes[slot], order[started], self._buffer(slot)
                    )
                    writes[slot] = None  # now awaited by that read
                    started += 1
                segment = reads.pop(k).result()
                yield index, segment
                writes[k % self.window] = self._writer.submit(
                    self._store, index, self._buffers[k % self.window]
                )
            for future in writes:
                if future is not None:
                    future.result()  # surface write errors; the step is durable after this
        finally:
            wait([f for f in (*reads.values(), *writes) if f is not None])

    def read(self, index: int) -> Tensor:
        self._check_open()
        return self._load(index, self._new_buffer(self.io_bytes[index] // ELEMENT_BYTES))

    def write(self, index: int, data: Tensor) -> None:
        self._check(index, data)
        self._check_open()
        if not self.direct_io:
            self._store(index, data.contiguous())
            return
        buffer = self._new_buffer(self.io_bytes[index] // ELEMENT_BYTES)
        buffer[: data.numel()].copy_(data)
        buffer[data.numel() :].zero_()  # the padding: deterministic file contents
        self._store(index, buffer)

    def close(self) -> None:
        self._finalizer()
        self._buffers = [None] * self.window
