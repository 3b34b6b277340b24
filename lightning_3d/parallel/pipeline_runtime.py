"""One rank's pipeline stages and their schedule, run inside Lightning's loop.

Lightning's automatic optimization calls ``training_step``, zeroes gradients, then calls
``backward``. A pipeline schedule runs forward *and* backward of every micro-batch at once, so
:meth:`PipelineRuntime.train_step` runs the schedule and sets this step's gradients aside, and
:meth:`PipelineRuntime.hand_back_grads` returns them in the strategy's ``backward``. For
validation, test and predict, :meth:`PipelineRuntime.answering_forward` runs a forward-only
schedule and lets the module's own step run on every rank with ``self(inputs)`` answering the
last stage's outputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from lightning_3d.parallel.activations import ActivationMeter, paused
from lightning_3d.parallel.pipeline import PipelineSpec, build_schedule
from lightning_3d.parallel.stages import StageModule, stage_ids
from lightning_3d.parallel.tensor import local_tensor


class _Clock:
    """Busy time inside the stages' chunks, and the activation meter's per-chunk bookkeeping."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.forwards = 0  # forward chunks run this step
        # Inside a forward chunk of the step (not torch's metadata inference, which runs the
        # stage once on stand-in inputs before the first step's chunks).
        self.in_forward = False
        self.meter = ActivationMeter()

    def timed(self, run: Callable[[], Any], after: Optional[Callable[[], None]]) -> Any:
        start = time.perf_counter()
        try:
            with paused(False):  # activations count here (see PipelineRuntime.run)
                return run()
        finally:
            self.busy += time.perf_counter() - start
            if after is not None and torch.is_grad_enabled():
                after()


def _timed_stage_class(clock: _Clock) -> type:
    """A ``PipelineStage`` whose forward / backward chunks report to ``clock``."""

    class TimedStage(PipelineStage):
        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            clock.forwards += 1
            clock.in_forward = True
            try:
                return clock.timed(
                    lambda: super(TimedStage, self).forward_one_chunk(*args, **kwargs),
                    clock.meter.forward_done,
                )
            finally:
                clock.in_forward = False

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return clock.timed(
                lambda: super(TimedStage, self).backward_one_chunk(*args, **kwargs),
                clock.meter.backward_done,
            )

        def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return clock.timed(
                lambda: super(TimedStage, self).backward_weight_one_chunk(*args, **kwargs), None
            )

    return TimedStage


