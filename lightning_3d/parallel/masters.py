"""fp32 master weights for a low-precision module under ZeRO 0-2: when, and what it costs.

The ZeRO paper's memory formula assumes mixed-precision Adam: 2 bytes of bf16 (fp16) weight and
2 of gradient a parameter on every rank, and 12 bytes of fp32 master weight, momentum and
variance, sharded from stage 1 on (stage 0 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N).
Lightning's ``precision="bf16-true"`` converts the module to bf16; the flat-bucket engine
(``zero.py``) then keeps bf16 buckets and, for each rank's slice, an fp32 master that the
optimizer steps and that is rounded back into the bucket after every step. This module decides
when the engine does so (:func:`master_options`), refuses the combinations it was not built for
(:func:`refuse_master_combinations`), and counts the bytes it holds (:func:`zero_state_bytes`),
from the tensors themselves, for the tests and the bench.

With an offload device (``offload="cpu"`` / ``"nvme"``) the masters and their fp32 gradients
live in host memory instead: ZeRO-Offload's split, 2 bytes a parameter of bf16 weight on the
device plus a few buckets of gradient staging, and 4 + 4 bytes of master and gradient (stage 0;
/N from stage 1) in host memory beside the offloaded optimizer's 8 of moments (on the drive
under ``"nvme"``), which steps the host masters in place.

Under ``bf16-mixed`` nothing changes: the module's weights are fp32 and autocast computes in
bf16, so there is nothing to keep a master of (16Ψ at every stage below 3, 4Ψ of it in fp32
gradients); ``bf16-true`` is how to ask for the paper's memory (docs/memory.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_3d.parallel.tensor import local_tensor

if TYPE_CHECKING:
    from lightning_3d.parallel.zero import ZeroDataParallel

MASTER_DTYPE = torch.float32
# Lightning's precision names under which the module itself is converted to a low precision.
LOW_PRECISION_MODULES = ("bf16-true", "16-true")


def master_options(optimizer: torch.optim.Optimizer, plan: Any) -> dict[str, Any]:
    """``ZeroDataParallel`` keywords for ``optimizer`` under ``plan`` (the ``zero`` group's):
    ``defer_reduce`` as given, and fp32 masters where the
    ``zero`` group asks for them and the optimizer trains parameters of a lower precision; with
    an offload device, in host memory (``master_device="cpu"``), where ``OffloadedAdam`` steps
    them in place. An
    optimizer over fp32 parameters (``bf16-mixed``, ``32-true``) gets none, so one rank at stage 0
    keeps its no-copy pass-through."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    low = any(p.is_floating_point() and p.element_size() < 4 for p in params)
    deferred = {"defer_reduce": plan.zero.defer_reduce}
    if not (plan.zero.master_weights and low):
        return deferred
    host = {} if plan.offload.device == "none" else {"master_device": "cpu"}
    return {**deferred, "master_dtype": MASTER_DTYPE, "grad_dtype": plan.zero.grad_dtype, **host}


def refuse_master_combinations(plan: Any, precision: str) -> None:
    """``ValueError`` before any rewrite when fp32 masters would meet what they were not built
    and tested with. With an offload device (host masters): the delayed update (its worker
    would step the masters the engine rounds into the weights) and ZeRO-2's deferred reduction
    (host masters reduce every micro-batch). ``zero_master_weights=False`` runs them as before
    (the offloaded optimizer then keeps the masters in its store). Both checkpoint formats save
    the masters as the model's weights."""
    layout = plan.layout
    if not (plan.zero.master_weights and str(precision) in LOW_PRECISION_MODULES):
        return
    if layout.zero_stage == 3:
        return
    if plan.offload.device != "none":
        for name, value in (
            ("offload_delay_update", plan.offload.delay_update),
            ("zero2_defer_reduce", plan.zero.defer_reduce),
        ):
            if value:
                raise ValueError(
                    f"precision={precision!r} with offload={plan.offload.device!r} at "
                    f"zero_stage={layout.zero_stage} keeps fp32 masters and gradients in host "
                    f"memory (zero_master_weights=True), which do not support {name}=True: "
                    f"use zero_master_weights=False (masters in the offload store, bf16 "
                    f"gradients on the device) or {name}=False"
                )


class HostLanding:
    """Reduced gradient parts on their way to the host accumulators of ZeRO-Offload's split,
    off the compute stream.

    On a GPU a plain ``host.add_(reduced.cpu())`` inside backward would stop the host until the
    reduction and the copy finished, once a bucket, and the device would run out of queued work.
    Here each part is copied into one of ``slots`` pinned buffers on a side stream
    (``non_blocking``, after the compute stream's work on it; ``record_stream`` keeps its device
    memory until the copy is done) and only added into its fp32 accumulator when its buffer is
    needed again, or at :meth:`finish` (end of backward, before the optimizer reads the
    accumulators): by then the copy has usually long finished. Parts land in the order they
    were sent. On a CPU the same order, with plain buffers and synchronous copies."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, slots: int) -> None:
        cuda = device.type == "cuda"
        self._buffers = [
            torch.empty(numel, dtype=dtype, pin_memory=cuda) for _ in range(max(slots, 1))
        ]
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._pending: list[tuple[Tensor, Tensor, Any, bool]] = []
        self._next = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (pinned host memory on a GPU)."""
        return sum(b.nbytes for b in self._buffers)

    def send(self, reduced: Tensor, host: Tensor, fresh: bool) -> None:
        """Copy ``reduced`` (on the device) towards ``host`` (fp32, host memory): it replaces
        ``host`` (``fresh``) or adds to it, once landed."""
        if len(self._pending) == len(self._buffers):
            self._land_oldest()
        buffer = self._buffers[self._next][: reduced.numel()]
        self._next = (self._next + 1) % len(self._buffers)
        event = None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(reduced.device))
            with torch.cuda.stream(self._stream):
                buffer.copy_(reduced, non_blocking=True)
            reduced.record_stream(self._stream)
            event = self._stream.record_event()
        else:
            buffer.copy_(reduced)
        self._pending.append((host, buffer, event, fresh))

    def _land_oldest(self) -> None:
        host, buffer, event, fresh = self._pending.pop(0)
        if event is not None:
            event.synchronize()  # the copy, issued a bucket or more ago
        if fresh:
            host.copy_(buffer)
        else:
            host.add_(buffer)

    def finish(self) -> None:
        """Land every part sent (the accumulators are then the step's gradients)."""
        while self._pending:
            self._land_oldest()


