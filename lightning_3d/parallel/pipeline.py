"""Pipeline parallelism on the ``pp`` axis with ``torch.distributed.pipelining``.

A model declares once how it splits (:class:`PipelineSpec`): which ``nn.ModuleList`` holds the
blocks, which modules belong to the first stage (embeddings) and the last (final norm, head),
how the first stage turns inputs into the residual stream (``embed``), how the last turns it
into outputs (``head``), and how outputs become the loss. :func:`split_stages` then keeps only
this rank's part of the model — non-owned blocks become parameter-free placeholders so every
remaining parameter keeps its name — and :func:`build_schedule` wraps the stage(s) in
``PipelineStage`` and a schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_3d.parallel.activations import ActivationMeter, paused
from lightning_3d.parallel.stages import (  # noqa: F401  (re-exported: the pipeline's public names)
    SPLITS,
    StageModule,
    plan_stages,
    split_stages,
    stage_blocks,
    stage_ids,
    validate_split,
)
from lightning_3d.parallel.tensor import local_tensor

# name -> (PyTorch schedule class, runs several (virtual) stages per rank, placed round-robin)
_SCHEDULE_CLASSES = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", True),
}
SCHEDULES = tuple(_SCHEDULE_CLASSES)
MULTI_STAGE = tuple(name for name, (_, multi) in _SCHEDULE_CLASSES.items() if multi)


def _split_batch(batch: Any) -> tuple[Any, Any]:
    return batch[0], batch[1]


def _inputs(batch: Any) -> Any:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


@dataclass
class PipelineSpec:
    """How a model splits into pipeline stages. Names are relative to the ``LightningModule``.

    Example (the reference GPT)::

        PipelineSpec(
            blocks="model.blocks",
            first=("model.tok_emb", "model.pos_emb", "model.drop"),
            last=("model.norm", "model.lm_head"),
            embed=self.model.embed, head=self.model.head,
            loss=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        )
    """

    blocks: str  # the nn.ModuleList split across stages
    first: Sequence[str]  # modules only the first stage keeps
    last: Sequence[str]  # modules only the last stage keeps
    embed: Callable[[Any], torch.Tensor]  # first stage: inputs -> residual stream
    head: Callable[[torch.Tensor], Any]  # last stage: residual stream -> outputs
    loss: Callable[[Any, Any], torch.Tensor]  # outputs, targets -> scalar mean loss
    split_batch: Callable[[Any], tuple[Any, Any]] = field(default=_split_batch)  # batch -> (inputs, targets)
    inputs: Callable[[Any], Any] = field(default=_inputs)  # batch (also a predict batch) -> inputs
    # How a stage runs one block on the residual stream (default ``block(x)``): blocks that need
    # more than the stream (rotary position embeddings, say) compute it here, on their own stage.
    block_forward: Optional[Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]] = None


def build_schedule(stages: list[StageModule], stage_indices: list[int], num_stages: int, schedule: str,
                   micro_batches: int, loss_fn: Callable, device: torch.device, group: Any):
    """``PipelineStage`` s for this rank's modules, driven by the named schedule.

    Returns ``(schedule, pipeline_stages)``."""
    from torch.distributed.pipelining import PipelineStage

    pipeline_stages = [
        PipelineStage(module, index, num_stages, device, group=group) for module, index in zip(stages, stage_indices)
    ]
    return make_schedule(schedule, pipeline_stages, micro_batches, loss_fn), pipeline_stages


def make_schedule(schedule: str, pipeline_stages: list, micro_batches: int, loss_fn: Callable) -> Any:
    """The named PyTorch schedule over this rank's ``PipelineStage`` s."""
    from torch.distributed.pipelining import schedules

    if schedule not in _SCHEDULE_CLASSES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {list(SCHEDULES)}")
    name, multi = _SCHEDULE_CLASSES[schedule]
    # scale_grads=False: ``loss_fn`` already divides by the number of micro-batches.
    return getattr(schedules, name)(pipeline_stages if multi else pipeline_stages[0], micro_batches,
                                    loss_fn=loss_fn, scale_grads=False)