class PipelineRuntime:
    """This rank's pipeline stages, their schedule, and one step of it inside Lightning.

    ``options`` is a :class:`~lightning_3d.options.PipelineOptions` with its defaults resolved;
    ``accumulation()`` answers Lightning's ``accumulate_grad_batches``; ``scale_loss`` is the
    16-mixed dynamic loss scale (identity otherwise); ``telemetry`` receives a
    ``"pipeline_step"`` event per training step."""

    def __init__(
        self,
        stages: list[StageModule],
        spec: PipelineSpec,
        mesh: Any,
        options: Any,
        device: torch.device,
        tp_mesh: Any = None,
        *,
        accumulation: Callable[[], int] = lambda: 1,
        scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        telemetry: Any = None,
        objective: Any = None,
    ) -> None:
        self.group = mesh.get_group()
        size, rank, virtual = mesh.size(), mesh.get_local_rank(), options.virtual_stages
        self.num_stages = size * virtual
        indices = stage_ids(rank, size, virtual)
        self.is_first, self.is_last = 0 in indices, self.num_stages - 1 in indices
        # The rank holding the last stage broadcasts the loss (and eval outputs) to its peers.
        self.last_rank = dist.get_global_rank(self.group, (self.num_stages - 1) % size)
        self.micro_batches = options.micro_batches
        self.spec = spec
        self.stage_modules = stages
        self.device = device
        self.tp_mesh = tp_mesh
        self._accumulation = accumulation
        self._scale_loss = scale_loss or (lambda loss: loss)
        self._telemetry = telemetry
        self._objective = objective  # parallel/objective.py's TokenMean: the step's token mean
        self._outputs_only = False
        self._grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._clock = _Clock()
        # The shape of the first batch the schedule ran: torch infers the shapes the stages
        # exchange once, from it, and receives every later micro-batch into buffers of them.
        self._first_shape: Optional[tuple[int, ...]] = None
        self.schedule, _ = build_schedule(
            stages,
            indices,
            self.num_stages,
            options.schedule,
            self.micro_batches,
            self._loss,
            device,
            self.group,
            stage_class=_timed_stage_class(self._clock),
        )

    def _loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        if self._outputs_only:  # forward-only run for the module's own step: no loss needed
            return torch.zeros((), device=self.device)
        # Each micro-batch's mean loss carries 1 / (micro_batches * k): gradients then add up to
        # the mean over the schedule's micro-batches and Lightning's k accumulated steps. (The
        # schedule's own scale_grads would divide p.grad after the step, but ZeRO has already
        # moved the gradients into its buckets by then.)
        # torch's schedule may first run the loss once to infer gradient shapes, before any
        # forward chunk of the step: that call is no micro-batch of the step's token mean.
        inferring = self._clock.forwards == 0
        aside = self._objective.aside() if inferring and self._objective else nullcontext()
        with paused(False), aside:  # what the loss saves for backward counts (see run())
            loss = self.spec.loss(outputs, targets) / (self.micro_batches * self._accumulation())
            return self._scale_loss(loss)

    @property
    def in_forward_chunk(self) -> bool:
        """Whether a stage is running a micro-batch's forward now: a module that records
        figures per micro-batch from its blocks reads it, since torch's metadata inference also
        runs each stage once (on stand-in inputs) before the first step's micro-batches."""
        return self._clock.in_forward

    def loss_weight(self) -> torch.Tensor:
        """What :meth:`_loss` multiplies a micro-batch's mean loss by, as a 0-d device tensor:
        ``1 / (micro_batches * k)`` times the 16-mixed loss scale. A term a stage adds to the
        objective by itself (``parallel/expert_pipeline.py``) takes the same weight."""
        one = torch.ones((), device=self.device)
        return self._scale_loss(one / (self.micro_batches * self._accumulation()))

    def _check_batch(self, inputs: Any) -> None:
        size = inputs.shape[0]
        if size % self.micro_batches:
            raise ValueError(
                f"per-rank batch of {size} samples is not divisible by micro_batches={self.micro_batches}"
            )

    def run(self, batch: Any) -> torch.Tensor:
        """One training step of the schedule over ``batch`` (forward and backward of every
        micro-batch); returns the batch's mean loss on every rank of the pipeline group."""
        inputs, targets = self.spec.split_batch(batch)
        self._check_batch(inputs)
        if tuple(inputs.shape) != self._shape_of(inputs):
            raise ValueError(
                f"a training batch of inputs {tuple(inputs.shape)} after batches of "
                f"{self._first_shape}: a pipeline's stages exchange the shapes of the first "
                "batch they ran; give every training batch one shape (drop_last=True, rows of "
                "one length)"
            )
        args = (inputs,) if self.is_first else ()
        losses: list[torch.Tensor] = []
        clock = self._clock
        clock.busy, clock.forwards, start = 0.0, 0, time.perf_counter()
        clock.meter.reset(p for stage in self.stage_modules for p in stage.parameters())
        # Activations count inside the stages' forward / backward chunks and the loss only: the
        # schedule's first step also runs each stage once to infer shapes, outside the chunks.
        with clock.meter.hooks(), paused():
            self.schedule.step(
                *args, target=targets if self.is_last else None, losses=losses, return_outputs=False
            )
        if self._telemetry is not None:
            self._telemetry.publish(
                "pipeline_step",
                bubble_fraction=max(0.0, 1.0 - clock.busy / (time.perf_counter() - start)),
                activation_peak=clock.meter.peak,
                in_flight_peak=clock.meter.in_flight_peak,
            )
        scale = self.micro_batches * self._accumulation()
        # At least fp32, fp64 under 64-true: every stage knows the dtype from its own weights.
        dtype = torch.promote_types(self._weight_dtype(), torch.float32)
        if self.is_last:  # undo the loss scaling (16-mixed) for what Lightning logs and returns
            loss_scale = self._scale_loss(torch.ones((), device=self.device))
            losses = [x.detach().to(dtype) / loss_scale for x in losses]
        # The last stage's loss, and the factor the step's gradients take (parallel/objective.py)
        # on every stage, in one broadcast: the other stages have no loss to count tokens of.
        told = torch.zeros(2, dtype=torch.float64, device=inputs.device)
        if self.is_last:
            value = None if self._objective is None else self._objective.value()
            told[0] = torch.stack(losses).mean() * scale if value is None else value
            factor = None if self._objective is None else self._objective.factor(scale)
            told[1] = 1.0 if factor is None else factor
        dist.broadcast(told, src=self.last_rank, group=self.group)
        if not self.is_last and self._objective is not None:
            self._objective.adopt(told)
        return told[0].to(dtype)  # the step's token mean; Lightning divides it by k itself

    def _weight_dtype(self) -> torch.dtype:
        """The dtype of this rank's first floating-point weight (fp32 if it holds none)."""
        for stage in self.stage_modules:
            for p in stage.parameters():
                if p.is_floating_point():
                    return p.dtype
        return torch.float32

    # ------------------------------------------------------------------ Lightning hand-off
    def train_step(
        self,
        module: torch.nn.Module,
        batch: Any,
        batch_idx: int,
        before: Callable[[], None],
        context: AbstractContextManager,
    ) -> torch.Tensor:
        """Run the schedule for Lightning's ``training_step``. Lightning zeroes gradients between
        ``training_step`` and ``backward``, so stale gradients are cleared here at the start of an
        accumulation window and this step's are set aside for :meth:`hand_back_grads`.
        ``before()`` runs just before the schedule (ZeRO hooks, the loss scale's setup)."""
        params = list(module.parameters())
        if batch_idx % self._accumulation() == 0:
            for p in params:
                p.grad = None
        before()
        with context:  # autocast under mixed precision
            loss = self.run(batch)
        self._grads = [(p, p.grad) for p in params if p.grad is not None]
        for p, _ in self._grads:
            p.grad = None
        return loss

    def hand_back_grads(self, tied_copies: list[tuple[Any, Any, bool]] = ()) -> None:
        """Give this step's gradients back (in the strategy's ``backward``), adding them to what
        earlier accumulation steps left. ``tied_copies`` (``(parameter, group, first)``): tied
        weights whose gradients must first be summed over the pipeline ranks holding a copy
        (under ZeRO-3; the ZeRO 0-2 engines do this in their buffers)."""
        pending = {id(p): grad for p, grad in self._grads}
        for p, group, _ in tied_copies:
            if id(p) not in pending:  # no gradient on this stage: still take part
                pending[id(p)] = torch.zeros_like(p)
                self._grads.append((p, pending[id(p)]))
            dist.all_reduce(local_tensor(pending[id(p)]), group=group)
        for p, grad in self._grads:
            p.grad = grad if p.grad is None else p.grad + grad
        self._grads = []

    @contextmanager
    def answering_forward(
        self, module: torch.nn.Module, batch: Any, context: AbstractContextManager
    ) -> Generator[None, None, None]:
        """Run ``batch`` through a forward-only schedule, then let the module's own step run with
        ``self(inputs)`` answering the last stage's outputs (shared over the pipeline group): its
        metrics, logging and returned values are then what one process computes, on every rank.
        The answer is an instance attribute of the user's module for the step's duration."""
        with context:
            output = self.outputs(batch)
        calls: list[int] = []

        def forward(*_: Any, **__: Any) -> Any:
            if calls:
                raise RuntimeError(
                    f"under a pipeline of {self.num_stages} stages, {type(module).__name__}'s step may call "
                    "self(...) once per batch: the pipeline ran the batch's inputs (PipelineSpec.inputs) already"
                )
            calls.append(1)
            return output

        module.forward = forward  # the instance attribute shadows the class's forward
        try:
            yield
        finally:
            del module.forward

    # ------------------------------------------------------------------ forward-only
    def outputs(self, batch: Any) -> Any:
        """Forward-only schedule over ``batch``; the last stage's outputs (micro-batches joined
        again), sent to every rank of the pipeline group so each can run the module's own
        validation / test / predict step on them."""
        inputs = self.spec.inputs(batch)
        if self._first_shape is None:
            self._check_batch(inputs)
        first = self._shape_of(inputs)
        if tuple(inputs.shape) == first:
            return self._outputs_of(inputs)
        # Another size (predict's last, partial batch; another batch size for evaluation): in
        # pieces of the first shape, the last one padded with zeros, outputs cut back. Exact:
        # rows do not meet, and under the causal mask a position sees none after it.
        rows, length = inputs.shape[0], inputs.shape[1]
        if inputs.shape[2:] != first[2:] or length > first[1]:
            raise ValueError(
                f"an evaluation batch of inputs {tuple(inputs.shape)} after batches of {first}: "
                "a pipeline runs batches of rows up to the first one's length only"
            )
        pieces = []
        for start in range(0, rows, first[0]):
            piece = inputs[start : start + first[0]]
            padded = piece.new_zeros(first)
            padded[: piece.shape[0], :length] = piece
            output = self._outputs_of(padded)
            if not isinstance(output, torch.Tensor):
                raise ValueError(
                    f"an evaluation batch of inputs {tuple(inputs.shape)} after batches of "
                    f"{first}: the last stage's outputs ({type(output).__name__}) cannot be cut "
                    "back to the batch; give every batch one shape"
                )
            pieces.append(output[: piece.shape[0], :length])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _shape_of(self, inputs: torch.Tensor) -> tuple[int, ...]:
        """The first batch's input shape (this one's, if it is the first)."""
        if self._first_shape is None:
            self._first_shape = tuple(inputs.shape)
        return self._first_shape

    def _outputs_of(self, inputs: torch.Tensor) -> Any:
        args = (inputs,) if self.is_first else ()
        self._outputs_only = True
        try:
            # The target only feeds the (skipped) loss; inputs have the right batch dimension.
            output = self.schedule.eval(*args, target=inputs if self.is_last else None)
        finally:
            self._outputs_only = False
        return self._share(output)

    def _share(self, output: Any) -> Any:
        from torch.distributed.tensor import DTensor

        meta: list[Any] = [None]
        if self.is_last:
            if isinstance(output, DTensor):
                meta[0] = (
                    "dtensor",
                    output._local_tensor.shape,
                    output.dtype,
                    output.placements,
                    output.shape,
                    output.stride(),
                )
            elif isinstance(output, torch.Tensor):
                meta[0] = ("tensor", output.shape, output.dtype)
            else:
                meta[0] = ("object", output)
        dist.broadcast_object_list(meta, src=self.last_rank, group=self.group, device=self.device)
        kind = meta[0][0]
        if kind == "object":
            return meta[0][1]
        local_shape, dtype = meta[0][1], meta[0][2]
        if self.is_last:
            buffer = local_tensor(output).contiguous()
        else:
            buffer = torch.empty(local_shape, dtype=dtype, device=self.device)
        dist.broadcast(buffer, src=self.last_rank, group=self.group)
        if kind == "dtensor" and not self.is_last:
            _, _, _, placements, shape, stride = meta[0]
            return DTensor.from_local(
                buffer, self.tp_mesh, placements, run_check=False, shape=shape, stride=stride
            )
        return output if self.is_last else buffer
