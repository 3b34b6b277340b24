"""Adam / AdamW whose state lives in CPU RAM or on NVMe, stepped on the CPU chunk by chunk.

Per parameter the optimizer keeps ``exp_avg`` and ``exp_avg_sq`` (fp32) and, when the parameter
is not an fp32 CPU tensor (bf16, or on an accelerator), an fp32 ``master`` copy of its weights.
For fp32 CPU parameters the parameter itself is the master: it is updated in place. Each
parameter is cut into chunks of at most ``chunk_bytes`` of state; a step streams the chunks of
every parameter that has a gradient through the store (``storage.py``), applies exactly
``torch.optim.Adam``'s single-tensor update to each, and copies the updated master chunk back
into the parameter. Hyperparameters are read from ``param_groups`` at every step, so LR
schedulers work as usual.

``optimizer.state`` is a live view: reading ``state[p]`` materialises that parameter's state
as full tensors (``step``, ``exp_avg``, ``exp_avg_sq`` [, ``master``]), assigning writes it into
the store. So ``state_dict()`` / ``load_state_dict()`` use torch's own format, and checkpoint
code that reads ``optimizer.state`` directly (the ZeRO engine's) sees the full state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_3d.offload.paths import PathLike
from lightning_3d.offload.storage import Chunk, ChunkStore, CpuChunkStore, FileChunkStore, ParamSlot, plan_chunks
from lightning_3d.parallel.tensor import local_tensor as _local

DEVICES = ("cpu", "nvme")
DEFAULT_CHUNK_BYTES = 16 * 2**20
_REFUSED = ("amsgrad", "maximize", "capturable", "differentiable")
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")


class OffloadedAdam(torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay=False``, L2) or AdamW with offloaded state.

    Numerically equal to ``torch.optim.Adam`` / ``AdamW`` (fp32, single-tensor path). Refuses
    ``amsgrad``, ``maximize``, ``capturable`` and ``differentiable``. Call :meth:`close` when
    done (NVMe files are also removed at garbage collection and interpreter exit).

    Example::

        opt = OffloadedAdam.from_optimizer(torch.optim.AdamW(model.parameters()), device="nvme",
                                           path="/mnt/nvme")
        loss.backward(); opt.step(); opt.zero_grad()
        opt.close()
    """

    state_dtype = torch.float32  # of the moments and masters, whatever the parameters' dtype

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, decoupled_weight_decay: bool = True, *,
                 device: str = "cpu", path: Optional[PathLike] = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 window: int = 3) -> None:
        """``params`` as for ``torch.optim.AdamW``; ``device`` "cpu" or "nvme" (then ``path`` is a
        directory on the drive); ``chunk_bytes`` of state per streamed chunk; ``window`` chunk
        buffers in RAM for "nvme"."""
        if device not in DEVICES:
            raise ValueError(f"offload device must be one of {DEVICES}, got {device!r}")
        if chunk_bytes < 12:
            raise ValueError(f"chunk_bytes must hold one element of 3 fp32 fields (12 bytes), got {chunk_bytes}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=None, capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=decoupled_weight_decay)
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        for group in self.param_groups:
            _check_group(group)
        self.device = device
        self._slots, self._chunks = plan_chunks(self.param_groups, chunk_bytes)
        self._slot_of = {id(s.param): s for s in self._slots}
        self._layout = [id(p) for g in self.param_groups for p in g["params"]]
        segments = [c.numel * self._slots[c.slot].fields for c in self._chunks]
        # Everything above only inspects; the store is the first thing that writes (and it
        # checks the path and cleans up after itself if it fails).
        self._store: ChunkStore = CpuChunkStore(segments) if device == "cpu" else FileChunkStore(path, segments, window)
        self.state = _StateView(self)  # type: ignore[assignment]
        self.closed = False

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, device: str = "cpu", path: Optional[PathLike] = None,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES, window: int = 3) -> "OffloadedAdam":
        """Wrap an existing ``torch.optim.Adam`` / ``AdamW``, sharing its ``param_groups`` dicts
        (an LR scheduler built on ``optimizer`` keeps working) and importing any state it has."""
        kind = type(optimizer)
        if kind not in (torch.optim.Adam, torch.optim.AdamW):
            raise ValueError(f"offload supports torch.optim.Adam and torch.optim.AdamW, "
                             f"got {kind.__module__}.{kind.__qualname__}")
        d = optimizer.defaults
        new = cls(optimizer.param_groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                  decoupled_weight_decay=d["decoupled_weight_decay"], device=device, path=path,
                  chunk_bytes=chunk_bytes, window=window)
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
            raise ValueError("OffloadedAdam cannot grow: add the group to the wrapped optimizer before offloading")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """One Adam(W) step for every parameter whose ``grad`` is not ``None``."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if [id(p) for g in self.param_groups for p in g["params"]] != self._layout:
            raise ValueError("param_groups changed after OffloadedAdam was built: wrap the optimizer after "
                             "anything that rewrites its parameters (e.g. the ZeRO engine's attach)")
        hyper = []  # read at every step: schedulers change "lr" between steps
        for group in self.param_groups:
            _check_group(group)
            hyper.append((float(group["lr"]), *map(float, group["betas"]), float(group["eps"]),
                          float(group["weight_decay"]), bool(group["decoupled_weight_decay"])))
        grads: dict[int, Tensor] = {}
        for i, slot in enumerate(self._slots):
            grad = slot.param.grad
            if grad is None:
                continue
            grad = _local(grad)
            shape = _local(slot.param).shape
            if grad.is_sparse or grad.shape != shape:
                raise ValueError(f"gradient must be dense and shaped like its parameter {tuple(shape)}, "
                                 f"got {tuple(grad.shape)} ({grad.layout})")
            grads[i] = grad.reshape(-1)
            slot.step += 1
        order = [c for i in grads for c in self._slots[i].chunks]
        for index, segment in self._store.stream(order):
            chunk = self._chunks[index]
            slot = self._slots[chunk.slot]
            self._update(slot, chunk, segment, grads[chunk.slot], hyper[slot.group])
        for i in grads:
            self._slots[i].master_valid = True
        return loss

    def _update(self, slot: ParamSlot, chunk: Chunk, segment: Tensor, grad_flat: Tensor, hyper: tuple) -> None:
        lr, beta1, beta2, eps, weight_decay, decoupled = hyper
        n = chunk.numel
        exp_avg, exp_avg_sq = segment[:n], segment[n : 2 * n]
        weights = _local(slot.param).view(-1)[chunk.start : chunk.start + n]
        master = segment[2 * n : 3 * n] if slot.separate_master else weights
        if slot.step == 1:  # torch starts the moments at zero on a parameter's first step
            exp_avg.zero_()
            exp_avg_sq.zero_()
        if slot.separate_master and (slot.step == 1 or not slot.master_valid):
            master.copy_(weights)
        grad = grad_flat[chunk.start : chunk.start + n].to(device="cpu", dtype=torch.float32)
        # The same operations, in the same order, as torch.optim.adam._single_tensor_adam.
        if weight_decay != 0:
            if decoupled:
                master.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(master, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1**slot.step)
        bias_correction2_sqrt = (1 - beta2**slot.step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        master.addcdiv_(exp_avg, denom, value=-step_size)
        if slot.separate_master:
            weights.copy_(master)

    # ------------------------------------------------------------------ state
    def _read_state(self, slot: ParamSlot) -> dict[str, Tensor]:
        local = _local(slot.param)
        keys = _STATE_KEYS[: 3 if slot.separate_master and slot.master_valid else 2]
        values = self._store.read_fields(slot.chunks, slot.fields)
        out: dict[str, Tensor] = {"step": torch.tensor(float(slot.step), dtype=torch.float32)}
        for key, value in zip(keys, values):
            value = value.view(local.shape)
            if isinstance(slot.param, DTensor):
                value = DTensor.from_local(value, slot.param.device_mesh, slot.param.placements, run_check=False)
            out[key] = value
        return out

    def _write_state(self, slot: ParamSlot, value: Mapping[str, Any]) -> None:
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
                raise ValueError(f"optimizer state for a parameter of {numel} elements lacks {key!r}")
            flat.append(_local(value[key]).detach().to(device="cpu", dtype=torch.float32).reshape(-1))
            if flat[-1].numel() != numel:
                raise ValueError(f"state {key!r} has {flat[-1].numel()} elements, its parameter has {numel}")
        self._store.write_fields(slot.chunks, slot.fields, flat)
        slot.step, slot.master_valid = step, has_master

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load a ``torch.optim.Adam(W)`` / ``OffloadedAdam`` state dict into the store."""
        self._check_open()
        saved_groups = state_dict["param_groups"]
        sizes, saved_sizes = ([len(g["params"]) for g in groups] for groups in (self.param_groups, saved_groups))
        if sizes != saved_sizes:
            raise ValueError(f"param groups differ: the state dict's have sizes {saved_sizes}, the optimizer's {sizes}")
        for saved in saved_groups:
            _check_group(saved)
        ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for group, saved in zip(self.param_groups, saved_groups):
            # In place: the dicts may be shared with the wrapped optimizer and its scheduler.
            group.update({k: v for k, v in saved.items() if k != "params"})
        for saved_id, p in zip(ids, params):
            self._write_state(self._slot_of[id(p)], state_dict["state"].get(saved_id, {}))

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s format: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"
        [, "master"]}}, "param_groups": [...]}``, full tensors on CPU (``DTensor`` for ``DTensor``
        parameters). ``master`` only where a separate fp32 master exists."""
        self._check_open()
        return super().state_dict()

    def close(self) -> None:
        """Release the store (NVMe: delete the files). Afterwards ``state`` is empty, and
        ``step`` / ``state_dict`` / ``load_state_dict`` raise ``ValueError``. Idempotent."""
        self._store.close()
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this OffloadedAdam is closed: its state was deleted by close()")


def _check_group(group: Mapping[str, Any]) -> None:
    for flag in _REFUSED:
        if group.get(flag):
            raise ValueError(f"offloaded Adam does not support {flag}=True (param group has {flag}={group[flag]!r})")


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
        slot.step, slot.master_valid = 0, False

    def __iter__(self) -> Iterator[Tensor]:
        return (s.param for s in self._owner._slots if s.step > 0 and not self._owner.closed)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, p: object) -> bool:
        slot = self._owner._slot_of.get(id(p))
        return slot is not None and slot.param is p and slot.step > 0 and not self._owner.closed
