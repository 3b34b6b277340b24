"""Enumerate layouts for a model on a cluster, predict each one, rank those that fit.

:func:`plan_layouts` is pure: model facts, a cluster and options in, candidates out (fitting
ones first, fastest first; then the rejected ones, each with one reason). The same function
serves the CLI's table and ``parallelism=auto`` (:mod:`lightning_3d.strategy.auto`).

Enumerated: ``data × context × tensor × pipeline = world`` (tensor innermost, kept inside a node
and dividing the head count; pipeline at most the block count, split unevenly where it does not
divide it (:func:`lightning_3d.parallel.stages.stage_blocks`); context, from
``PlannerOptions.context_sizes_for``, with the sequence divisible by twice its size), ZeRO stages,
micro-batches (every count dividing the per-rank batch, at least ``pipeline`` for 1F1B as
torch requires; without a pipeline they are gradient accumulation steps), schedules (the
interleaved ones with each of ``virtual_stages`` stages per rank), sequence parallelism (with
``tensor > 1``, where measured), activation checkpointing, offload (to host memory or NVMe, with
ZeRO-3's parameters or without) and the fine-tune method (``PlannerOptions.adapters``: full,
LoRA, QLoRA; adapters without sequence parallelism, which the project refuses for them; QLoRA's
own refusals asked of :func:`lightning_3d.adapters.qlora.refuse_qlora_plan`), and on a
mixture-of-experts model the expert size (``PlannerOptions.expert_sizes``: those dividing the data
size and the expert count, beside the axes :data:`EXPERT_COMBINES` names; full fine-tunes without
offload, as the strategy refuses the rest; :mod:`lightning_3d.planner.experts`). Given sizes the
model or the world cannot take are refused before anything is enumerated.
Every candidate is built as a :class:`~lightning_3d.options.Plan` (``Plan.from_options``), and,
given ``check`` (:func:`lightning_3d.options.model_check.check` bound to the model on ``meta``), checked
against the model's shapes; their ``ValueError`` is the rejection's reason. A split that is
refused as a whole (a tensor size that crosses nodes, say) is one rejected candidate, not one
per ZeRO stage and micro-batch count.

**The memory kit** (:mod:`lightning_3d.planner.kit`): every layout counts the run's own
savings; one that does not fit the device climbs the rungs ``PlannerOptions.memory_kit`` allows,
cheapest in step time first, and keeps the first combination that fits.
"""

from __future__ import annotations

import functools
import math
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from itertools import product
from typing import Any, Optional

from lightning_3d.adapters.qlora import refuse_qlora_plan
from lightning_3d.options import Plan
from lightning_3d.parallel.pipeline import MULTI_STAGE, interleaved_rounds
from lightning_3d.planner.choice import (
    ADAPTERS,
    LOW_BIT_OPTIMIZER,
    OFFLOADS,
    Choice,
    PlannerOptions,
)
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.facts import ModelFacts
from lightning_3d.planner.kit import climb, kit_step_time, optimizer_error, run_settings
from lightning_3d.planner.memory import GB, MemorySplit, human, rank_memory
from lightning_3d.planner.methods import qlora_problem
from lightning_3d.planner.timing import StepTime, mfu

Check = Callable[[Plan, int], None]  # raises ValueError for a plan the model cannot take

# The split axes an expert axis is tried beside (it is carved from the data ranks at a fixed
# pipeline, context and tensor coordinate: parallel/expert.py); a split with any other axis above
# 1 would be planned without one. Every axis the strategy has: planner/expert_memory.py prices
# each combination.
EXPERT_COMBINES = ("data", "tensor", "context", "pipeline")


@dataclass(frozen=True)
class Candidate:
    choice: Choice
    memory: Optional[MemorySplit] = None
    time: Optional[StepTime] = None
    mfu: float = 0.0
    # Why rejected, as a group name ("memory", "tensor > devices per node", ...).
    kind: Optional[str] = None
    reason: Optional[str] = None  # the sentence

    @property
    def fits(self) -> bool:
        return self.reason is None

    @property
    def tokens_per_s(self) -> float:
        return self.time.tokens_per_s if self.time is not None else 0.0


