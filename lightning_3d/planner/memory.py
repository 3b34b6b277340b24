"""Per-rank memory of a layout: parameters, gradients, optimizer state, activations, buffers.

Model state follows the ZeRO paper on the data axis (stage 1 shards the optimizer state, 2 also
the gradients, 3 also the parameters), applied to what one rank holds before sharding: its
pipeline stage's parameters (uniform split by block count, the embedding on the first stage,
final norm and head on the last; a tied weight on both, as the pipeline keeps a copy per stage),
with the parameters the tensor-parallel plan splits divided by ``tensor``. ZeRO 1-2 slice flat
buckets evenly (``1 / data``); ZeRO-3 shards are counted as FSDP2 cuts them, parameter by
parameter, ``ceil(rows / data)`` rows of dim 0 (so rank 0 holds the most, and a small dim on
many ranks is far from ``1 / data``: :meth:`~lightning_3d.planner.facts.Part.sharded`). Bytes per element by
precision: :data:`lightning_3d.planner.facts.PRECISIONS`. Offload moves Adam's state (fp32 moments,
plus an fp32 master of every parameter held on the device, fp32 ones too:
:func:`~lightning_3d.planner.facts.offloaded_state_bytes`) to host memory; ``cpu+params`` moves
ZeRO-3's parameter and gradient shards there too (fp32 shards in host memory are their own master).
Under ``bf16-true`` at ZeRO 0-2 offload is ZeRO-Offload's split (:func:`offload_split`): the device
keeps the bf16 weights and a few buckets of gradient staging (a buffer), host memory the fp32
masters and their fp32 gradients (8 B, sharded from stage 1), the store Adam's moments (8 B).
``zero_master_weights=False`` (:func:`keeps_masters`) keeps no masters at ZeRO 0-2: bf16 moments
(4 B) without offload, the offloaded optimizer's own masters with it (no split). The split's
pinned landing buffers are host memory too (:func:`host_landing_bytes`). An MoE model's experts
at ``expert`` > 1: :mod:`lightning_3d.planner.expert_memory`.

A fine-tune method (``Choice.adapter``: LoRA, QLoRA) trains its adapters alone: the frozen base
counts as parameters only, and gradients, optimizer state and offload follow the adapters
(:mod:`lightning_3d.planner.methods`).

Under an interleaved schedule a rank holds ``virtual_stages`` stages (``r``, ``r + p``, ...), the
first on rank 0 and the last on rank ``p − 1``. Offload to ``nvme`` keeps Adam's state on the
drive (``MemorySplit.disk``) and in host memory only its streaming window.

Activations: the measured bytes per block per sample (:mod:`lightning_3d.planner.activations`)
at this rank's share of the sequence (``seq_len / context``)
× the blocks of a chunk (a rank's blocks over its ``virtual_stages``) × the micro-batch size ×
the chunks in flight at the peak (:func:`lightning_3d.planner.schedule.in_flight_chunks`: no
pipeline one; GPipe all ``m``; 1F1B ``min(m, p − r)`` on rank ``r``; the interleaved schedules
by torch's warm-up count). A checkpointed block's
backward recomputes it, so one block's uncheckpointed bytes exist at once on top. The last stage
also keeps the logits (vocab-parallel: ``V / tensor``) and their fp32 softmax for the loss, or
with ``loss_chunks`` one chunk's of them (:func:`~lightning_3d.planner.activations.head_loss_bytes`).

Buffers: the module's buffers; ZeRO 0-2's gradient bucket in flight; ZeRO-3's gathered block
(this one and the prefetched next, in the compute dtype) and one block's unsharded gradients,
or under a pipeline the stage's whole gathered weights and unsharded gradients, which torch's
stage holds to the step's end (:func:`pipeline_held_bytes`); a pipeline's send and receive
activations.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from lightning_3d.offload.optimizer import DEFAULT_CHUNK_BYTES, DEFAULT_WINDOW
from lightning_3d.offload.storage import pinned_bytes
from lightning_3d.parallel.optimizers import STOCHASTIC_ROUNDING
from lightning_3d.parallel.stages import stage_blocks, stage_ids
from lightning_3d.parallel.zero import HOST_IN_FLIGHT, MIN_BUCKET_BYTES, MIN_BUCKETS
from lightning_3d.planner.activations import head_loss_bytes
from lightning_3d.planner.choice import Choice, PlannerOptions
from lightning_3d.planner.expert_memory import expert_state, gathered_experts, stage_expert_parts
from lightning_3d.planner.facts import (
    MASTER_STATE_BYTES,
    ModelFacts,
    Part,
    offloaded_state_bytes,
    optimizer_state_bytes,
)
from lightning_3d.planner.methods import (
    adapter_activation_bytes,
    adapter_part,
    frozen_bytes,
    projections,
    trained_part,
)
from lightning_3d.planner.schedule import in_flight_chunks

GB = 1e9
# The NVMe store's streaming window in host RAM.
NVME_RESIDENT_BYTES = DEFAULT_WINDOW * DEFAULT_CHUNK_BYTES


def human(nbytes: float) -> str:
    """``31.2 GB``, ``12.3 MB``, ``4.1 kB`` (powers of 1000, as device memory is sold)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"


