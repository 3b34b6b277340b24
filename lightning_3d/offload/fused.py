"""The CPU Adam(W) update of offloaded chunks, in torch's fused kernel, many chunks per call.

Why torch's kernel: ``torch._fused_adamw_`` / ``torch._fused_adam_`` (what ``torch.optim.AdamW(
fused=True)`` calls on CPU) reads each element of ``master``, ``grad``, ``exp_avg`` and
``exp_avg_sq`` once and writes three of them once, vectorised and split over every intra-op
thread. Written as separate tensor operations the same update makes about eight passes over
memory with temporaries, five times slower on a CPU whose memory bandwidth is the limit. The
kernel is element-wise, so stepping a parameter chunk by chunk gives bit for bit what it gives
on the whole parameter (``tests/test_offload_fused.py`` checks both this and the tolerance
against torch's default, unfused Adam(W)).

Why batches: one call per chunk would pay the dispatcher and thread start-up once per 16 MiB;
:class:`FusedBatch` gathers chunks that share hyperparameters and step count and steps them in
one list call. Gradients that are not fp32 CPU tensors (bf16, or on an accelerator) are cast
into one reusable fp32 buffer, so a bf16 model costs no allocation per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

DEFAULT_GRAD_BUFFER_BYTES = 64 * 2**20  # fp32 copies of non-fp32 gradients per fused call


@dataclass(frozen=True)
class AdamHyper:
    """One param group's hyperparameters, read at every step (schedulers change ``lr``)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # True: AdamW (decoupled decay); False: Adam with L2 added to the gradient

    @classmethod
    def of(cls, group: dict) -> "AdamHyper":
        beta1, beta2 = map(float, group["betas"])
        return cls(
            float(group["lr"]),
            beta1,
            beta2,
            float(group["eps"]),
            float(group["weight_decay"]),
            bool(group["decoupled_weight_decay"]),
        )


def fused_adam_(
    masters: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: int,
    hyper: AdamHyper,
) -> None:
    """Adam(W) step ``step`` (1-based, already counted) in place on fp32 CPU tensors, one call."""
    if not masters:
        return
    kernel = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
    # The kernel reads the step count from a tensor per parameter; all of these share one.
    steps = [torch.tensor(float(step), dtype=torch.float32)] * len(masters)
    kernel(
        masters,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
    )


class FusedBatch:
    """Chunks waiting for one fused call per (hyperparameters, step); :meth:`flush` steps them.

    :meth:`add` takes a chunk's fp32 views (``master``, ``exp_avg``, ``exp_avg_sq``), its
    gradient in any dtype and device, and ``weights`` when the parameter keeps a separate
    master (bf16 or on an accelerator): after the step the new master is copied into them.
    Views handed to :meth:`add` must stay valid until the next :meth:`flush`.
    """

    def __init__(
        self,
        grad_buffer_bytes: int = DEFAULT_GRAD_BUFFER_BYTES,
        pinned: bool = False,
        copy_back: Optional[Callable[[Tensor, Tensor], None]] = None,
    ) -> None:
        if grad_buffer_bytes < 4:
            raise ValueError(f"grad_buffer_bytes must hold one fp32 value, got {grad_buffer_bytes}")
        self._buffer_numel = grad_buffer_bytes // 4
        self._pinned = pinned
        self._buffer: Optional[Tensor] = None
        self._used = 0  # elements of the buffer holding gradients of the pending chunks
        self._pending: dict[tuple[AdamHyper, int], tuple[list[Tensor], ...]] = {}
        self._copy_back: list[tuple[Tensor, Tensor]] = []
        self.numel = 0  # elements pending
        # Wall time in the fused Adam calls since set to 0 (not the copy-back).
        self.kernel_seconds = 0.0
        # (weights, new master) -> None; default ``weights.copy_(master)`` (an accelerator's
        # WeightUploader starts the copy on a side stream instead).
        self.copy_back = copy_back or (lambda weights, master: weights.copy_(master))

    def add(
        self,
        hyper: AdamHyper,
        step: int,
        master: Tensor,
        grad: Tensor,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        weights: Optional[Tensor] = None,
    ) -> None:
        if grad.dtype != torch.float32 or grad.device.type != "cpu" or not grad.is_contiguous():
            grad = self._cast(grad)
        lists = self._pending.setdefault((hyper, step), ([], [], [], []))
        for into, value in zip(lists, (master, grad, exp_avg, exp_avg_sq)):
            into.append(value)
        if weights is not None:
            self._copy_back.append((weights, master))
        self.numel += master.numel()

    def _cast(self, grad: Tensor) -> Tensor:
        n = grad.numel()
        if self._buffer is None or self._buffer.numel() < n:
            self.flush()  # pending chunks may point into the old buffer
            size = max(self._buffer_numel, n)
            self._buffer = torch.empty(size, dtype=torch.float32, pin_memory=self._pinned)
        elif self._used + n > self._buffer.numel():
            self.flush()
        out = self._buffer[self._used : self._used + n]
        out.copy_(grad.reshape(-1))
        self._used += n
        return out

    def flush(self) -> None:
        """Step every pending chunk, copy new masters into separate weights, start empty."""
        start = time.perf_counter()
        for (hyper, step), (masters, grads, exp_avgs, exp_avg_sqs) in self._pending.items():
            fused_adam_(masters, grads, exp_avgs, exp_avg_sqs, step, hyper)
        # Not the copy-back: an accelerator's uploader may wait there for a staging buffer's copy.
        self.kernel_seconds += time.perf_counter() - start
        for weights, master in self._copy_back:
            self.copy_back(weights, master)
        self.discard()

    def discard(self) -> None:
        """Forget the pending chunks without stepping them (the buffer is kept for reuse)."""
        self._pending.clear()
        self._copy_back.clear()
        self._used = self.numel = 0