def divisors(n: int) -> list[int]:
    """The whole numbers that divide ``n``, ascending."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted({*small, *(n // k for k in small)})


def _splits(world: int, contexts: tuple[int, ...] = (1,)) -> Iterator[tuple[int, ...]]:
    """``(data, tensor, pipeline, context)`` sizes that tile ``world``."""
    for cp in (c for c in contexts if world % c == 0):
        for tp in divisors(world // cp):
            for pp in divisors(world // (cp * tp)):
                yield world // (cp * tp * pp), tp, pp, cp


def _split_problem(
    facts: ModelFacts, cluster: Cluster, batch: int, dp: int, tp: int, pp: int, cp: int = 1
) -> Optional[tuple[str, str]]:
    if facts.seq_len % (2 * cp):
        return "sequence not divisible by 2 × context", (
            f"cp={cp}: seq_len={facts.seq_len} is not divisible by 2 × context = {2 * cp}"
        )
    if tp > cluster.devices_per_node:
        return "tensor > devices per node", (
            f"tp={tp} > {cluster.devices_per_node} devices per node "
            "(tensor parallelism is kept inside a node)"
        )
    if facts.n_head % tp:
        return "tensor does not divide heads", f"tp={tp} does not divide n_head={facts.n_head}"
    if pp > 1 and not facts.pipeline_ready:
        return "no pipeline spec", f"pp={pp}: the model defines no pipeline_spec()"
    if pp > facts.n_layer:
        # Uneven splits are fine (earlier stages take the extra block); an empty stage is not.
        return "pipeline > blocks", f"pp={pp} > n_layer={facts.n_layer} (a stage needs a block)"
    if batch % dp:
        return "batch not divisible", f"global batch {batch} is not divisible by dp={dp}"
    return None


def _expert_sizes(
    facts: ModelFacts, options: PlannerOptions, dp: int, tp: int, pp: int, cp: int
) -> tuple[int, ...]:
    """The expert sizes tried on one split: 1 for a dense model; for an MoE model those of
    ``options.expert_sizes_for`` on its data size, above 1 only where the split's other axes are
    1 unless named in :data:`EXPERT_COMBINES` (empty: no given size applies to this split)."""
    if facts.experts is None:
        return (1,)
    sizes = options.expert_sizes_for(dp, facts.experts.n_experts)
    others = {"tensor": tp, "pipeline": pp, "context": cp}
    if any(size > 1 for axis, size in others.items() if axis not in EXPERT_COMBINES):
        sizes = tuple(e for e in sizes if e == 1)
    return sizes


def refuse_expert_sizes(facts: ModelFacts, options: PlannerOptions, world: int) -> None:
    """``ValueError`` naming every given expert size the model or the world cannot take, before
    any layout is enumerated: a dense model has no experts to split; a size must divide the expert
    count and the data ranks it is carved from (at most the world)."""
    if options.expert_sizes == "auto":
        return
    split = [e for e in options.expert_sizes if e > 1]
    if split and facts.experts is None:
        raise ValueError(
            f"expert_sizes={list(options.expert_sizes)}: the model has no mixture-of-experts "
            "layers to split"
        )
    problems = [p for e in split for p in facts.experts.problems(e, world)] if split else []
    if problems:
        raise ValueError(f"expert_sizes={list(options.expert_sizes)}: {'; '.join(problems)}")


def _micro_batches(batch_per_rank: int, options: PlannerOptions) -> list[int]:
    """Every count that divides the per-rank batch (equal micro-batches), up to the option's
    cap: real runs use 3, 6, 12 ... as often as powers of two (a batch of 1,536 sequences)."""
    return [m for m in divisors(batch_per_rank) if m <= options.max_micro_batches]


def _keeps(zero: int, pp: int, m: int, offload_params: bool) -> bool:
    """Whether ``zero3_keep_gathered`` is worth trying: ZeRO-3 accumulating without a pipeline
    on device-resident weights (the plan check refuses it elsewhere)."""
    return zero == 3 and pp == 1 and m > 1 and not offload_params


def _unfilled_rounds(schedule: str, pp: int, m: int) -> bool:
    """torch's interleaved schedules run ``m`` in rounds of ``m // pp`` and refuse a remainder
    (:func:`lightning_3d.parallel.pipeline.pipeline_options`): never proposed."""
    return schedule in MULTI_STAGE and pp > 1 and m % interleaved_rounds(m, pp) != 0


def _schedules(pp: int, n_layer: int, options: PlannerOptions) -> Iterator[tuple[str, int]]:
    """(schedule, virtual stages) pairs for a pipeline of ``pp`` ranks (one stand-in without one)."""
    if pp == 1:
        yield "1f1b", 1
        return
    for schedule in options.schedules:
        if schedule not in MULTI_STAGE:
            yield schedule, 1
            continue
        for virtual in options.virtual_stages:
            # Uneven chunks are fine (the uniform split gives earlier stages the extra block).
            if pp * virtual <= n_layer:
                yield schedule, virtual


def _choices(
    dp: int,
    tp: int,
    pp: int,
    batch_per_rank: int,
    facts: ModelFacts,
    options: PlannerOptions,
    cp: int = 1,
    experts: tuple[int, ...] = (1,),
) -> Iterator[Choice]:
    # Context: all-to-all sends fewer bytes than the ring (8(N-1)/N against 2(3N-2) per q/k/v
    # share), where the heads on a tensor rank divide by the context size.
    scheme = "alltoall" if cp > 1 and facts.n_head % (cp * tp) == 0 else Choice.context_scheme
    for adapter, expert in product(options.adapters, experts):
        if adapter != "none" and expert > 1:
            continue  # adapters on split experts are not planned
        fixed = {"adapter": adapter, "context": cp, "context_scheme": scheme, "expert": expert}
        for choice in _layout_choices(
            dp, tp, pp, batch_per_rank, facts.n_layer, options, dp * cp, fixed
        ):
            if adapter != "none" and choice.sequence_parallel:
                continue  # the project refuses adapters beside a sequence-parallel plan
            yield choice


def _layout_choices(
    dp: int,
    tp: int,
    pp: int,
    batch_per_rank: int,
    n_layer: int,
    options: PlannerOptions,
    shards: Optional[int] = None,
    fixed: Optional[dict[str, Any]] = None,
) -> Iterator[Choice]:
    """Every choice of one split; ``fixed``: further ``Choice`` fields, the same for all."""
    shards = dp if shards is None else shards  # ZeRO's axis: data × context
    fixed = fixed or {}
    for zero in options.zero_stages:
        for offload in options.offloads:
            params = offload.endswith("+params")
            if params and zero != 3:
                continue  # only ZeRO-3 has parameter shards to move
            if shards == 1 and zero > 0 and not params:
                continue  # one data-parallel rank: ZeRO shards nothing (stage 3 only to offload parameters)
            if fixed.get("expert", 1) > 1 and offload != "none":
                continue  # the plan refuses it: the expert weights step outside the offloaded engines
            for policy in options.ac_policies:
                for schedule, virtual in _schedules(pp, n_layer, options):
                    for m in _micro_batches(batch_per_rank, options):
                        if _unfilled_rounds(schedule, pp, m):
                            continue
                        for sp, keep in product(
                            (False, True) if tp > 1 and options.sequence_parallel else (False,),
                            (False, True) if _keeps(zero, pp, m, params) else (False,),
                        ):
                            yield Choice(
                                dp,
                                tp,
                                pp,
                                zero,
                                m,
                                schedule,
                                policy,
                                offload,
                                batch_per_rank,
                                virtual,
                                sp,
                                zero3_keep_gathered=keep,
                                **fixed,
                            )


def plan_layouts(
    facts: ModelFacts,
    cluster: Cluster,
    options: PlannerOptions = PlannerOptions(),
    check: Optional[Check] = None,
) -> list[Candidate]:
    """Every enumerated layout, predicted: fitting ones by predicted tokens/s (fastest first),
    then the rejected ones with their reason.

    Example::

        cands = plan_layouts(facts, Cluster(nodes=1, devices_per_node=8, device_memory_gb=80), PlannerOptions())
        best = cands[0]  # best.choice.options() -> ThreeDStrategy(**...)
    """
    world = cluster.world_size
    batch = options.global_batch(world)
    host_budget = cluster.host_bytes / cluster.devices_per_node
    device_budget = cluster.device_bytes - options.reserve_gb * GB
    fitting, rejected = [], []
    checked: dict[tuple, Optional[str]] = {}
    nf4_problem = qlora_problem(facts.blocks[0]) if "qlora" in options.adapters else None
    contexts = options.context_sizes_for(world, facts.seq_len, facts.context_ready)
    refuse_expert_sizes(facts, options, world)
    unsplit_fits: set[Choice] = set()  # see _unsplit_twin
    for dp, tp, pp, cp in _splits(world, contexts):
        problem = _split_problem(facts, cluster, batch, dp, tp, pp, cp)
        if problem is not None:
            rejected.append(
                Candidate(
                    Choice(dp, tp, pp, batch_per_rank=max(1, batch // dp), context=cp),
                    kind=problem[0],
                    reason=problem[1],
                )
            )
            continue
        experts = _expert_sizes(facts, options, dp, tp, pp, cp)
        if not experts:
            rejected.append(
                Candidate(
                    Choice(dp, tp, pp, batch_per_rank=max(1, batch // dp), context=cp),
                    kind="expert sizes",
                    reason=(
                        f"none of expert_sizes={list(options.expert_sizes)} divides data={dp} and "
                        f"n_experts={facts.experts.n_experts} beside tensor={tp}, pipeline={pp}, "
                        f"context={cp} (an expert axis combines with {', '.join(EXPERT_COMBINES)} "
                        "and ZeRO)"
                    ),
                )
            )
            continue
        for choice in _choices(dp, tp, pp, batch // dp, facts, options, cp, experts):
            choice = run_settings(choice, facts, options)
            if pp > 1 and choice.schedule != "gpipe" and choice.micro_batches < pp:
                # torch's Schedule1F1B refuses fewer micro-batches than stages; the interleaved
                # schedules run them, but their bubble is then far above (p - 1) / (v·m): not modelled
                continue
            if cp > 1 and _unsplit_twin(choice) in unsplit_fits:
                continue  # never faster than its twin that fits unsplit
            if choice.adapter == "qlora" and nf4_problem is not None:
                rejected.append(Candidate(choice, kind="NF4 shapes", reason=nf4_problem))
                continue
            error = _plan_error(choice, world, check, checked)
            if error is not None and choice.loss_chunks > 1 and options.loss_chunks == "auto":
                # The run's "auto" means whole logits wherever a count is refused.
                choice = replace(choice, loss_chunks=1)
                error = _plan_error(choice, world, check, checked)
            if error is None:
                error = optimizer_error(choice, facts, options)
            if error is not None:
                rejected.append(Candidate(choice, kind="plan check", reason=error))
                continue
            keys = [
                (policy, tp) + (("sp",) if choice.sequence_parallel else ())
                for policy in ("none", choice.ac_policy)
            ]
            if any(key not in facts.activations for key in keys):
                rejected.append(
                    Candidate(
                        choice,
                        kind="activations not measured",
                        reason=(
                            f"no activation measurement for ac_policy={choice.ac_policy!r} at tensor={tp}"
                            f"{' with sequence parallelism' if choice.sequence_parallel else ''} "
                            "(model_facts(tp_sizes=...) lacks it)"
                        ),
                    )
                )
                continue
            base = choice  # before the kit: what a split's unsplit twin is looked up by
            memory = rank_memory(facts, choice, options)
            if memory.total > device_budget and options.memory_kit:
                accepts = functools.partial(_accepts, world=world, check=check, cache=checked)
                choice, memory = climb(choice, facts, options, device_budget, accepts)
            time = kit_step_time(facts, choice, cluster, options)
            cand = Candidate(
                choice,
                memory,
                time,
                mfu(facts, time, cluster, world, choice.adapter, options.lora_r),
            )
            if memory.total > device_budget:
                reserve = f" (+{options.reserve_gb:g} GB reserved)" if options.reserve_gb else ""
                cand = replace(
                    cand,
                    kind="device memory",
                    reason=(
                        f"needs {human(memory.total)} per rank{reserve} > {cluster.device_memory_gb:g} GB"
                    ),
                )
            elif memory.host > host_budget:
                cand = replace(
                    cand,
                    kind="host memory",
                    reason=(
                        f"needs {human(memory.host)} of host memory per rank x {cluster.devices_per_node} > "
                        f"{cluster.host_memory_gb:g} GB per node"
                    ),
                )
            elif memory.disk * cluster.devices_per_node > cluster.nvme_gb * GB:
                cand = replace(
                    cand,
                    kind="NVMe space",
                    reason=(
                        f"needs {human(memory.disk)} on the drive per rank x {cluster.devices_per_node} > "
                        f"{cluster.nvme_gb:g} GB per node"
                    ),
                )
            (fitting if cand.fits else rejected).append(cand)
            if cand.fits and cp == 1:
                unsplit_fits.add(base)
    fitting.sort(key=_rank_key)
    return fitting + rejected


def plan_candidates(
    module: Any,
    cluster: Cluster,
    options: PlannerOptions,
    *,
    tp_sizes: Optional[list[int]] = None,
    name: str = "model",
) -> tuple[ModelFacts, list[Candidate]]:
    """Facts of ``module`` (built on ``meta``), activations measured at every tensor size a node
    allows (or ``tp_sizes``), and :func:`plan_layouts` with the strategy's own check of the model:
    what the CLI and ``parallelism=auto`` both plan from."""
    from lightning_3d.options.model_check import check
    from lightning_3d.planner.experts import expert_facts
    from lightning_3d.planner.facts import model_facts

    facts = model_facts(
        module,
        seq_len=options.seq_len,
        precision=options.precision,
        tp_sizes=tp_sizes or divisors(cluster.devices_per_node),
        name=name,
        policies=tuple(dict.fromkeys(("none", *options.ac_policies))),
        sequence_parallel=options.sequence_parallel,
        methods=options.adapters,
        lora_r=options.lora_r,
    )
    facts = replace(facts, experts=expert_facts(module))  # None for a dense model
    return facts, plan_layouts(facts, cluster, options, check=functools.partial(check, module))


def _rank_key(c: Candidate) -> tuple:
    """Fastest first; among equally fast layouts the simpler one (less sharding, recomputation,
    offload, fewer micro-batches), then the one with more memory to spare."""
    ch = c.choice
    simpler = (
        ADAPTERS.index(ch.adapter),
        ch.context,
        ch.expert,
        ch.zero_stage,
        ch.zero3_keep_gathered,
        ("none", "selective", "full").index(ch.ac_policy),
        OFFLOADS.index(ch.offload),
        ch.pipeline,
        ch.tensor,
        ch.schedule in MULTI_STAGE,
        ch.virtual_stages,
        ch.sequence_parallel,
        ch.micro_batches,
        ch.activation_offload,  # the kit's rungs, costliest first
        ch.optimizer == LOW_BIT_OPTIMIZER,
        ch.loss_chunks > 1,
    )
    return (-round(c.tokens_per_s, 6), *simpler, c.memory.total)


def _accepts(choice: Choice, world: int, check: Optional[Check], cache: dict) -> bool:
    """Whether the strategy's own checks take ``choice`` (:func:`_plan_error`)."""
    return _plan_error(choice, world, check, cache) is None


