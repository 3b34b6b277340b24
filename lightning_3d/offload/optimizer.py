"""Adam / AdamW whose state lives in CPU RAM or on NVMe, stepped on the CPU chunk by chunk.

Per parameter the optimizer keeps ``exp_avg`` and ``exp_avg_sq`` (fp32) and, when the parameter
is not an fp32 CPU tensor (bf16, or on an accelerator), an fp32 ``master`` copy of its weights.
For fp32 CPU parameters the parameter itself is the master: it is updated in place. Each
parameter is cut into chunks of at most ``chunk_bytes`` of state; a step streams the chunks of
every parameter that has a gradient through the store (``storage.py``), applies torch's fused
CPU Adam(W) kernel to them, many chunks per call (``fused.py``), and copies the updated master
chunks back into the parameter. Hyperparameters are read from ``param_groups`` at every step, so LR
schedulers work as usual.

``optimizer.state`` is a live view: reading ``state[p]`` materialises that parameter's state
as full tensors (``step``, ``exp_avg``, ``exp_avg_sq`` [, ``master``]), assigning writes it into
the store. So ``state_dict()`` / ``load_state_dict()`` use torch's own format, and checkpoint
code that reads ``optimizer.state`` directly (the ZeRO engine's) sees the full state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_3d.offload.fused import DEFAULT_GRAD_BUFFER_BYTES, AdamHyper, FusedBatch
from lightning_3d.offload.paths import PathLike
from lightning_3d.offload.storage import (
    Chunk,
    ChunkStore,
    CpuChunkStore,
    FileChunkStore,
    ParamSlot,
    plan_chunks,
)
from lightning_3d.offload.transfer import (
    DEFAULT_STAGE_BYTES,
    GradientPrefetcher,
    GradientSnapshot,
    WeightUploader,
)
from lightning_3d.parallel.tensor import local_tensor as _local

DEVICES = ("cpu", "nvme")
DEFAULT_CHUNK_BYTES = 16 * 2**20
# NVMe: chunks in RAM at once (one stepping, the rest reading ahead / writing back).
DEFAULT_WINDOW = 3
_REFUSED = ("amsgrad", "maximize", "capturable", "differentiable")
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")


class OffloadedAdam(torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay=False``, L2) or AdamW with offloaded state.

    Bit for bit ``torch.optim.Adam`` / ``AdamW`` with ``fused=True`` on fp32 CPU tensors; equal
    to the default (unfused) path within float rounding. Refuses
    ``amsgrad``, ``maximize``, ``capturable`` and ``differentiable``. Call :meth:`close` when
    done (NVMe files are also removed at garbage collection and interpreter exit).

    Example::

        opt = OffloadedAdam.from_optimizer(torch.optim.AdamW(model.parameters()), device="nvme",
                                           path="/mnt/nvme")
        loss.backward(); opt.step(); opt.zero_grad()
        opt.close()
    """

    state_dtype = torch.float32  # of the moments and masters, whatever the parameters' dtype
    stage_bytes = DEFAULT_STAGE_BYTES  # overlap: each pinned staging buffer (two per direction)
    # overlap: where gradients are prefetched from. A CPU "lane" copies synchronously (no gain),
    # which is how the tests drive the same path without a device.
    prefetch_devices: tuple[str, ...] = ("cuda",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        decoupled_weight_decay: bool = True,
        *,
        device: str = "cpu",
        path: Optional[PathLike] = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        window: int = DEFAULT_WINDOW,
        delay_update: bool = False,
        direct_io: Union[str, bool] = "auto",
        overlap: bool = True,
    ) -> None:
        """``params`` as for ``torch.optim.AdamW``; ``device`` "cpu" or "nvme" (then ``path`` is a
        directory on the drive); ``chunk_bytes`` of state per streamed chunk; ``window`` chunk
        buffers in RAM for "nvme"; ``delay_update``: see :meth:`step` (changes the numerics);
        ``direct_io`` ("auto", True, False): "nvme" reads and writes with ``O_DIRECT``, bypassing
        the page cache (see :class:`FileChunkStore`; the numbers are the same either way);
        ``overlap`` (parameters on an accelerator): gradients come down and weights go up on side
        streams while the CPU steps (:mod:`lightning_3d.offload.transfer`); ``False`` copies in
        turn with the step. The numbers are the same either way. With ``delay_update`` and
        ``overlap`` the gradients are snapshot into pinned buffers without the host waiting
        (:class:`~lightning_3d.offload.transfer.GradientSnapshot`) and the weights go up as above;
        the update itself overlaps the next forward and backward."""
        for name, value in (("delay_update", delay_update), ("overlap", overlap)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be True or False")
        if device not in DEVICES:
            raise ValueError(f"offload device must be one of {DEVICES}, got {device!r}")
        if chunk_bytes < 12:
            raise ValueError(
                f"chunk_bytes must hold one element of 3 fp32 fields (12 bytes), got {chunk_bytes}"
            )
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=False,
            foreach=None,
            capturable=False,
            differentiable=False,
            fused=None,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        for group in self.param_groups:
            _check_group(group)
        self.device = device
        # Delayed: the update runs while the next forward reads the parameters, so it may not
        # write them in place; every parameter gets a separate master.
        self._slots, self._chunks = plan_chunks(
            self.param_groups, chunk_bytes, always_separate=delay_update
        )
        self._slot_of = {id(s.param): s for s in self._slots}
        self._layout = [id(p) for g in self.param_groups for p in g["params"]]
        segments = [c.numel * self._slots[c.slot].fields for c in self._chunks]
        # Everything above only inspects; the store is the first thing that writes (and it
        # checks the path and cleans up after itself if it fails).
        self._store: ChunkStore = (
            CpuChunkStore(segments)
            if device == "cpu"
            else FileChunkStore(path, segments, window, direct_io=direct_io)
        )
        # A streaming store steps one chunk at a time: its gradient buffer need hold one chunk.
        grad_buffer = (
            DEFAULT_GRAD_BUFFER_BYTES
            if self._store.keeps_segments
            else 4 * max((c.numel for c in self._chunks), default=1)
        )
        self.overlap = overlap
        self._uploader = WeightUploader(self.stage_bytes) if overlap else None
        self._batch = FusedBatch(
            grad_buffer,
            pinned=torch.cuda.is_available(),  # pinned: device gradients land fast
            copy_back=self._uploader.put if overlap else None,
        )
        self.delay_update = delay_update
        self._in_flight: Optional[Future] = None  # delayed: the update started by the last step()
        self._unapplied: list[int] = []  # delayed: slots whose new masters the parameters lack
        # Seconds the last finished update spent in the fused CPU Adam kernel (not in transfers,
        # waits for them or the store): the "CPU step alone" of a step's time.
        self.last_update_cpu_s: Optional[float] = None
        self._worker: Optional[ThreadPoolExecutor] = None
        if delay_update:  # the worker waits on CUDA events: on the parameters' device, not device 0
            cuda = next(
                (
                    p.device
                    for g in self.param_groups
                    for p in g["params"]
                    if p.device.type == "cuda"
                ),
                None,
            )
            self._worker = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="offload-step",
                initializer=torch.cuda.set_device if cuda is not None else None,
                initargs=(cuda,) if cuda is not None else (),
            )
        self._snapshot = GradientSnapshot() if delay_update and overlap else None
        self.state = _StateView(self)  # type: ignore[assignment]
        self.closed = False

    @classmethod
    def from_optimizer(
        cls,
        optimizer: torch.optim.Optimizer,
        device: str = "cpu",
        path: Optional[PathLike] = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        window: int = DEFAULT_WINDOW,
        delay_update: bool = False,
        direct_io: Union[str, bool] = "auto",
        overlap: bool = True,
    ) -> "OffloadedAdam":
        """Wrap an existing ``torch.optim.Adam`` / ``AdamW``, sharing its ``param_groups`` dicts
        (an LR scheduler built on ``optimizer`` keeps working) and importing any state it has."""
        kind = type(optimizer)
        if kind not in (torch.optim.Adam, torch.optim.AdamW):
            raise ValueError(
                f"offload supports torch.optim.Adam and torch.optim.AdamW, "
                f"got {kind.__module__}.{kind.__qualname__}"
            )
        d = optimizer.defaults
        new = cls(
            optimizer.param_groups,
            lr=d["lr"],
            betas=d["betas"],
            eps=d["eps"],
            weight_decay=d["weight_decay"],
            decoupled_weight_decay=d["decoupled_weight_decay"],
            device=device,
            path=path,
            chunk_bytes=chunk_bytes,
            window=window,
            delay_update=delay_update,
            direct_io=direct_io,
            overlap=overlap,
        )
        try:
            if optimizer.state:
                new.load_state_dict(optimizer.state_dict())
        except BaseException:
            new.close()
            raise
        return new

    # ------------------------------------------------------------------ properties
    @property
    def resident_state_bytes_peak(self) -> int:
        """Most bytes of optimizer state held in RAM at once during steps (NVMe: the window of
        chunk buffers; CPU: all of it). Checkpoint materialisation is not counted."""
        return self._store.resident_state_bytes_peak

    @property
    def offloaded_state_bytes(self) -> int:
        """Bytes of state (moments and separate masters) kept in the store."""
        return self._store.nbytes

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise ValueError(
                "OffloadedAdam cannot grow: add the group to the wrapped optimizer before offloading"
            )
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """One Adam(W) step for every parameter whose ``grad`` is not ``None``.

        With ``delay_update=True`` (ZeRO-Offload's one-step delayed parameter update) this call
        first waits for the update the previous call started and copies its weights into the
        parameters, then snapshots the gradients and starts their update on a background thread
        and returns: the next forward and backward overlap with the CPU step, and run on weights
        one update behind. That changes the training trajectory (not the update rule); off by
        default. :meth:`synchronize` brings the parameters up to date (e.g. before saving them).
        """
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if [id(p) for g in self.param_groups for p in g["params"]] != self._layout:
            raise ValueError(
                "param_groups changed after OffloadedAdam was built: wrap the optimizer after "
                "anything that rewrites its parameters (e.g. the ZeRO engine's attach)"
            )
        for group in self.param_groups:
            _check_group(group)
        # Read at every step: schedulers change "lr".
        hyper = [AdamHyper.of(g) for g in self.param_groups]
        grads = self._gradients()
        if self._worker is not None:
            self._wait()
            self._put_unapplied()  # overlap: going up on the side stream, beside the snapshot's way down
        for i in grads:  # counted here, before any update runs, so ``state`` never sees half a step
            self._slots[i].step += 1
        if self._worker is None:
            self._update(grads, hyper, write_weights=True)
            return loss
        # Owned copies: the caller zeroes or overwrites .grad while the update runs.
        ready = None
        if self._snapshot is not None and self._on_side_path(list(grads.values())):
            grads, ready = self._snapshot.take(grads)  # the previous update, its reader, is over
        else:
            grads = {
                i: g.to(device="cpu", dtype=torch.float32, copy=True) for i, g in grads.items()
            }
        if self._uploader is not None:
            self._uploader.finish()  # the next forward waits for the new weights, the host does not
        self._in_flight = self._worker.submit(
            self._update, grads, hyper, write_weights=False, ready=ready
        )
        self._unapplied = list(grads)
        return loss

    def _gradients(self) -> dict[int, Tensor]:
        """``{slot index: flat local gradient}`` of the parameters that have one, checked."""
        grads: dict[int, Tensor] = {}
        for i, slot in enumerate(self._slots):
            grad = slot.param.grad
            if grad is None:
                continue
            grad = _local(grad)
            shape = _local(slot.param).shape
            if grad.is_sparse or grad.shape != shape:
                raise ValueError(
                    f"gradient must be dense and shaped like its parameter {tuple(shape)}, "
                    f"got {tuple(grad.shape)} ({grad.layout})"
                )
            grads[i] = grad.reshape(-1)
        return grads

    @torch.no_grad()  # grad mode is per thread: the delayed update runs on another one
    def _update(
        self,
        grads: dict[int, Tensor],
        hyper: list[AdamHyper],
        write_weights: bool,
        ready: Optional[Callable[[], None]] = None,
    ) -> None:
        """Step the chunks of ``grads``' slots through the store; ``write_weights``: copy the new
        masters into separate-master parameters as each batch finishes; ``ready`` blocks until
        ``grads`` are complete (a snapshot's copies)."""
        if ready is not None:
            ready()
        self._batch.kernel_seconds = 0.0
        order = [c for i in grads for c in self._slots[i].chunks]
        # A store whose segments stay put (RAM) lets many chunks go to the kernel in one call; a
        # streaming store (NVMe) reuses its buffer once the caller moves on, so step each now.
        batched = self._store.keeps_segments
        slices = [
            grads[self._chunks[k].slot][
                self._chunks[k].start : self._chunks[k].start + self._chunks[k].numel
            ]
            for k in order
        ]
        fetch = self._prefetcher(slices)
        try:
            for position, (index, segment) in enumerate(self._store.stream(order)):
                chunk = self._chunks[index]
                slot = self._slots[chunk.slot]
                grad = fetch.get(position) if fetch is not None else slices[position]
                self._add(slot, chunk, segment, grad, hyper[slot.group], write_weights)
                if not batched:
                    self._batch.flush()
            self._batch.flush()
        finally:
            self._batch.discard()  # after an error: forget views into buffers the store reuses
            try:
                if fetch is not None:
                    fetch.close()
            finally:
                # Delayed: synchronize() sends them.
                if self._uploader is not None and write_weights:
                    self._uploader.finish()
        for i in grads:
            self._slots[i].master_valid = True
        self.last_update_cpu_s = self._batch.kernel_seconds

    def _prefetcher(self, slices: list[Tensor]) -> Optional[GradientPrefetcher]:
        """Gradients on an accelerator, with ``overlap``: brought down a group ahead, a lane per
        device and dtype. The batch keeps views of fp32 gradients (it casts only the others), so
        it steps what it holds before a staging buffer is refilled."""
        if not self._on_side_path(slices):
            return None
        return GradientPrefetcher(slices, self.stage_bytes, before_reuse=self._batch.flush)

    def _on_side_path(self, tensors: list[Tensor]) -> bool:
        """``overlap``, and every tensor on a device whose copies go through side streams."""
        return (
            self.overlap
            and bool(tensors)
            and all(t.device.type in self.prefetch_devices for t in tensors)
        )

    def _wait(self) -> None:
        """Delayed: let the update in flight finish (its error, if any, is raised here)."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            future.result()

    def synchronize(self) -> None:
        """Finish the delayed update in flight and copy its new weights into the parameters (a
        no-op without ``delay_update``). Call it before saving the model's weights."""
        self._wait()
        self._put_unapplied()
        if self._uploader is not None:
            self._uploader.finish()  # the next forward waits for the copies, the host does not

    def _put_unapplied(self) -> None:
        """Delayed: the last update's new weights into the parameters (with ``overlap`` the
        copies are only started: :meth:`WeightUploader.finish` orders the compute stream after them)."""
        unapplied = [i for i in self._unapplied if self._slots[i].master_valid]
        self._unapplied = []
        if not unapplied or self.closed:
            return
        order = [c for i in unapplied for c in self._slots[i].chunks]
        with torch.no_grad():
            for index, segment in self._store.stream(order):
                chunk = self._chunks[index]
                n = chunk.numel
                weights = _local(self._slots[chunk.slot].param).view(-1)[
                    chunk.start : chunk.start + n
                ]
                if self._uploader is not None:  # cast on the host, up on a side stream
                    self._uploader.put(weights, segment[2 * n : 3 * n])
                else:
                    weights.copy_(segment[2 * n : 3 * n])

    def _add(
        self,
        slot: ParamSlot,
        chunk: Chunk,
        segment: Tensor,
        grad: Tensor,
        hyper: AdamHyper,
        write_weights: bool,
    ) -> None:
        """Queue one chunk's update (``grad``: the chunk's gradient, any dtype and device);
        :class:`FusedBatch` applies torch's fused Adam(W) to it."""
        n = chunk.numel
        exp_avg, exp_avg_sq = segment[:n], segment[n : 2 * n]
        weights = _local(slot.param).view(-1)[chunk.start : chunk.start + n]
        master = segment[2 * n : 3 * n] if slot.separate_master else weights
        if slot.step == 1:  # torch starts the moments at zero on a parameter's first step
            exp_avg.zero_()
            exp_avg_sq.zero_()
        if slot.separate_master and (slot.step == 1 or not slot.master_valid):
            master.copy_(weights)
        self._batch.add(
            hyper,
            slot.step,
            master,
            grad,
            exp_avg,
            exp_avg_sq,
            weights if slot.separate_master and write_weights else None,
        )

    # ------------------------------------------------------------------ state
    def _read_state(self, slot: ParamSlot) -> dict[str, Tensor]:
        self._wait()
        local = _local(slot.param)
        keys = _STATE_KEYS[: 3 if slot.separate_master and slot.master_valid else 2]
        values = self._store.read_fields(slot.chunks, slot.fields)
        out: dict[str, Tensor] = {"step": torch.tensor(float(slot.step), dtype=torch.float32)}
        for key, value in zip(keys, values):
            value = value.view(local.shape)
            if isinstance(slot.param, DTensor):
                value = DTensor.from_local(
                    value, slot.param.device_mesh, slot.param.placements, run_check=False
                )
            out[key] = value
        return out

    def _write_state(self, slot: ParamSlot, value: Mapping[str, Any]) -> None:
        self._wait()
        step = int(float(value["step"])) if "step" in value else 0
        if step <= 0:
            slot.step, slot.master_valid = 0, False
            return
        numel = _local(slot.param).numel()
        has_master = slot.separate_master and "master" in value
        keys = _STATE_KEYS[: 3 if has_master else 2]
        flat = []
        for key in keys:
            if key not in value:
                raise ValueError(
                    f"optimizer state for a parameter of {numel} elements lacks {key!r}"
                )
            flat.append(
                _local(value[key]).detach().to(device="cpu", dtype=torch.float32).reshape(-1)
            )
            if flat[-1].numel() != numel:
                raise ValueError(
                    f"state {key!r} has {flat[-1].numel()} elements, its parameter has {numel}"
                )
        self._store.write_fields(slot.chunks, slot.fields, flat)
        slot.step, slot.master_valid = step, has_master

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load a ``torch.optim.Adam(W)`` / ``OffloadedAdam`` state dict into the store."""
        self._check_open()
        saved_groups = state_dict["param_groups"]
        sizes, saved_sizes = (
            [len(g["params"]) for g in groups] for groups in (self.param_groups, saved_groups)
        )
        if sizes != saved_sizes:
            raise ValueError(
                f"param groups differ: the state dict's have sizes {saved_sizes}, the optimizer's {sizes}"
            )
        for saved in saved_groups:
            _check_group(saved)
        ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for group, saved in zip(self.param_groups, saved_groups):
            # In place: the dicts may be shared with the wrapped optimizer and its scheduler.
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._wait()
        for saved_id, p in zip(ids, params):
            self._write_state(self._slot_of[id(p)], state_dict["state"].get(saved_id, {}))
        # Delayed: a saved master is one update ahead of the saved weights; the next step()
        # copies it into the parameters, as it would have without the interruption.
        self._unapplied = [
            i for i, slot in enumerate(self._slots) if slot.master_valid and self.delay_update
        ]

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s format: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"
        [, "master"]}}, "param_groups": [...]}``, full tensors on CPU (``DTensor`` for ``DTensor``
        parameters). ``master`` only where a separate fp32 master exists."""
        self._check_open()
        return super().state_dict()

    def close(self) -> None:
        """Release the store (NVMe: delete the files). Afterwards ``state`` is empty, and
        ``step`` / ``state_dict`` / ``load_state_dict`` raise ``ValueError``. Idempotent. A delayed
        update in flight finishes first (the parameters keep the weights they have)."""
        try:
            self._wait()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
            self._store.close()
            self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this OffloadedAdam is closed: its state was deleted by close()")


