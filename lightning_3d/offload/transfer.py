"""Gradients down and weights up while the CPU steps: the device side of an offloaded Adam step.

With the parameters on an accelerator, a blocking step copies each chunk's gradient to the host,
steps it, and copies the new weights back, one after the other: the link and the CPU take turns.
Here both directions run on side streams of their own and only the CPU waits:

- :class:`GradientPrefetcher` copies gradient slices (in their own dtype: bf16 where the
  parameters are bf16, half the bytes) into pinned host buffers, one *group* of slices (a
  staging buffer's worth) ahead of the one the CPU steps, on a "down" stream that first waits
  for the compute stream (where backward wrote the gradients), one such lane per device and
  dtype; before a buffer is refilled, the reader's pending work on its views is stepped;
- :class:`GradientSnapshot` (the delayed update) copies all gradients at once into pinned
  buffers kept from step to step, without the host waiting: the update's thread waits instead;
- :class:`WeightUploader` casts each stepped fp32 master into a pinned staging buffer in the
  parameter's dtype and copies it into the parameter on an "up" stream; :meth:`WeightUploader.finish`
  makes the compute stream wait for it, so the next forward reads new weights without the CPU
  waiting for the last copy.

Two staging buffers per direction, used in turn; a buffer is refilled only after the copy that
last read or wrote it has finished (its event). The numbers are those of the blocking path, bit
for bit: the same values are copied and cast by the same rules (``tests/test_offload_transfer.py``
on the CPU, ``tests/test_cuda.py`` overlapped against blocking on a GPU).

On a CPU-only machine the same classes run with plain synchronous copies (``device.type ==
"cpu"``), which is how their grouping and buffer turns are tested here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

DEFAULT_STAGE_BYTES = 32 * 2**20  # per staging buffer (two per direction)


def _groups(numels: Sequence[int], capacity: int) -> list[range]:
    """Consecutive runs of ``numels`` whose sum fits ``capacity`` (a larger one alone)."""
    out, start, used = [], 0, 0
    for i, n in enumerate(numels):
        if i > start and used + n > capacity:
            out.append(range(start, i))
            start, used = i, 0
        used += n
    if numels:
        out.append(range(start, len(numels)))
    return out


class _Lane:
    """One direction: a side stream (none on a CPU) and two staging buffers with their events."""

    def __init__(self, device: torch.device, numel: int, dtype: torch.dtype) -> None:
        self.cuda = device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(device) if self.cuda else None
        self.buffers = [torch.empty(numel, dtype=dtype, pin_memory=self.cuda) for _ in range(2)]
        self.events: list[Any] = [None, None]

    def wait(self, slot: int) -> None:
        """Block the host until the last copy through buffer ``slot`` is done."""
        event, self.events[slot] = self.events[slot], None
        if event is not None:
            event.synchronize()

    def record(self, slot: int) -> None:
        if self.cuda:
            # A waiting host thread sleeps: the CPU step needs the cores.
            event = torch.cuda.Event(blocking=True)
            event.record(self.stream)
            self.events[slot] = event

    def context(self) -> Any:
        return torch.cuda.stream(self.stream) if self.cuda else _nothing()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _OneLanePrefetcher:
    """:class:`GradientPrefetcher` for slices of one dtype on one device (one lane)."""

    def __init__(
        self, slices: Sequence[Tensor], stage_bytes: int, before_reuse: Optional[Callable[[], None]]
    ) -> None:
        self.slices = list(slices)
        device, dtype = self.slices[0].device, self.slices[0].dtype
        numels = [s.numel() for s in self.slices]
        capacity = max(max(numels), stage_bytes // dtype.itemsize)
        self.groups = _groups(numels, capacity)
        self._group_of = [g for g, run in enumerate(self.groups) for _ in run]
        self._offset = [0] * len(self.slices)
        for run in self.groups:
            used = 0
            for i in run:
                self._offset[i], used = used, used + numels[i]
        self._lane = _Lane(device, capacity, dtype)
        # Where backward wrote the gradients: read here, not inside the lane's stream context,
        # where the current stream is the lane's own.
        self._compute: Any = torch.cuda.current_stream(device) if self._lane.cuda else None
        self._before_reuse = before_reuse
        self._issued = -1  # last group whose copies were started
        self._ready = -1  # last group the host waited for
        self._started = False

    def _issue(self, group: int) -> None:
        if group >= len(self.groups):
            return
        slot = group % 2
        if group >= 2 and self._before_reuse is not None:
            self._before_reuse()  # the reader may still hold views of the group this buffer held
        self._lane.wait(slot)  # its previous group was read by the host long ago; be sure
        with self._lane.context():
            if self._lane.cuda and not self._started:
                self._lane.stream.wait_stream(self._compute)
                self._started = True
            for i in self.groups[group]:
                n = self.slices[i].numel()
                self._lane.buffers[slot][self._offset[i] : self._offset[i] + n].copy_(
                    self.slices[i], non_blocking=self._lane.cuda
                )
        self._lane.record(slot)
        self._issued = group

    def get(self, index: int) -> Tensor:
        group = self._group_of[index]
        if group < self._ready:
            raise ValueError(
                f"slice {index} belongs to group {group}, already released (at group {self._ready})"
            )
        while self._issued < group + 1 and self._issued + 1 < len(self.groups):
            self._issue(self._issued + 1)  # this group, and the next one behind it
        if group > self._ready:
            self._lane.wait(group % 2)
            self._ready = group
        n = self.slices[index].numel()
        return self._lane.buffers[group % 2][self._offset[index] : self._offset[index] + n]

    def close(self) -> None:
        for slot in range(2):
            self._lane.wait(slot)


class GradientPrefetcher:
    """Host copies of device gradient ``slices`` (1-D), a group ahead of the reader.

    Slices of each (device, dtype) go through a lane of their own (a bf16 model's fp32 norms
    next to its bf16 matrices, parameters on two devices), each read in the slices' order.
    A returned view is valid until the reader is a group further on in that lane, when its buffer
    is refilled: ``before_reuse`` (e.g. a batch's flush) runs first, for a reader that keeps views.

    Example::

        fetch = GradientPrefetcher(slices, before_reuse=batch.flush)
        for i in range(len(slices)):
            host = fetch.get(i)  # pinned, the slice's dtype
        fetch.close()
    """

    def __init__(
        self,
        slices: Sequence[Tensor],
        stage_bytes: int = DEFAULT_STAGE_BYTES,
        before_reuse: Optional[Callable[[], None]] = None,
    ) -> None:
        if not slices:
            raise ValueError("GradientPrefetcher needs at least one gradient slice")
        lanes: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        self._where: list[tuple[int, int]] = []  # slice -> (lane, index in the lane)
        for s in slices:
            members = lanes.setdefault((s.device, s.dtype), [])
            self._where.append((list(lanes).index((s.device, s.dtype)), len(members)))
            members.append(s)
        self._lanes = [
            _OneLanePrefetcher(members, stage_bytes, before_reuse) for members in lanes.values()
        ]

    @property
    def groups(self) -> list[list[range]]:
        """Each lane's groups of slices (indices within the lane)."""
        return [lane.groups for lane in self._lanes]

    def get(self, index: int) -> Tensor:
        """The host copy of slice ``index`` (in order, or revisiting the current group)."""
        lane, j = self._where[index]
        return self._lanes[lane].get(j)

    def close(self) -> None:
        """Wait for every copy still in flight (their sources may be freed after this)."""
        for lane in self._lanes:
            lane.close()


class GradientSnapshot:
    """The delayed update's own host copy of the gradients, in buffers kept from step to step.

    :meth:`take` starts every copy on the stream that wrote the gradients (the compute stream:
    non-blocking, into pinned memory, in the gradient's dtype) and returns the host tensors with a
    ``ready`` function that blocks until they are complete; the update's thread calls it before
    reading. On the compute stream, whatever writes the gradients' memory next (a ZeRO engine
    zeroing its buckets, the next backward) is ordered after the copies, and the host does not
    wait for them. The next :meth:`take` refills the same buffers: the update that read them must
    be over by then. On a CPU the copies are plain ones and ``ready`` has nothing to wait for.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, Tensor] = {}

    def take(self, grads: dict[int, Tensor]) -> tuple[dict[int, Tensor], Callable[[], None]]:
        out: dict[int, Tensor] = {}
        devices: set[torch.device] = set()
        for key, grad in grads.items():
            cuda = grad.device.type == "cuda"
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() != grad.numel() or buffer.dtype != grad.dtype:
                buffer = self._buffers[key] = torch.empty(
                    grad.numel(), dtype=grad.dtype, pin_memory=cuda
                )
            buffer.copy_(grad.reshape(-1), non_blocking=cuda)
            out[key] = buffer
            if cuda:
                devices.add(grad.device)
        events = []
        for device in devices:
            event = torch.cuda.Event(blocking=True)  # the waiting update thread sleeps
            event.record(torch.cuda.current_stream(device))
            events.append(event)

        def ready() -> None:
            for event in events:
                event.synchronize()

        return out, ready


class _UpLane:
    """The staging state of one weight dtype: two buffers filled in turn."""

    def __init__(self, device: torch.device, numel: int, dtype: torch.dtype) -> None:
        self.device = device
        self.lane = _Lane(device, numel, dtype)
        self.slot = 0
        self.used = 0
        self.joined = False  # the up stream waited for the compute stream since the last finish

    def join(self) -> None:
        """Weights are written only after the compute stream's work that reads them (backward)."""
        if not self.joined:
            self.lane.stream.wait_stream(torch.cuda.current_stream(self.device))
            self.joined = True

    @property
    def capacity(self) -> int:
        return self.lane.buffers[0].numel()

    def stage(self, n: int) -> Tensor:
        """``n`` elements of the buffer being filled, switching buffers when it is full."""
        if self.used + n > self.capacity:  # this buffer's copies go; the other one fills once free
            self.lane.record(self.slot)
            self.slot, self.used = 1 - self.slot, 0
            self.lane.wait(self.slot)
        out = self.lane.buffers[self.slot][self.used : self.used + n]
        self.used += n
        return out

    def finish(self) -> None:
        self.lane.record(self.slot)
        torch.cuda.current_stream(self.device).wait_stream(self.lane.stream)
        self.joined = False
        self.slot, self.used = 1 - self.slot, 0
        self.lane.wait(self.slot)  # the buffer filled next: its copies must be done


class WeightUploader:
    """New weights from fp32 host masters into accelerator parameters, on a side stream.

    :meth:`put` casts ``master`` into a pinned staging buffer in ``weights``' dtype and starts its
    copy into ``weights``; :meth:`finish` makes the compute stream wait for every copy started
    (the host does not wait). On a CPU ``put`` is ``weights.copy_(master)``.
    """

    def __init__(self, stage_bytes: int = DEFAULT_STAGE_BYTES) -> None:
        self.stage_bytes = stage_bytes
        self._lanes: dict[tuple[torch.device, torch.dtype], _UpLane] = {}

    def put(self, weights: Tensor, master: Tensor) -> None:
        if weights.device.type != "cuda":
            weights.copy_(master)
            return
        key, n = (weights.device, weights.dtype), master.numel()
        lane = self._lanes.get(key)
        if lane is None or n > lane.capacity:
            if lane is not None:
                lane.finish()
            lane = self._lanes[key] = _UpLane(
                weights.device, max(n, self.stage_bytes // weights.element_size()), weights.dtype
            )
        lane.join()
        stage = lane.stage(n)
        stage.copy_(master.reshape(-1))  # the cast, on the host: half the bytes cross the link
        with lane.lane.context():
            weights.reshape(-1).copy_(stage, non_blocking=True)

    def finish(self) -> None:
        """The compute stream waits for every weight copy started (the host does not)."""
        for lane in self._lanes.values():
            lane.finish()