@dataclass(frozen=True)
class MemorySplit:
    """Bytes on one device (and the host bytes that rank needs)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    host: float = 0.0
    stage: int = 0  # the pipeline rank this split is for (the largest one)
    disk: float = 0.0  # bytes on the node's drive (offload to nvme)

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_state + self.activations + self.buffers


def stage_parts(facts: ModelFacts, pipeline: int, virtual: int = 1) -> list[tuple[Part, int]]:
    """(parameters, number of blocks) of each pipeline rank, its ``virtual`` stages together.
    Computed once per split (``ModelFacts.memo``): the search asks for it per candidate."""
    key = ("stage_parts", pipeline, virtual)
    if key not in facts.memo:
        facts.memo[key] = tuple(_stage_parts(facts, pipeline, virtual))
    return list(facts.memo[key])


def _stage_parts(facts: ModelFacts, pipeline: int, virtual: int) -> list[tuple[Part, int]]:
    stages = pipeline * virtual
    runs = stage_blocks(facts.n_layer, stages)
    parts = []
    for s, run in enumerate(runs):
        part = Part()
        for i in run:
            part = part + facts.blocks[i]
        if s == 0:
            part = part + facts.first
        if s == stages - 1:
            part = part + facts.last
        parts.append((part, len(run)))
    out = []
    for rank in range(pipeline):
        part, blocks = Part(), 0
        for s in stage_ids(rank, pipeline, virtual):
            part, blocks = part + parts[s][0], blocks + parts[s][1]
        if pipeline == 1:  # one rank holds a tied weight once
            part = part - facts.tied
        out.append((part, blocks))
    return out


def stage_block_parts(facts: ModelFacts, pipeline: int, virtual: int = 1) -> list[Part]:
    """The blocks' parameters (no embedding, no head) of each pipeline rank, as :func:`stage_parts`."""
    key = ("stage_block_parts", pipeline, virtual)
    if key not in facts.memo:
        facts.memo[key] = tuple(_stage_block_parts(facts, pipeline, virtual))
    return list(facts.memo[key])


def _stage_block_parts(facts: ModelFacts, pipeline: int, virtual: int) -> list[Part]:
    runs = stage_blocks(facts.n_layer, pipeline * virtual)
    out = []
    for rank in range(pipeline):
        part = Part()
        for s in stage_ids(rank, pipeline, virtual):
            for i in runs[s]:
                part = part + facts.blocks[i]
        out.append(part)
    return out