def _plan_error(choice: Choice, world: int, check: Optional[Check], cache: dict) -> Optional[str]:
    """The strategy's own verdict on ``choice``: ``Plan.from_options`` and the model check. An NVMe
    choice is checked with this machine's temporary directory standing in for the cluster's drive
    (the run names its own ``offload_path``)."""
    options = choice.options()
    if choice.offload_device == "nvme":
        options["offload_path"] = tempfile.gettempdir()
    # Micro-batch counts are settled by the enumeration (divisors of the batch, torch's rounds:
    # _unfilled_rounds), so one verdict serves every count of a layout.
    key = (choice.adapter, *sorted((k, v) for k, v in options.items() if k != "micro_batches"))
    if key not in cache:
        try:
            plan = Plan.from_options(**options)
            if choice.adapter == "qlora":
                refuse_qlora_plan(plan)
            if check is not None:
                for shape_key, checked, size in _model_checks(choice, plan, world):
                    if shape_key not in cache:
                        try:
                            check(checked(), size)
                            cache[shape_key] = None
                        except ValueError as err:
                            cache[shape_key] = str(err)
                    if cache[shape_key] is not None:
                        raise ValueError(cache[shape_key])
            cache[key] = None
        except ValueError as err:
            cache[key] = str(err)
    return cache[key]