def storage_counter() -> Callable[[list[Optional[Tensor]]], int]:
    """A counter of bytes by storage: each call returns the bytes of the storages among its
    tensors (``None`` skipped; a DTensor's local shard) that no earlier call of the same counter
    counted, so views and shared buffers count once across the calls."""
    seen: set[int] = set()

    def count(tensors: list[Optional[Tensor]]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = local_tensor(t).untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    return count


def zero_state_bytes(
    module: nn.Module, optimizer: torch.optim.Optimizer, engine: Optional[ZeroDataParallel]
) -> dict[str, int]:
    """Model-state bytes on this rank, counted once per storage from the tensors themselves:
    ``params`` (the module's, i.e. the flat buckets), ``grads`` (the engine's gradient buffers and
    any ``.grad`` of the module's parameters), ``masters`` (the optimizer's parameters that are
    not the module's: fp32 masters; a slice that is a view of a bucket is counted there),
    ``master_grads`` (their gradients where they are copies, made for one step) and
    ``optimizer_state``."""
    count = storage_counter()

    params = list(module.parameters())
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    buckets = engine.buckets if engine is not None else []
    buffers = [t for b in buckets for t in (b.grad, b.shard_grad, b.staging)]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    return {
        "params": count(params),
        "grads": count(buffers + [p.grad for p in params]),
        "masters": count(stepped),
        "master_grads": count([p.grad for p in stepped]),
        "optimizer_state": count(state),
    }


def paper_bytes(num_params: int, stage: int, data: int) -> float:
    """The ZeRO paper's model-state bytes per rank with mixed-precision Adam (K = 12)."""
    psi, n = num_params, data
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[
        stage
    ]