def model_state(
    facts: ModelFacts,
    choice: Choice,
    part: Part,
    dp_rank: int = 0,
    blocks: Part | None = None,
    lora_r: int = 8,
    stage: int = 0,
    experts_sharded_over_replicas: Optional[bool] = None,
) -> tuple[float, float, float, float, float]:
    """(params, grads, optimizer, host, disk) bytes of data rank ``dp_rank`` holding ``part`` of
    the model, pipeline rank ``stage``'s (``blocks``: its blocks' share, which an adapter method
    needs). ZeRO 1-2 slice flat buckets evenly; ZeRO-3 chunks each parameter's dim 0
    (:meth:`Part.sharded`: rank 0, the default, holds the most), the frozen base's like the
    rest. ``experts_sharded_over_replicas``: an MoE model's rule
    (:mod:`lightning_3d.planner.expert_memory`; ``None``: the strategy's)."""
    if choice.expert > 1 and facts.experts is not None:
        experts = stage_expert_parts(facts, choice.pipeline, choice.virtual_stages)[stage]
        dense = model_state(facts, replace(choice, expert=1), part - experts, dp_rank)
        masters = keeps_masters(facts, choice)
        held = expert_state(facts, choice, experts, dp_rank, masters, experts_sharded_over_replicas)
        return held.added_to(dense)
    p_b, g_b, o_b, _ = facts.bytes
    # ZeRO shards over data × context: those ranks hold the same layers.
    dp, z, tp = choice.data * choice.context, choice.zero_stage, choice.tensor
    if keeps_masters(facts, choice):
        o_b = MASTER_STATE_BYTES[facts.precision]
    o_b = sum(optimizer_state_bytes(choice.optimizer, o_b).values())  # low-bit moments: less

    def held(p: Part) -> float:
        return p.sharded(tp, dp, dp_rank) if z == 3 else p.local(tp)

    frozen = 0.0
    if choice.adapter != "none":
        if blocks is None:
            raise ValueError(f"adapter={choice.adapter!r}: model_state needs the stage's blocks")
        frozen = frozen_bytes(choice.adapter, held(part), held(projections(blocks)), p_b)
    trained = trained_part(choice.adapter, part, blocks, lora_r)
    n = trained.local(tp)
    shard = trained.sharded(tp, dp, dp_rank) if z == 3 else n / dp
    params = frozen + (shard * p_b if z == 3 else n * p_b)
    grads = shard * g_b if z >= 2 else n * g_b
    optimizer = shard * o_b if z >= 1 else n * o_b
    host = disk = 0.0
    if choice.offload != "none":
        optimizer = 0.0
        owned = shard if z >= 1 else n
        state = owned * offloaded_state_bytes(p_b, choice.offload_params)
        kept = 0.0  # the split: fp32 masters and their gradients, in host memory beside the store
        if offload_split(facts, choice):
            state, kept, grads = owned * 8.0, owned * 8.0, 0.0
        if choice.offload_device == "nvme":
            disk, host = state, float(NVME_RESIDENT_BYTES) + kept
        else:  # pinned on an accelerator, in blocks whose last one the allocator rounds up
            host = pinned_bytes(state) + kept
    if choice.offload_params:  # ZeRO-3 only (the plan check refuses it otherwise)
        host += params + grads
        params = grads = 0.0
    return params, grads, optimizer, host, disk


def keeps_masters(facts: ModelFacts, choice: Choice) -> bool:
    """Whether ZeRO 0-2 keep fp32 masters of a module held in bf16 (``MASTER_STATE_BYTES``),
    stepped in each rank's slice (stage 0: whole): ``zero_master_weights`` (the default; False
    steps the bf16 weights with bf16 moments, the precision table's bytes, as one process
    does), and not for an optimizer that rounds into the bf16 weights itself (it refuses them).
    ZeRO-3 (FSDP2) steps the shards the module holds."""
    return (
        facts.precision in MASTER_STATE_BYTES
        and choice.zero_stage < 3
        and choice.zero_master_weights
        and choice.optimizer not in STOCHASTIC_ROUNDING
    )


def offload_split(facts: ModelFacts, choice: Choice) -> bool:
    """Whether offload is ZeRO-Offload's split (``parallel/zero.py``, host masters): a module
    held in bf16 with fp32 masters kept (``zero_master_weights``, ``MASTER_STATE_BYTES``) at
    ZeRO 0-2 with an offload device. The device then holds no gradient between steps, only up
    to two buckets in flight. Without masters the offloaded optimizer keeps its own in its
    store and the device the bf16 gradients (:func:`offloaded_state_bytes`)."""
    held_in_bf16 = facts.precision in MASTER_STATE_BYTES
    masters = choice.zero_master_weights
    return choice.offload != "none" and choice.zero_stage < 3 and held_in_bf16 and masters