def _unsplit_twin(choice: Choice) -> Optional[Choice]:
    """The layout that runs ``choice``'s micro-batches' tokens unsplit: its context ranks made
    data ranks, each with whole sequences (``None`` where the per-rank batch does not divide).
    It computes the same FLOPs per rank and needs no attention exchanges; its activations differ
    only by the attention's quadratic share (more unsplit). So where it fits, ``choice`` is never
    faster (the splits are enumerated after it: ``_splits`` starts at context 1)."""
    if choice.batch_per_rank % choice.context:
        return None
    return replace(
        choice,
        data=choice.data * choice.context,
        context=1,
        context_scheme=Choice.context_scheme,
        batch_per_rank=choice.batch_per_rank // choice.context,
    )


def _model_checks(
    choice: Choice, plan: Plan, world: int
) -> Iterator[tuple[tuple, Callable[[], Plan], int]]:
    """(cache key, plan to build, world) of the model checks ``choice`` needs, each keyed by what it
    depends on: the tensor and pipeline split (sequence parallelism builds another tensor plan),
    checked unsplit by sequence, then the context split alone (the routing of the attention; the
    heads' divisibility by context x tensor is settled by :func:`_choices`' scheme), so each
    context size adds one cheap check instead of another tensor plan per split."""
    if choice.tensor > 1 or choice.pipeline > 1:
        key = ("shape", choice.tensor, choice.pipeline, plan.pp.virtual_stages)
        key += (plan.tp.sequence_parallel, choice.loss_chunks)  # a stage's head may refuse chunks
        unsplit = functools.partial(plan.updated, data=choice.data * choice.context, context=1)
        yield key, unsplit, world
    if choice.loss_chunks > 1 and choice.tensor == 1 and choice.pipeline == 1:
        # The shape check above carries the count; without one, the head is checked alone.
        chunked = functools.partial(Plan.from_options, loss_chunks=choice.loss_chunks)
        yield ("loss", choice.loss_chunks), chunked, 1
    if choice.context > 1:
        split = functools.partial(
            Plan.from_options, context=choice.context, context_scheme=choice.context_scheme
        )
        yield ("context", choice.context, choice.context_scheme), split, choice.context
    if choice.expert > 1:  # the model's experts split over that many ranks
        split = functools.partial(Plan.from_options, expert=choice.expert)
        yield ("expert", choice.expert), split, choice.expert


def least_memory(candidates: list[Candidate]) -> Optional[Candidate]:
    """Of the layouts refused for memory alone, the one that needs the least device memory."""
    refused = [c for c in candidates if c.kind == "device memory"]
    return min(refused, key=lambda c: c.memory.total) if refused else None
