"""The memory kit in the layout search: the run's own savings, and the rungs a layout climbs
where it does not fit the device.

Every layout counts the run's own savings (``PlannerOptions.loss_chunks``, ``"auto"`` resolved
to the count the run will use; ``optimizer``; ``activation_offload``): :func:`run_settings`. A
layout that does not fit then climbs the rungs ``PlannerOptions.memory_kit`` allows
(:data:`~lightning_3d.planner.choice.MEMORY_KIT`), cheapest in step time first (:func:`climb`):

1. **chunked loss** (``loss_chunks = ceil(V / H)``): the same FLOPs in smaller matmuls and no
   recomputation, so nearly free; it removes the logits, the largest activation of a wide
   vocabulary's last stage; under tensor parallelism ``ceil(ceil(V / tp) / H)``, this rank's
   share of the vocabulary (the loss stays vocabulary-parallel).
2. **8-bit AdamW states** (``adamw8bit`` for ``adamw``): one memory-bound pass that reads and
   writes fewer bytes than fp32 moments, plus a (de)quantization per step; it changes the
   update's rounding, which is why it comes after a saving that changes nothing. Not with
   offload, nor under ZeRO 1-3 with periodic checkpoints (``optimizer_problems``).
3. **activation offload**: every saved activation crosses the host link twice a step; where
   that is slower than the compute it hides behind, the step waits (:func:`kit_step_time`), so
   it is the last rung.

The combinations are tried in that order as a binary count (chunks; 8-bit; both; offload;
chunks and offload; ...), so the first that fits needs no rung it names: a layout that fits
gets none, one that needs only the offload gets only the offload. Each is checked as every
candidate is (``Plan.from_options``, the model check, the optimizer's refusals); the rungs taken
are in the choice (``Choice.kit_label``), the table and ``parallelism=auto``'s line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Optional

from lightning_3d.parallel.chunked_loss import auto_chunks
from lightning_3d.parallel.optimizers import optimizer_problems
from lightning_3d.planner.choice import LOW_BIT_OPTIMIZER, Choice, PlannerOptions
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.facts import ModelFacts
from lightning_3d.planner.memory import MemorySplit, rank_memory, stage_parts
from lightning_3d.planner.timing import StepTime, step_time

KIT_FIELDS = ("loss_chunks", "optimizer", "activation_offload")  # the Choice fields a rung sets


def run_settings(choice: Choice, facts: ModelFacts, options: PlannerOptions) -> Choice:
    """``choice`` with the run's own savings; ``loss_chunks="auto"`` as the run resolves it:
    ``ceil(V / H)`` chunks, of this rank's ``ceil(V / tp)`` under tensor parallelism (and
    whole logits, see :func:`plan_layouts`, wherever the model check refuses the count)."""
    chunks = options.loss_chunks
    if chunks == "auto":
        chunks = auto_chunks(facts.vocab_size, facts.d_model, choice.tensor)
    return replace(
        choice,
        loss_chunks=chunks,
        optimizer=options.optimizer,
        activation_offload=options.activation_offload,
        zero_master_weights=options.zero_master_weights,
    )


def optimizer_error(choice: Choice, facts: ModelFacts, options: PlannerOptions) -> Optional[str]:
    """The run's optimizer's refusals of this layout (``optimizer_problems``), as one reason."""
    problems = optimizer_problems(
        choice.optimizer,
        choice.zero_stage,
        choice.offload_device,
        options.checkpoints,
        precision=facts.precision,
    )
    return "; ".join(problems) or None


def kit_rungs(choice: Choice, facts: ModelFacts, options: PlannerOptions) -> list[Choice]:
    """The rungs ``choice`` may still climb, each as the choice with that saving alone turned on,
    in :data:`~lightning_3d.planner.choice.MEMORY_KIT`'s order (see the module docstring); a
    rung the options' own refusals rule out for this layout is left out."""
    rungs = []
    kit = options.memory_kit
    chunks = auto_chunks(facts.vocab_size, facts.d_model, choice.tensor)
    if "loss_chunks" in kit and choice.loss_chunks == 1 and chunks > 1:
        rungs.append(replace(choice, loss_chunks=chunks))
    if (
        "low_bit" in kit
        and choice.optimizer == "adamw"
        and not optimizer_problems(
            LOW_BIT_OPTIMIZER, choice.zero_stage, choice.offload_device, options.checkpoints
        )
    ):
        rungs.append(replace(choice, optimizer=LOW_BIT_OPTIMIZER))
    if "activation_offload" in kit and not choice.activation_offload:
        rungs.append(replace(choice, activation_offload=True))
    return rungs


def climb(
    choice: Choice,
    facts: ModelFacts,
    options: PlannerOptions,
    budget: float,
    accepts: Callable[[Choice], bool],
) -> tuple[Choice, MemorySplit]:
    """The cheapest combination of rungs with which ``choice`` fits ``budget`` bytes of device
    memory and which ``accepts`` (the search's plan and model checks), with its memory; where
    none fits, the accepted combination that needs the least (so that the refusal says what
    the layout needs with the kit). Combinations go as a binary count over the rungs (cheapest
    rung the lowest bit), so the first that fits takes no rung it does not need."""
    rungs = kit_rungs(choice, facts, options)
    least = (choice, rank_memory(facts, choice, options))
    for mask in range(1, 2 ** len(rungs)):
        taken = [rung for bit, rung in enumerate(rungs) if mask >> bit & 1]
        changed = {
            name: getattr(rung, name)
            for rung in taken
            for name in KIT_FIELDS
            if getattr(rung, name) != getattr(choice, name)
        }
        saved = replace(choice, **changed)
        memory = rank_memory(facts, saved, options)
        if not accepts(saved):
            continue
        if memory.total <= budget:
            return saved, memory
        if memory.total < least[1].total:
            least = (saved, memory)
    return least


def kit_step_time(
    facts: ModelFacts, choice: Choice, cluster: Cluster, options: PlannerOptions
) -> StepTime:
    """:func:`~lightning_3d.planner.timing.step_time`, plus what activation offload leaves
    exposed: every saved activation of the largest stage goes to the host and back over the
    host link each step, on a side stream beside the compute, so the step waits for the part
    of the transfer the compute does not cover."""
    time = step_time(facts, choice, cluster, options)
    if not choice.activation_offload:
        return time
    fit = facts.activation(choice.ac_policy, choice.tensor, choice.sequence_parallel)
    blocks = max(b for _, b in stage_parts(facts, choice.pipeline, choice.virtual_stages))
    moved = fit.bytes_per_sample(facts.seq_len // choice.context) * choice.batch_per_rank
    transfer = 2 * moved * blocks / (cluster.host_link_gbps * 1e9)
    return replace(time, offload=time.offload + max(0.0, transfer - time.compute))