def host_landing_bytes(
    facts: ModelFacts, choice: Choice, options: PlannerOptions, trained: float
) -> float:
    """The split's pinned landing buffers (``HostLanding``): ``HOST_IN_FLIGHT + 1`` of the
    largest bucket part a rank lands (its slice from stage 1), in the gradients' dtype. A bucket
    of ``trained`` elements (one param group: an upper bound) is ``bucket_size_mb``, or a
    quarter of a smaller one, not under 1 MiB (``ZeroDataParallel._bucket_limit``)."""
    if not offload_split(facts, choice):
        return 0.0
    p_b, g_b = facts.bytes[0], facts.bytes[1]
    floor = MIN_BUCKET_BYTES // p_b
    limit = min(options.bucket_size_mb * 2**20 // p_b, max(floor, -(-int(trained) // MIN_BUCKETS)))
    bucket = min(limit, trained)
    part = bucket / (choice.data * choice.context) if choice.zero_stage >= 1 else bucket
    return (HOST_IN_FLIGHT + 1) * pinned_bytes(part * g_b)


def predicted_rank(
    facts: ModelFacts,
    choice: Choice,
    rank: int,
    experts_sharded_over_replicas: Optional[bool] = None,
) -> dict[str, float]:
    """What the planner predicts ``rank`` holds (mesh ``(pp, dp, cp, tp)``, tensor innermost).

    ZeRO shards over data x context flattened (``dp_cp``, data outer), so the rank's index on
    that axis is its index over the ranks of its stage, tensor ranks aside. ``buffer_bytes``: the
    module's registered buffers, which no plan splits or shards; under a pipeline a stage keeps
    only its own modules' (and those every stage runs), which the facts do not tell apart: the
    whole model's there is an upper bound."""
    shards = choice.data * choice.context
    stage, dp_rank = rank // (shards * choice.tensor), rank // choice.tensor % shards
    part, _ = stage_parts(facts, choice.pipeline, choice.virtual_stages)[stage]
    sharded = {"experts_sharded_over_replicas": experts_sharded_over_replicas}
    params, grads, optimizer, _, _ = model_state(
        facts, choice, part, dp_rank, stage=stage, **sharded
    )
    # The run's meter adds up every micro-batch of the step: the whole per-rank batch.
    fit = facts.activation(choice.ac_policy, choice.tensor, choice.sequence_parallel)
    act = fit.bytes_per_sample(facts.seq_len) * choice.batch_per_rank
    return {
        "param_bytes": params,
        "grad_bytes": grads,
        "optimizer_state_bytes": optimizer,
        "activation_bytes_per_block": act,
        "buffer_bytes": float(facts.buffer_bytes),
    }


def ratio(predicted: float, measured: float) -> float:
    """``predicted / measured``; 1 when both are 0, infinite when only ``measured`` is."""
    if measured:
        return predicted / measured
    return float("inf") if predicted else 1.0


def activation_bytes(
    facts: ModelFacts, choice: Choice, stage: int, blocks: int, lora_r: int = 8
) -> float:
    """Saved activations of pipeline rank ``stage`` (holding ``blocks`` blocks) at their peak
    (see the module docstring); an adapter method adds its ``r``-wide outputs to every block it
    does not checkpoint whole."""
    seq = facts.seq_len // choice.context  # this rank's tokens of each sequence
    mb = choice.micro_batch_size
    policy, tp, sp, method = (
        choice.ac_policy,
        choice.tensor,
        choice.sequence_parallel,
        choice.adapter,
    )
    fit = facts.activation(policy, tp, sp, method)
    metered = facts.measured_method(policy, tp, sp, method)  # the adapters' bytes are in the fit
    extra = (
        0.0
        if metered
        else adapter_activation_bytes(method, facts.blocks[0], lora_r, seq, facts.bytes[3])
    )
    per_block = (fit.bytes_per_sample(seq) + (extra if choice.ac_policy != "full" else 0)) * mb
    m, p, v = choice.micro_batches, choice.pipeline, choice.virtual_stages
    chunks = in_flight_chunks(choice.schedule, p, m, stage, v)
    total = per_block * blocks / v * chunks
    if choice.activation_offload and blocks:
        # Saves wait on the host (offloaded_activation_bytes); backward brings one block's back.
        total = per_block
    if choice.ac_policy != "none" and blocks:  # one block recomputed at a time in backward
        whole = facts.activation("none", tp, sp, method).bytes_per_sample(seq)
        if not facts.measured_method("none", tp, sp, method):
            whole += adapter_activation_bytes(method, facts.blocks[0], lora_r, seq, facts.bytes[3])
        total += max(0.0, whole * mb - per_block)
    if stage == p - 1:
        act = facts.bytes[3]
        tokens, vocab, chunks = seq * mb, facts.vocab_size, choice.loss_chunks
        head = head_loss_bytes(tokens, vocab, facts.d_model, act, chunks, choice.tensor)
        total += head * (m if p > 1 and choice.schedule == "gpipe" else 1)
    return total


def offloaded_activation_bytes(facts: ModelFacts, choice: Choice, stage: int, blocks: int) -> float:
    """Host bytes of pipeline rank ``stage``'s offloaded block activations (``activation_offload``)
    at their peak: every block's saves of every micro-batch in flight (adapters' not modelled)."""
    if not choice.activation_offload or not blocks:
        return 0.0
    fit = facts.activation(choice.ac_policy, choice.tensor, choice.sequence_parallel)
    per_block = fit.bytes_per_sample(facts.seq_len // choice.context) * choice.micro_batch_size
    p, m, v = choice.pipeline, choice.micro_batches, choice.virtual_stages
    return per_block * blocks / v * in_flight_chunks(choice.schedule, p, m, stage, v)


def buffer_bytes(facts: ModelFacts, choice: Choice, options: PlannerOptions) -> float:
    """The module's buffers; ZeRO 0-2's gradient bucket in flight (no larger than what trains);
    ZeRO-3's gathered block, this one and the prefetched next (the base at its compute dtype, or
    NF4), and one block's unsharded gradients; a pipeline's send and receive activations;
    QLoRA's one projection dequantized for its matmul."""
    p_b, g_b, _, act = facts.bytes
    tp, r = choice.tensor, options.lora_r
    total = float(facts.buffer_bytes)
    compute = act if facts.precision.endswith("mixed") else p_b
    shards = choice.data * choice.context  # ZeRO's axis
    split = offload_split(facts, choice)
    if (shards > 1 or split) and choice.zero_stage < 3:
        bucket = options.bucket_size_mb * 2**20
        if choice.adapter != "none":
            bucket = min(bucket, adapter_part(sum(facts.blocks, Part()), r).local(tp) * g_b)
        # The split: a bucket lands on the host while the next one is reduced.
        total += bucket * (2 if split else 1)
    # Under a pipeline the stage's whole gathered weights are the peak, counted per stage
    # (pipeline_held_bytes), not a block at a time.
    if choice.zero_stage == 3 and (shards > 1 or choice.offload_params) and choice.pipeline == 1:
        if choice.adapter == "none":
            gathered = max(b.local(tp) for b in facts.blocks)
            if choice.expert > 1 and facts.experts is not None:
                # A block gathers its dense part, and its rank's experts only where FSDP2 shards
                # them over their replica group (planner/expert_memory.py).
                gathered -= facts.experts.expert_params / facts.experts.moe_layers
                gathered += gathered_experts(facts, choice)
            total += gathered * (2 * compute + g_b)
        else:
            block = max(facts.blocks, key=lambda b: b.params)
            base = frozen_bytes(
                choice.adapter, block.local(tp), projections(block).local(tp), compute
            )
            total += 2 * base + adapter_part(block, r).local(tp) * (2 * compute + g_b)
    accumulated = choice.micro_batches > 1 and choice.pipeline == 1
    if choice.zero3_keep_gathered and accumulated:
        # Through an accumulated step every unit stays gathered (compute dtype) and its
        # gradients unsharded (reduce dtype): the whole stage's (parallel/fsdp.py); with
        # adapters the frozen base is gathered as it is held and only the adapters have
        # gradients.
        whole = stage_parts(facts, 1)[0][0]
        total += _gathered_with_grads(facts, choice, whole, sum(facts.blocks, Part()), r)
    if choice.zero2_defer_reduce and choice.zero_stage == 2 and accumulated and not split:
        # ZeRO-2 holding full-size gradients over the step's micro-batches (what trains),
        # beside its reduced shard (model_state's); the bucket in flight counted above is one
        # of them, counted twice: over by one bucket (parallel/zero.py).
        whole = stage_parts(facts, 1)[0][0]
        trained = whole if choice.adapter == "none" else adapter_part(sum(facts.blocks, Part()), r)
        total += trained.local(tp) * g_b
    if choice.adapter == "qlora":
        total += max((n for (_, n, _), _ in projections(facts.blocks[0]).tensors), default=0) * act
    if choice.pipeline > 1:
        total += 2 * choice.micro_batch_size * facts.seq_len // choice.context * facts.d_model * act
    return total


def _gathered_with_grads(
    facts: ModelFacts, choice: Choice, part: Part, blocks: Part, lora_r: int
) -> float:
    """Bytes of ``part`` gathered whole (compute dtype) with its gradients unsharded (reduce
    dtype); with adapters the frozen base is gathered as it is held (``blocks``: the part's
    blocks, whose projections an adapter method changes) and only the adapters have gradients."""
    p_b, g_b, _, act = facts.bytes
    tp = choice.tensor
    compute = act if facts.precision.endswith("mixed") else p_b
    if choice.adapter == "none":
        return part.local(tp) * (compute + g_b)
    base = frozen_bytes(choice.adapter, part.local(tp), projections(blocks).local(tp), compute)
    return base + adapter_part(blocks, lora_r).local(tp) * (compute + g_b)


def pipeline_held_bytes(
    facts: ModelFacts, choice: Choice, part: Part, blocks: Part, lora_r: int = 8, stage: int = 0
) -> float:
    """What ZeRO-3 under a pipeline holds on a rank holding ``part`` (``blocks``: its blocks'
    share) beside its shards: torch's stage runs every backward with
    ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``
    (``_PipelineStageBase.backward_maybe_with_nosync``) and reduce-scatters and reshards only in
    ``perform_reduce_grad`` after the last micro-batch. So from a stage's first backward to the
    step's end its gradients are unsharded, and after each backward every unit stays gathered
    (a later forward reshards it, the next backward gathers it again): the peak, at the last
    backward, holds the stage's whole weights in the compute dtype and its whole gradients in
    the reduce dtype. With several stages per rank each reduces after its own last backward:
    when the rank's later stage reduces, its earlier one has run a backward since its last
    forward and holds its whole weights and gradients too, so all of the rank's stages at once
    are the peak (counted on pp2 x dp2 under Interleaved1F1B). Nothing without a pipeline, or where
    FSDP2 does not shard (one data rank, no ``offload_params``). At ``expert`` > 1 pipeline rank
    ``stage``'s experts are held as its model state counts them, outside FSDP2's units, or
    gathered ``1 / expert`` of them where FSDP2 shards them over their replicas."""
    shards = choice.data * choice.context
    sharded = shards > 1 or choice.offload_params
    if choice.zero_stage != 3 or choice.pipeline == 1 or not sharded:
        return 0.0
    if choice.expert > 1 and facts.experts is not None:
        experts = stage_expert_parts(facts, choice.pipeline, choice.virtual_stages)[stage]
        layers = experts.params * facts.experts.moe_layers / facts.experts.expert_params
        part = part - experts + Part(round(gathered_experts(facts, choice) * layers))
    return _gathered_with_grads(facts, choice, part, blocks, lora_r)


def _first_of_each_kind(facts: ModelFacts, pipeline: int, virtual: int) -> tuple[int, ...]:
    """The pipeline ranks whose memory can be the largest: the first of each kind (the same
    parts, the same blocks, last or not). A later rank of a kind keeps no more in flight (every
    schedule's count falls or stays with the rank), so it never holds more."""
    key = ("first_of_each_kind", pipeline, virtual)
    if key not in facts.memo:
        stages = stage_parts(facts, pipeline, virtual)
        blocks = stage_block_parts(facts, pipeline, virtual)
        firsts: dict[tuple, int] = {}
        for stage, (part, _) in enumerate(stages):
            firsts.setdefault((part, blocks[stage], stage == len(stages) - 1), stage)
        facts.memo[key] = tuple(sorted(firsts.values()))
    return facts.memo[key]


def rank_memory(facts: ModelFacts, choice: Choice, options: PlannerOptions) -> MemorySplit:
    """The largest stage's per-rank memory (by device total)."""
    best = None
    buffers = buffer_bytes(facts, choice, options)
    block_parts = stage_block_parts(facts, choice.pipeline, choice.virtual_stages)
    stages = stage_parts(facts, choice.pipeline, choice.virtual_stages)
    for stage in _first_of_each_kind(facts, choice.pipeline, choice.virtual_stages):
        part, blocks = stages[stage]
        params, grads, optimizer, host, disk = model_state(
            facts, choice, part, blocks=block_parts[stage], lora_r=options.lora_r, stage=stage
        )
        held = pipeline_held_bytes(facts, choice, part, block_parts[stage], options.lora_r, stage)
        trained = trained_part(choice.adapter, part, block_parts[stage], options.lora_r)
        host += host_landing_bytes(facts, choice, options, trained.local(choice.tensor))
        split = MemorySplit(
            params,
            grads,
            optimizer,
            activation_bytes(facts, choice, stage, blocks, options.lora_r),
            buffers + held,
            host + offloaded_activation_bytes(facts, choice, stage, blocks),
            stage,
            disk,
        )
        if best is None or split.total > best.total:
            best = split
    return best
