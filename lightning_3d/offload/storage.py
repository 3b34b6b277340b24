"""Chunk stores: where offloaded optimizer state lives between steps.

The optimizer cuts its state into *segments*, one per chunk of a parameter; a segment holds the
chunk's fp32 fields back to back (``exp_avg | exp_avg_sq [| master]``), so one chunk is one
contiguous read and one contiguous write. A store keeps the segments and hands them out:

* :class:`CpuChunkStore` — one flat fp32 tensor in CPU RAM (pinned when CUDA is present, so
  host-device copies of master weights are fast); :meth:`stream` yields views, nothing moves.
* :class:`FileChunkStore` — one file in a private directory (see ``paths.py``); :meth:`stream`
  reads chunk ``i + 1`` while the caller computes on chunk ``i`` and writes chunk ``i - 1``
  back at the same time, through ``window`` preallocated buffers. Only those buffers ever hold
  state in RAM: ``resident_state_bytes_peak`` reports their size.

:func:`plan_chunks` decides the layout; segment ``i`` of a store starts at element
``offsets[i]``; all state is float32.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import accumulate
from typing import Optional

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


def plan_chunks(param_groups: Sequence[dict], chunk_bytes: int,
                always_separate: bool = False) -> tuple[list[ParamSlot], list[Chunk]]:
    """Cut every parameter of ``param_groups`` into chunks of at most ``chunk_bytes`` of state
    (at least one element), of a multiple of ``ALIGN_ELEMENTS`` elements where that fits.
    ``always_separate``: an fp32 master in the store even for fp32 CPU parameters."""
    slots: list[ParamSlot] = []
    chunks: list[Chunk] = []
    for group_index, group in enumerate(param_groups):
        for p in group["params"]:
            local = local_tensor(p)
            if not local.is_floating_point() or local.is_complex() or local.is_sparse:
                raise ValueError(f"offload needs dense real floating-point parameters, got {local.dtype} "
                                 f"{local.layout}")
            if not local.is_contiguous():
                raise ValueError(f"offload needs contiguous parameters, got shape {tuple(local.shape)} "
                                 f"with strides {local.stride()}")
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
    """All segments in one CPU tensor (pinned if CUDA is available)."""

    keeps_segments = True

    def __init__(self, segment_numels: Sequence[int]) -> None:
        super().__init__(segment_numels)
        self._data: Optional[Tensor] = torch.zeros(self.total_numel, dtype=torch.float32, pin_memory=_pinned())
        self.resident_state_bytes_peak = self.nbytes

    def _segment(self, index: int) -> Tensor:
        if self._data is None:
            raise ValueError("the chunk store is closed")
        start = self.offsets[index]
        return self._data[start : start + self.segment_numels[index]]

    def stream(self, indices: Iterable[int]) -> Iterator[tuple[int, Tensor]]:
        for index in indices:
            yield index, self._segment(index)

    def read(self, index: int) -> Tensor:
        return self._segment(index).clone()

    def write(self, index: int, data: Tensor) -> None:
        self._check(index, data)
        self._segment(index).copy_(data)

    def close(self) -> None:
        self._data = None


def _bytes_of(t: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    return memoryview(t.numpy()).cast("B")


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
            raise OSError(f"offload file ended at byte {offset + done}, expected {offset + len(view)}")
        done += got


def _write_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _release(pool: ThreadPoolExecutor, directory: PrivateDirectory) -> None:
    pool.shutdown(wait=True)  # pending writes finish before their file is closed
    directory.close()


class FileChunkStore(ChunkStore):
    """Segments in one file under a private directory inside ``path``, streamed through
    ``window`` preallocated buffers of ``buffer_numel`` elements by two I/O threads.

    The file is created sparse (reads as zeros). ``path`` is checked for room first, and if
    anything fails after the private directory exists, it is removed before the error escapes.
    """

    def __init__(self, path: PathLike, segment_numels: Sequence[int], window: int = 3) -> None:
        super().__init__(segment_numels)
        if window < 2:
            raise ValueError(f"window must be >= 2 (one buffer computing, one reading), got {window}")
        check_offload_path(path, self.nbytes)
        self.window = window
        self.buffer_numel = max(self.segment_numels, default=1)
        self._buffers: list[Optional[Tensor]] = [None] * window
        self.directory = PrivateDirectory(path)
        try:
            # One reader and one writer in flight at a time; both syscalls release the GIL.
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="offload-io")
            self._finalizer = weakref.finalize(self, _release, self._pool, self.directory)
            self._fd = self.directory.create_file("optimizer_state.bin", self.nbytes)
            if hasattr(os, "posix_fadvise"):  # segments are visited in file order
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            self.directory.close()
            raise

    @property
    def file_path(self) -> str:
        return os.path.join(self.directory.path, "optimizer_state.bin")

    def _buffer(self, slot: int, numel: int) -> Tensor:
        if self._buffers[slot] is None:  # allocated on first use, then reused for every step
            self._buffers[slot] = torch.empty(self.buffer_numel, dtype=torch.float32, pin_memory=_pinned())
            allocated = sum(b.numel() for b in self._buffers if b is not None)
            self.resident_state_bytes_peak = max(self.resident_state_bytes_peak, allocated * ELEMENT_BYTES)
        return self._buffers[slot][:numel]

    def _load(self, index: int, into: Tensor) -> Tensor:
        _read_exact(self._fd, _bytes_of(into), self.offsets[index] * ELEMENT_BYTES)
        return into

    def _store(self, index: int, data: Tensor) -> None:
        _write_exact(self._fd, _bytes_of(data), self.offsets[index] * ELEMENT_BYTES)

    def _check_open(self) -> None:
        # A closed descriptor's number may already belong to another file: never touch it.
        if self.directory.closed:
            raise ValueError("the chunk store is closed")

    def stream(self, indices: Iterable[int]) -> Iterator[tuple[int, Tensor]]:
        self._check_open()
        order = list(indices)
        writes: list[Optional[Future]] = [None] * self.window  # per buffer slot: its last write
        reads: dict[int, Future] = {}

        def start_read(k: int) -> None:
            slot = k % self.window
            if writes[slot] is not None:  # the buffer is free once its write-behind is done
                writes[slot].result()
                writes[slot] = None
            buffer = self._buffer(slot, self.segment_numels[order[k]])
            reads[k] = self._pool.submit(self._load, order[k], buffer)

        try:
            if order:
                start_read(0)
            for k, index in enumerate(order):
                if k + 1 < len(order):
                    start_read(k + 1)  # read-ahead while the caller computes on chunk k
                segment = reads.pop(k).result()
                yield index, segment
                writes[k % self.window] = self._pool.submit(self._store, index, segment)  # write-behind
            for future in writes:
                if future is not None:
                    future.result()  # surface write errors; the step is durable after this
        finally:
            wait([f for f in (*reads.values(), *writes) if f is not None])

    def read(self, index: int) -> Tensor:
        self._check_open()
        return self._load(index, torch.empty(self.segment_numels[index], dtype=torch.float32))

    def write(self, index: int, data: Tensor) -> None:
        self._check(index, data)
        self._check_open()
        self._store(index, data.contiguous())

    def close(self) -> None:
        self._finalizer()
        self._buffers = [None] * self.window
