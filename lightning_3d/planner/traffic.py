"""Bytes one rank sends over ZeRO's axis (data × context) per optimizer step, as the code sends them.

Counted per micro-batch, because that is how the engines send them under gradient accumulation
(``Choice.micro_batches`` without a pipeline; Lightning's ``accumulate_grad_batches``):

* **ZeRO 0** all-reduces the gradient buckets once, on the last micro-batch (the strategy's
  ``block_backward_sync`` defers the others): ``2·(n−1)/n·G``.
* **ZeRO 1** keeps whole gradient buckets, so it also reduces once: a reduce-scatter of the
  gradients, and after the step an all-gather of the updated parameters.
* **ZeRO 2** keeps only its slice of each gradient bucket, so it reduce-scatters on *every*
  micro-batch and all-gathers the parameters once: ``(m·G + P)·(n−1)/n``; with
  ``zero2_defer_reduce`` it holds full-size gradients over the micro-batches and reduces once,
  as ZeRO 1 does.
* **ZeRO 3** (FSDP2) gathers every unit's parameters for each micro-batch's forward, again for
  its backward (except the units it keeps gathered from forward to backward: the outer unit and
  the last block, without a pipeline), and reduce-scatters its gradients on every micro-batch:
  ``m·(G + (2·W − W_kept))·(n−1)/n``. With ``zero3_keep_gathered`` (accumulation only) the units
  stay gathered and their gradients unsharded through the step: one gather, one reduce-scatter,
  ``(G + W)·(n−1)/n``, for the memory of the stage's whole parameters in the compute dtype and
  its whole gradients in the reduce dtype (``memory.buffer_bytes`` counts them).

``G``: the trained elements' gradient bytes, ``P``: their parameter bytes, ``W``: the gathered
bytes (compute dtype under mixed precision; the frozen base of an adapter method as it is held).
Ring-equivalent bytes, as ``tools.bench.comm`` counts a collective (the point-to-point exchanges
gloo runs send the same bytes).

**Under a pipeline** the micro-batches are the schedule's, and torch's ``PipelineStage`` drives
FSDP2 itself: every backward but the step's last runs with gradient sync and resharding after
backward off (``backward_maybe_with_nosync``), and its ``perform_reduce_grad`` reduce-scatters
the summed gradients once, after the last micro-batch. Every unit still reshards after each
forward (``apply_zero3`` under a pipeline). So a unit gathers for its first operation and for
every operation that follows one of its forwards (a forward after a forward, the backward after
a forward), and finds itself gathered after a backward: ``m + 1`` gathers per step in any
schedule that ends on a backward (GPipe, 1F1B, each chunk of the interleaved ones), and one
reduce-scatter: ``(G + (m + 1)·W)·(n−1)/n``, counted on two pipeline × two data gloo ranks
(``tests/test_planner_traffic.py``). ZeRO 0-2 under a pipeline keep the once-per-step count.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_3d.planner.choice import Choice
from lightning_3d.planner.facts import ModelFacts
from lightning_3d.planner.memory import stage_block_parts, stage_parts
from lightning_3d.planner.methods import frozen_bytes, projections, trained_part


@dataclass(frozen=True)
class DataTraffic:
    """Ring-equivalent bytes one rank sends per optimizer step over ZeRO's axis, by collective."""

    all_reduce: float = 0.0
    reduce_scatter: float = 0.0
    all_gather: float = 0.0

    @property
    def total(self) -> float:
        return self.all_reduce + self.reduce_scatter + self.all_gather


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def accumulation(choice: Choice) -> int:
    """Micro-batches whose collectives the data axis sends one by one (see the module docstring)."""
    return choice.micro_batches if choice.pipeline == 1 else 1


def data_traffic(
    choice: Choice, grad_bytes: float, param_bytes: float, gathered: float, kept: float
) -> DataTraffic:
    """The step's bytes for a stage whose trained gradients are ``grad_bytes``, its trained
    parameters ``param_bytes``, its ZeRO-3 gathers ``gathered`` bytes, ``kept`` of them in units
    FSDP2 keeps gathered from forward to backward."""
    ring = _ring(choice.data * choice.context)
    m, z = accumulation(choice), choice.zero_stage
    if z == 0:
        return DataTraffic(all_reduce=2 * ring * grad_bytes)
    if z in (1, 2):
        scatters = m if z == 2 and not choice.zero2_defer_reduce else 1
        return DataTraffic(
            reduce_scatter=scatters * ring * grad_bytes, all_gather=ring * param_bytes
        )
    if choice.pipeline > 1:  # the stages' own FSDP2 driving: see the module docstring
        gathers = choice.micro_batches + 1
        return DataTraffic(reduce_scatter=ring * grad_bytes, all_gather=gathers * ring * gathered)
    if choice.zero3_keep_gathered and m > 1:
        return DataTraffic(reduce_scatter=ring * grad_bytes, all_gather=ring * gathered)
    return DataTraffic(
        reduce_scatter=m * ring * grad_bytes, all_gather=m * ring * (2 * gathered - kept)
    )


def step_traffic(facts: ModelFacts, choice: Choice, lora_r: int = 8) -> DataTraffic:
    """The bytes of the stage that trains the most (what the step waits for), per step."""
    p_b, g_b, _, act = facts.bytes
    tp = choice.tensor
    gathered = act if facts.precision.endswith("mixed") else p_b
    stages = stage_parts(facts, choice.pipeline, choice.virtual_stages)
    blocks = stage_block_parts(facts, choice.pipeline, choice.virtual_stages)
    largest, most = 0, -1.0
    for s, ((part, _), b) in enumerate(zip(stages, blocks)):
        trained = trained_part(choice.adapter, part, b, lora_r).local(tp)
        if trained > most:
            largest, most = s, trained
    part, b = stages[largest][0], blocks[largest]
    # ZeRO-3 gathers every parameter (trained ones in the compute dtype, a frozen base as held).
    whole = most * gathered
    if choice.adapter != "none":
        whole += frozen_bytes(choice.adapter, part.local(tp), projections(b).local(tp), gathered)
    kept = kept_elements(facts, choice, part.local(tp), tp) * gathered
    return data_traffic(choice, most * g_b, most * p_b, whole, min(kept, whole))


def kept_elements(facts: ModelFacts, choice: Choice, part_elements: float, tp: int) -> float:
    """Elements of the units FSDP2 keeps gathered from forward to backward (``apply_zero3``):
    without a pipeline the outer unit (what no block holds) and the last block; none under one."""
    if choice.pipeline > 1:
        return 0.0
    blocks = sum(b.local(tp) for b in facts.blocks)
    return part_elements - blocks + facts.blocks[-1].local(tp)