def _check_group(group: Mapping[str, Any]) -> None:
    for flag in _REFUSED:
        if group.get(flag):
            raise ValueError(
                f"offloaded Adam does not support {flag}=True (param group has {flag}={group[flag]!r})"
            )


class _StateView(MutableMapping):
    """``optimizer.state`` backed by the store: ``{param: {"step", "exp_avg", ...}}`` for every
    parameter that has state. Each read materialises full tensors; assignment writes through."""

    def __init__(self, owner: OffloadedAdam) -> None:
        self._owner = owner

    def _slot(self, p: Any) -> ParamSlot:
        slot = self._owner._slot_of.get(id(p))
        if slot is None or slot.param is not p or self._owner.closed:
            raise KeyError(p)
        return slot

    def __getitem__(self, p: Any) -> dict[str, Tensor]:
        slot = self._slot(p)
        if slot.step == 0:
            raise KeyError(p)
        return self._owner._read_state(slot)

    def __setitem__(self, p: Any, value: Mapping[str, Any]) -> None:
        self._owner._check_open()
        self._owner._write_state(self._slot(p), value)

    def __delitem__(self, p: Any) -> None:
        slot = self._slot(p)
        self._owner._wait()
        slot.step, slot.master_valid = 0, False

    def __iter__(self) -> Iterator[Tensor]:
        return (s.param for s in self._owner._slots if s.step > 0 and not self._owner.closed)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, p: object) -> bool:
        slot = self._owner._slot_of.get(id(p))
        return slot is not None and slot.param is p and slot.step > 0 and not self._owner.closed
