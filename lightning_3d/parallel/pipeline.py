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
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
# Schedules that run several (virtual) stages per rank, placed round-robin (looped).
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")


def _split_batch(batch: Any) -> tuple[Any, Any]:
    return batch[0], batch[1]


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


def stage_blocks(num_blocks: int, num_stages: int) -> list[range]:
    """Uniform split by block count: stage s gets a contiguous run; earlier stages get the extra."""
    if num_stages > num_blocks:
        raise ValueError(f"{num_stages} pipeline stages for {num_blocks} blocks: need at least one block per stage")
    base, extra = divmod(num_blocks, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def stage_ids(pp_rank: int, pp_size: int, virtual: int) -> list[int]:
    """Stages held by ``pp_rank``: looped placement, rank r holds r, r + pp, r + 2pp, ..."""
    return [pp_rank + v * pp_size for v in range(virtual)]


class StageModule(nn.Module):
    """One pipeline stage: (embed) -> its blocks -> (head). Registers every module it runs, so
    FSDP2 and ``parameters()`` see exactly this stage's parameters."""

    def __init__(self, blocks: list[nn.Module], first: list[nn.Module], last: list[nn.Module],
                 embed: Optional[Callable], head: Optional[Callable]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.first = nn.ModuleList(first)
        self.last = nn.ModuleList(last)
        self._embed, self._head = embed, head

    def forward(self, x: Any) -> Any:
        if self._embed is not None:
            x = self._embed(x)
        for block in self.blocks:
            x = block(x)
        if self._head is not None:
            x = self._head(x)
        return x


def _set_submodule(root: nn.Module, name: str, value: Optional[nn.Module]) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, value)


def split_stages(root: nn.Module, spec: PipelineSpec, pp_rank: int, pp_size: int, virtual: int) -> list[StageModule]:
    """Keep this rank's stages of ``root`` in place; return their stage modules (in order)."""
    blocks = root.get_submodule(spec.blocks)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"pipeline blocks {spec.blocks!r} must name an nn.ModuleList, found {type(blocks).__name__}")
    for name in (*spec.first, *spec.last):
        root.get_submodule(name)  # raises AttributeError naming a module that does not exist
    num_stages = pp_size * virtual
    runs = stage_blocks(len(blocks), num_stages)
    mine = stage_ids(pp_rank, pp_size, virtual)
    first = [root.get_submodule(n) for n in spec.first] if 0 in mine else []
    last = [root.get_submodule(n) for n in spec.last] if num_stages - 1 in mine else []
    stages = [
        StageModule(
            [blocks[i] for i in runs[s]],
            first if s == 0 else [],
            last if s == num_stages - 1 else [],
            spec.embed if s == 0 else None,
            spec.head if s == num_stages - 1 else None,
        )
        for s in mine
    ]
    # Drop what other ranks own. Placeholders keep block indices, so names stay as in one process.
    owned = {i for s in mine for i in runs[s]}
    for i in range(len(blocks)):
        if i not in owned:
            blocks[i] = nn.Identity()
    if 0 not in mine:
        for name in spec.first:
            _set_submodule(root, name, None)
    if num_stages - 1 not in mine:
        for name in spec.last:
            _set_submodule(root, name, None)
    return stages


def build_schedule(stages: list[StageModule], stage_indices: list[int], num_stages: int, schedule: str,
                   micro_batches: int, loss_fn: Callable, device: torch.device, group: Any):
    """``PipelineStage`` s for this rank's modules, driven by the named schedule.

    Returns ``(schedule, pipeline_stages)``."""
    from torch.distributed.pipelining import PipelineStage, schedules

    pipeline_stages = [
        PipelineStage(module, index, num_stages, device, group=group) for module, index in zip(stages, stage_indices)
    ]
    # scale_grads=False: ``loss_fn`` already divides by the number of micro-batches.
    kwargs = dict(loss_fn=loss_fn, scale_grads=False)
    if schedule == "gpipe":
        return schedules.ScheduleGPipe(pipeline_stages[0], micro_batches, **kwargs), pipeline_stages
    if schedule == "1f1b":
        return schedules.Schedule1F1B(pipeline_stages[0], micro_batches, **kwargs), pipeline_stages
    if schedule == "interleaved_1f1b":
        return schedules.ScheduleInterleaved1F1B(pipeline_stages, micro_batches, **kwargs), pipeline_stages
    if schedule == "zero_bubble":
        return schedules.ScheduleInterleavedZeroBubble(pipeline_stages, micro_batches, **kwargs), pipeline_stages
    raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {list(SCHEDULES)}")


def pipeline_options(pipeline: int, micro_batches: Optional[int], schedule: str, virtual: Optional[int]) -> dict:
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
    return {"micro_batches": micro_batches, "schedule": schedule, "virtual_stages": virtual}


class PipelineRuntime:
    """This rank's pipeline stages, their schedule, and one step of it inside Lightning."""

    def __init__(self, stages: list[StageModule], spec: PipelineSpec, mesh: Any, options: dict, trainer: Any,
                 device: torch.device) -> None:
        self.group = mesh.get_group()
        size, rank, virtual = mesh.size(), mesh.get_local_rank(), options["virtual_stages"]
        self.num_stages = size * virtual
        indices = stage_ids(rank, size, virtual)
        self.is_first, self.is_last = 0 in indices, self.num_stages - 1 in indices
        # The rank holding the last stage broadcasts the loss to its pipeline peers.
        self.last_rank = dist.get_global_rank(self.group, (self.num_stages - 1) % size)
        self.micro_batches = options["micro_batches"]
        self.spec = spec
        self.trainer = trainer
        self.schedule, pipeline_stages = build_schedule(
            stages, indices, self.num_stages, options["schedule"], self.micro_batches, self._loss, device, self.group
        )
        # Bubble accounting: time inside the stages' forward / backward computations ("busy")
        # against the whole schedule step; the rest is waiting for neighbours (and send/recv).
        self.bubble_fractions: list[float] = []
        self._busy = 0.0
        for stage in pipeline_stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._busy += time.perf_counter() - start

        return timed

    def _loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        # Each micro-batch's mean loss carries 1 / (micro_batches * k): gradients then add up to
        # the mean over the schedule's micro-batches and Lightning's k accumulated steps. (The
        # schedule's own scale_grads would divide p.grad after the step, but ZeRO has already
        # moved the gradients into its buckets by then.)
        return self.spec.loss(outputs, targets) / (self.micro_batches * self.trainer.accumulate_grad_batches)

    def run(self, batch: Any, train: bool) -> torch.Tensor:
        inputs, targets = self.spec.split_batch(batch)
        size = inputs.shape[0]
        if size % self.micro_batches:
            raise ValueError(f"per-rank batch of {size} samples is not divisible by micro_batches={self.micro_batches}")
        args = (inputs,) if self.is_first else ()
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        self._busy, start = 0.0, time.perf_counter()
        run(*args, target=targets if self.is_last else None, losses=losses, return_outputs=False)
        if train:
            total = time.perf_counter() - start
            self.bubble_fractions.append(max(0.0, 1.0 - self._busy / total))
        scale = self.micro_batches * self.trainer.accumulate_grad_batches
        loss = torch.stack([x.detach() for x in losses]).mean() * scale if self.is_last else torch.zeros(())
        loss = loss.to(inputs.device).float()
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss  # the batch's mean loss; Lightning divides it by k itself, as for any step
