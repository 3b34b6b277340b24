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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from lightning_3d.compat import rng_neutral_stage
from lightning_3d.parallel.stages import StageModule, validate_split

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
    embed: Optional[Callable[[Any], torch.Tensor]] = None  # first stage: inputs -> residual stream
    head: Optional[Callable[[torch.Tensor], Any]] = None  # last stage: residual stream -> outputs
    # outputs, targets -> scalar mean loss
    loss: Optional[Callable[[Any, Any], torch.Tensor]] = None
    # batch -> (inputs, targets)
    split_batch: Callable[[Any], tuple[Any, Any]] = field(default=_split_batch)
    inputs: Callable[[Any], Any] = field(default=_inputs)  # batch (also a predict batch) -> inputs
    # How a stage runs one block on the residual stream (default ``block(x)``): blocks that need
    # more than the stream (rotary position embeddings, say) compute it here, on their own stage.
    # The planner also measures one block's activations through it.
    block_forward: Optional[Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]] = None
    # A stage's whole forward, in place of embed -> blocks -> head: ``stage_forward(stage, x)``
    # with the ``StageModule`` (its ``block_ids``, ``is_first``, ``is_last``) and its input. For
    # models whose own forward computes what the blocks need (``models/hf_pipeline.py``).
    stage_forward: Optional[Callable[[Any, Any], Any]] = None
    # The parameter-free stand-in for a module another stage holds (``placeholder(module)``), for
    # models whose own forward still calls it; default: ``nn.Identity`` for a block, nothing else.
    placeholder: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None
    # Run before launch (in the launching process, on a model that may be on meta): raises
    # ValueError if this split would compute another model than one process.
    check: Optional[Callable[[], None]] = None

    def __post_init__(self) -> None:
        if self.loss is None:
            raise ValueError("PipelineSpec needs loss= (outputs, targets -> scalar mean loss)")
        if self.stage_forward is None and (self.embed is None or self.head is None):
            raise ValueError(
                "PipelineSpec needs embed= and head=, or a stage_forward= that runs a whole stage"
            )


def build_schedule(
    stages: list[StageModule],
    stage_indices: list[int],
    num_stages: int,
    schedule: str,
    micro_batches: int,
    loss_fn: Callable,
    device: torch.device,
    group: Any,
    stage_class: Optional[type] = None,
):
    """``PipelineStage`` s (or ``stage_class``, a subclass) for this rank's modules, driven by
    the named schedule.

    Returns ``(schedule, pipeline_stages)``."""
    from torch.distributed.pipelining import PipelineStage

    # torch 2.11 infers shapes by a forward.
    stage_class = rng_neutral_stage(stage_class or PipelineStage)
    pipeline_stages = [
        stage_class(module, index, num_stages, device, group=group)
        for module, index in zip(stages, stage_indices)
    ]
    return make_schedule(schedule, pipeline_stages, micro_batches, loss_fn), pipeline_stages


def make_schedule(
    schedule: str, pipeline_stages: list, micro_batches: int, loss_fn: Callable
) -> Any:
    """The named PyTorch schedule over this rank's ``PipelineStage`` s."""
    from torch.distributed.pipelining import schedules

    if schedule not in _SCHEDULE_CLASSES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {list(SCHEDULES)}")
    name, multi = _SCHEDULE_CLASSES[schedule]
    # scale_grads=False: ``loss_fn`` already divides by the number of micro-batches.
    return getattr(schedules, name)(
        pipeline_stages if multi else pipeline_stages[0],
        micro_batches,
        loss_fn=loss_fn,
        scale_grads=False,
    )


def interleaved_rounds(micro_batches: int, pipeline: int) -> int:
    """How torch's interleaved schedules group ``micro_batches`` (rounds of about ``pipeline``
    each); the micro-batches must be a multiple of it."""
    return max(1, micro_batches // pipeline)


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline's options (the ``pp`` group of :class:`~lightning_3d.options.Plan`; the
    ``pipeline`` size is part of the :class:`~lightning_3d.layout.Layout`), checked and their
    defaults filled in by :func:`pipeline_options`."""

    micro_batches: Optional[int] = None
    """Micro-batches per batch; ``None``: one per pipeline stage."""
    schedule: str = "1f1b"
    """One of :data:`SCHEDULES`."""
    virtual_stages: Optional[int] = None
    """Stages per rank; ``None``: 2 for the interleaved schedules, else 1."""
    split: Union[str, Sequence[str]] = "uniform"
    """``"uniform"`` (by block count), ``"params"`` (by parameter count), or the names of the
    blocks that start stages 1, 2, ..."""


def pipeline_options(
    pipeline: int,
    micro_batches: Optional[int],
    schedule: str,
    virtual: Optional[int],
    split: Any = "uniform",
) -> dict:
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
        raise ValueError(
            f"virtual_stages={virtual} needs an interleaved schedule {list(MULTI_STAGE)}, not {schedule!r}"
        )
    rounds = interleaved_rounds(micro_batches, pipeline)
    if schedule in MULTI_STAGE and pipeline > 1 and micro_batches % rounds:
        raise ValueError(
            f"schedule={schedule!r} runs micro_batches={micro_batches} in {rounds} rounds "
            f"(micro_batches // pipeline={pipeline}) and needs a multiple of them: use "
            f"{micro_batches - micro_batches % rounds} or {micro_batches - micro_batches % rounds + rounds}"
        )
    split = validate_split(split)
    if not isinstance(split, str) and pipeline > 1 and len(split) != pipeline * virtual - 1:
        raise ValueError(
            f"{len(split)} split point(s) {list(split)} for {pipeline * virtual} pipeline stages "
            f"(pipeline={pipeline} x virtual_stages={virtual}): give {pipeline * virtual - 1}"
        )
    return {
        "micro_batches": micro_batches,
        "schedule": schedule,
        "virtual_stages": virtual,
        "split": split,
    }