def pipeline_options(pipeline: int, micro_batches: Optional[int], schedule: str, virtual: Optional[int],
                     split: Any = "uniform") -> dict:
    """Validate the pipeline options before any process exists."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {list(SCHEDULES)}")
    micro_batches = pipeline if micro_batches is None else micro_batches
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} must be a positive integer")
    if virtual is None:
        virtual = 2 if schedule in MULTI_STAGE else 1
    if not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"virtual_stages={virtual!r} must be a positive integer")
    if virtual > 1 and schedule not in MULTI_STAGE:
        raise ValueError(f"virtual_stages={virtual} needs an interleaved schedule {list(MULTI_STAGE)}, not {schedule!r}")
    split = validate_split(split)
    if not isinstance(split, str) and pipeline > 1 and len(split) != pipeline * virtual - 1:
        raise ValueError(
            f"{len(split)} split point(s) {list(split)} for {pipeline * virtual} pipeline stages "
            f"(pipeline={pipeline} x virtual_stages={virtual}): give {pipeline * virtual - 1}"
        )
    return {"micro_batches": micro_batches, "schedule": schedule, "virtual_stages": virtual, "split": split}


class PipelineRuntime:
    """This rank's pipeline stages, their schedule, and one step of it inside Lightning."""

    def __init__(self, stages: list[StageModule], spec: PipelineSpec, mesh: Any, options: dict, trainer: Any,
                 device: torch.device, tp_mesh: Any = None,
                 scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        self.group = mesh.get_group()
        size, rank, virtual = mesh.size(), mesh.get_local_rank(), options["virtual_stages"]
        self.num_stages = size * virtual
        indices = stage_ids(rank, size, virtual)
        self.is_first, self.is_last = 0 in indices, self.num_stages - 1 in indices
        # The rank holding the last stage broadcasts the loss (and eval outputs) to its peers.
        self.last_rank = dist.get_global_rank(self.group, (self.num_stages - 1) % size)
        self.micro_batches = options["micro_batches"]
        self.spec = spec
        self.stage_modules = stages
        self.trainer = trainer
        self.device = device
        self.tp_mesh = tp_mesh
        self._scale_loss = scale_loss or (lambda loss: loss)  # e.g. the 16-mixed dynamic loss scale
        self._outputs_only = False
        self.schedule, pipeline_stages = build_schedule(
            stages, indices, self.num_stages, options["schedule"], self.micro_batches, self._loss, device, self.group
        )
        # Per training step: the idle share ("bubble": time outside the stages' forward /
        # backward computations, i.e. waiting for neighbours), peak saved-activation bytes and
        # peak micro-batches in flight.
        self.bubble_fractions: list[float] = []
        self.activation_peaks: list[int] = []
        self.in_flight_peaks: list[int] = []
        self.meter = ActivationMeter()
        self._busy = 0.0
        for stage in pipeline_stages:
            for name, after in (("forward_one_chunk", self.meter.forward_done),
                                ("backward_one_chunk", self.meter.backward_done),
                                ("backward_weight_one_chunk", None)):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name), after))

    def _timed(self, fn: Callable, after: Optional[Callable[[], None]]) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                with paused(False):  # activations count here (see run())
                    return fn(*args, **kwargs)
            finally:
                self._busy += time.perf_counter() - start
                if after is not None and torch.is_grad_enabled():
                    after()

        return timed

    def _loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        if self._outputs_only:  # forward-only run for the module's own step: no loss needed
            return torch.zeros((), device=self.device)
        # Each micro-batch's mean loss carries 1 / (micro_batches * k): gradients then add up to
        # the mean over the schedule's micro-batches and Lightning's k accumulated steps. (The
        # schedule's own scale_grads would divide p.grad after the step, but ZeRO has already
        # moved the gradients into its buckets by then.)
        with paused(False):  # what the loss saves for backward counts (see run())
            loss = self.spec.loss(outputs, targets) / (self.micro_batches * self.trainer.accumulate_grad_batches)
            return self._scale_loss(loss)

    def _check_batch(self, inputs: Any) -> None:
        size = inputs.shape[0]
        if size % self.micro_batches:
            raise ValueError(f"per-rank batch of {size} samples is not divisible by micro_batches={self.micro_batches}")

    def run(self, batch: Any) -> torch.Tensor:
        """One training step of the schedule over ``batch`` (forward and backward of every
        micro-batch); returns the batch's mean loss on every rank of the pipeline group."""
        inputs, targets = self.spec.split_batch(batch)
        self._check_batch(inputs)
        args = (inputs,) if self.is_first else ()
        losses: list[torch.Tensor] = []
        self._busy, start = 0.0, time.perf_counter()
        self.meter.reset(p for stage in self.stage_modules for p in stage.parameters())
        # Activations count inside the stages' forward / backward chunks and the loss only: the
        # schedule's first step also runs each stage once to infer shapes, outside the chunks.
        with self.meter.hooks(), paused():
            self.schedule.step(*args, target=targets if self.is_last else None, losses=losses, return_outputs=False)
        self.bubble_fractions.append(max(0.0, 1.0 - self._busy / (time.perf_counter() - start)))
        self.activation_peaks.append(self.meter.peak)
        self.in_flight_peaks.append(self.meter.in_flight_peak)
        scale = self.micro_batches * self.trainer.accumulate_grad_batches
        if self.is_last:  # undo the loss scaling (16-mixed) for what Lightning logs and returns
            loss_scale = self._scale_loss(torch.ones((), device=self.device))
            losses = [x.detach().float() / loss_scale for x in losses]
        loss = torch.stack(losses).mean() * scale if self.is_last else torch.zeros(())
        loss = loss.to(inputs.device).float()
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss  # the batch's mean loss; Lightning divides it by k itself, as for any step

    def outputs(self, batch: Any) -> Any:
        """Forward-only schedule over ``batch``; the last stage's outputs (micro-batches joined
        again), sent to every rank of the pipeline group so each can run the module's own
        validation / test / predict step on them."""
        inputs = self.spec.inputs(batch)
        self._check_batch(inputs)
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
                meta[0] = ("dtensor", output._local_tensor.shape, output.dtype, output.placements, output.shape,
                           output.stride())
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
            return DTensor.from_local(buffer, self.tp_mesh, placements, run_check=False, shape=shape, stride=stride)
        return output if self.is_last else buffer
