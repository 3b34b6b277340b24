"""Predicted time of one optimizer step: compute, exposed communication, pipeline bubble, offload.

**Compute**: training FLOPs per token of the slowest pipeline stage on one rank, ``6·N`` for its
matmul weights (forward 2, backward 4; tensor-split weights divided by ``tensor``) plus
``12·L·d·T / tensor`` for attention scores (PaLM's count, which ignores the causal mask's
savings), at ``peak_tflops × efficiency``. Where the cluster gives its devices'
``matmul_efficiency`` and ``memory_gbps``, the efficiency is each matmul's own instead
(:func:`gemm_efficiency`, from the shapes the layout gives it: :func:`matmul_efficiencies`), and
the block's memory-bound passes (norms, residuals, softmax: :func:`elementwise_bytes`) add their
bytes at the memory's speed; held against Megatron-LM's published 1.7 B-1 T runs
(``python -m tools.calibration.published``: 0.97-1.10 of their throughput, where the flat 0.5
drifted from 1.13 on the smallest to 0.72 on the largest). Full activation checkpointing runs
each block's forward again: blocks' time × (1 + ``forward_share``), 8/6 with the default share of 1/3 (the
forward's 2 of 6 FLOPs); selective recomputes only elementwise ops (no matmul FLOPs), which costs
blocks' time × (1 + ``selective_share``): memory traffic and dispatch, measured. A
tensor-parallel block costs (1 + ``tp_overhead``) of its FLOP share: norms and residuals every
tensor rank repeats, and the per-op dispatch of distributed tensors.

**Communication** (ring collectives, bytes one rank sends over its link): data-parallel
gradient sync as the engines send it, micro-batch by micro-batch under accumulation
(:mod:`lightning_3d.planner.traffic`) — ZeRO 0 an all-reduce (2·(n−1)/n·G) once, ZeRO 1-2 a
reduce-scatter of gradients (ZeRO 2: each micro-batch) plus an all-gather of updated
parameters, ZeRO 3 per micro-batch a reduce-scatter plus two parameter all-gathers (forward and
backward, in the compute dtype; once for the units kept gathered), a reduce-scatter's bytes counting
1/``reduce_scatter_efficiency`` and an all-gather's 1/``all_gather_efficiency`` (1 with NCCL's
rings; gloo's are slower than its all-reduce per byte) — over the intra-node link when the
data-parallel group sits in one node (``data × tensor ≤ devices_per_node``, tensor innermost),
else the inter-node link; up to ``overlap`` of the backward time hides it (ZeRO-3's gathers
overlap the forward too). Tensor parallelism: per block and micro-batch, 2 all-reduces of the
activations in forward and 2 in backward (2 more when full checkpointing recomputes), always
exposed, on the intra-node link (tensor groups never cross nodes): the project's eager DTensor
plans wait for each before the next op (no compiled async tensor parallelism), and the published
runs agree (hiding them all would put their tensor-parallel runs 4-15 % above what they measured).
ZeRO-3 under a pipeline gathers ``m + 1`` times a step, each prefetched behind any
micro-batch's compute, and reduce-scatters once after the schedule's last backward, behind
nothing. Pipeline: each micro-batch's activations forward and gradients back, one hop per stage.

**Experts** (an MoE model, :mod:`lightning_3d.planner.experts`): a token runs through ``top_k``
of each layer's experts, so only that share of their weights counts FLOPs, at any expert size.
At ``expert`` > 1 ZeRO's traffic is the dense part's, the experts' gradients are all-reduced
over the ranks holding the same experts, and per micro-batch each MoE layer's token rows go to
their experts' ranks and back, forward and backward, over the expert group's link, exposed
(:func:`~lightning_3d.planner.experts.all_to_all_time`).

**Bubble** (:mod:`lightning_3d.planner.schedule`): ``(p − 1) / m`` of the compute time for GPipe
and 1F1B alike (so ``(p−1)/(m+p−1)`` of compute + bubble), ``(p − 1) / (v·m)`` for interleaved
1F1B with ``v`` stages per rank, a third of that for zero-bubble (weight gradients fill the
idle slots); the pipeline's messages are ``2·v·m`` per rank. Every collective and message also
costs ``latency_us``, and every block's
forward and backward on one micro-batch ``launch_overhead_us`` (so tiny micro-batches are not
free). **Step overhead** (``StepTime.overhead``): ``step_overhead_us`` once per optimizer step,
whatever the model — the training loop, the data loader, the strategy's per-step agreement
collectives. **Offload**: the host's Adam over this rank's shard (with ``nvme``: or the drive's
reading and writing the shard's state, ``nvme_gbps`` shared by the node's ranks, whichever is
slower, as the store streams while Adam steps), plus gradients down and parameters up over the
host link. Sequence parallelism moves the same activation bytes as tensor parallelism's
all-reduces (a reduce-scatter and an all-gather each), so its time is tensor parallelism's.

**Fine-tune methods** (``Choice.adapter``): a frozen weight needs no gradient of its own, so its
matmuls cost 4 FLOPs per token (forward 2, input gradient 2) where a trained one costs 6; the
adapters cost 6 per parameter. Gradient communication, the optimizer step and offload move the
adapters alone; ZeRO-3 still gathers the frozen base (NF4 under QLoRA) for every forward and
backward. Not modelled: QLoRA's dequantization of each projection before its matmul (a
memory-bound pass over the weight, small beside the matmul at training batch sizes).

MFU counts the model's FLOPs (without recomputation) per second over the world's peak.

**Calibrated against measured runs** (``python -m tools.calibration.memory --time``:
a 3.3 M-parameter GPT, fp32, on this project's 2-core CPU, gloo; the table in docs/planner.md).
What the measurements led to, each a device constant that ``tools.calibration.machine``
measures rather than a per-layout factor:

- **optimizer step** (new, ``StepTime.optimizer``): Adam's memory-bound pass over the rank's parameters
  (ZeRO 1-3: its shard) at ``adam_params_per_s``; offloaded layouts keep the host's Adam. ZeRO
  1/2 measured 5-9% faster than ZeRO 0 at equal traffic, which only this term predicts;
- **full checkpointing** recomputes ``forward_share`` of a block's time (was a fixed 2/6 of its
  FLOPs); measured 0.31-0.33 here, so 8/6 stays the default, and full checkpointing measured
  1.2-1.3x a plain step, as predicted;
- **CPU ranks** do not overlap communication (``overlap=0``,
  :data:`lightning_3d.strategy.auto.CPU_OPTIONS`): gloo reduces and copies on the rank's own core;
- the rate of a rank is the measured rate of a whole block (``machine.block_rate``), not a bare
  matmul's: 85-95% of it per core here, but 65% with two threads in one process.

- **step overhead**: a tiny GPT (2 blocks of 32 wide) trained by Lightning measures what a step
  costs whatever the model, beyond what this model predicts for it: ~5 ms in one process, ~15 ms
  on two gloo ranks (the loss mean, the non-finite flag, the gradient buckets' launches, each a
  gloo round trip): most of the 35 ms the 2-rank layouts measured above their prediction;
- **gloo's reduce-scatter and all-gather** (ZeRO 1-3) are slower per byte than its all-reduce:
  each is timed against it (``reduce_scatter_efficiency`` ~0.3-0.85, ``all_gather_efficiency``
  ~0.25-0.6 here), the rest of that gap;
- **tensor parallelism**: one GPT block under the built-in plan, its forward + backward timed on
  two ranks less its 4 activation all-reduces, over its FLOP share at the block rate
  (``tp_overhead``, 0.1-1.3 here: noisy on a loaded machine);
- **selective checkpointing**: a block's forward + backward with and without it
  (``selective_share``, 0.15-0.35 here).

Still under-predicted: ZeRO-3 (FSDP2's per-block hooks and copies beyond its traffic, not a term
yet) and, on a loaded machine, every 2-rank layout (two ranks wait for each other at every
collective, so a third job's time slices cost them twice).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_3d.parallel.stages import stage_blocks, stage_ids
from lightning_3d.planner.choice import Choice, PlannerOptions
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.expert_memory import expert_shards
from lightning_3d.planner.experts import all_to_all_time, expert_traffic, inactive_flop_params
from lightning_3d.planner.facts import ModelFacts, Part, offloaded_state_bytes
from lightning_3d.planner.memory import stage_block_parts, stage_parts
from lightning_3d.planner.methods import adapter_part, frozen_bytes, projections, trained_part
from lightning_3d.planner.schedule import bubble_share, messages
from lightning_3d.planner.traffic import accumulation, step_traffic


@dataclass(frozen=True)
class StepTime:
    compute: float  # seconds
    comm: float  # exposed communication
    bubble: float
    offload: float
    tokens: int  # tokens per optimizer step, whole world
    optimizer: float = 0.0  # the on-device optimizer step (after the pipeline flushes: no bubble)
    # The step's fixed cost: loop, data loader, per-step agreement collectives.
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.compute + self.comm + self.bubble + self.offload + self.optimizer + self.overhead
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total if self.total > 0 else 0.0


def model_flops_per_token(facts: ModelFacts, adapter: str = "none", lora_r: int = 8) -> float:
    """Training FLOPs per token: 6 per trained matmul weight, 4 per frozen one (an adapter
    method's base), and attention's scores."""
    attention = 12 * facts.n_layer * facts.d_model * facts.seq_len
    weights = facts.flop_params - inactive_flop_params(facts, facts.n_layer)  # MoE: top_k experts
    if adapter == "none":
        return 6 * weights + attention
    phi = adapter_part(sum(facts.blocks, Part()), lora_r).params
    return 4 * weights + 6 * phi + attention


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def _block_flops(facts: ModelFacts, pp: int, v: int) -> tuple[int, ...]:
    """Each pipeline rank's blocks' matmul weights, once per split (``ModelFacts.memo``)."""
    key = ("block_flops", pp, v)
    if key not in facts.memo:
        runs = stage_blocks(facts.n_layer, pp * v)
        facts.memo[key] = tuple(
            sum(facts.blocks[i].flop_params for k in stage_ids(s, pp, v) for i in runs[k])
            for s in range(pp)
        )
    return facts.memo[key]


def gemm_efficiency(m: float, k: float, n: float, cluster: Cluster, act: int) -> float:
    """The share of peak an ``(m × k) @ (k × n)`` matmul reaches: ``e / (1 + e · ridge / I)``.

    ``I = 2·m·k·n / (act · (m·k + k·n + m·n))`` is its arithmetic intensity (FLOPs per byte of
    operands and result crossing device memory once), ``ridge = peak / memory bandwidth`` the
    device's (A100: 153 FLOP/byte, H100: 295), ``e`` the device's ``matmul_efficiency``.
    It is the roofline with its two sides added rather than overlapped, the conservative
    reading: a matmul of thousands on every side is compute-bound and reaches ``e``; one with a
    small side (a head's width in attention scores, a tensor-split projection's ``h/tp``, a
    micro-batch of few tokens) streams its operands at memory speed, and reaches ``e/2`` where
    ``I = e·ridge`` (a square matmul of about 370 on an A100). The backward's two matmuls have
    the forward's dimensions in another order, hence the same intensity.
    """
    if cluster.matmul_efficiency is None or cluster.memory_gbps is None:
        raise ValueError("gemm_efficiency needs cluster.matmul_efficiency and cluster.memory_gbps")
    e = cluster.matmul_efficiency
    intensity = 2 * m * k * n / (act * (m * k + k * n + m * n))
    ridge = cluster.peak_tflops * 1e12 / (cluster.memory_gbps * 1e9)
    return e / (1 + e * ridge / intensity)


def block_gemms(facts: ModelFacts, tp: int) -> tuple[tuple[float, float, float], ...]:
    """``(in, out, weight elements)`` of each matmul weight of a block on one tensor rank: from
    the parameters' shapes where the facts hold them (a weight split on dim 0 divides its
    outputs, on dim 1 its inputs), else a GPT block's (``qkv``: ``d→3d``, ``proj``, ``fc1``:
    ``d→f``, ``fc2``, ``f`` from the block's matmul weights)."""
    key = ("block_gemms", tp)
    if key in facts.memo:
        return facts.memo[key]
    d, block = facts.d_model, facts.blocks[0]
    out = []
    for (rows, elements, dim), count in block.tensors:
        if elements == rows:  # a vector: a norm's or a bias, no matmul
            continue
        o, i = rows, elements // rows
        o, i = (o / tp, i) if dim == 0 else (o, i / tp) if dim == 1 else (o, i)
        out.append((i, o, count * i * o))
    if not out:
        f = max(d, (block.flop_params - 4 * d * d) / (2 * d))
        out = [(d, 3 * d / tp, 3 * d * d / tp), (d / tp, d, d * d / tp)]
        out += [(d, f / tp, d * f / tp), (f / tp, d, d * f / tp)]
    facts.memo[key] = tuple(out)
    return facts.memo[key]


def matmul_efficiencies(
    facts: ModelFacts, choice: Choice, cluster: Cluster, options: PlannerOptions
) -> tuple[float, float, float]:
    """Shares of peak of a block's weight matmuls, its attention scores and the head, on one
    rank under ``choice``: :func:`gemm_efficiency` of each, the weight matmuls' combined by
    FLOPs (their time adds). The token dimension is a micro-batch's local tokens; attention's
    two products per head are ``(s × hd) @ (hd × s)`` and ``(s × s) @ (s × hd)`` with ``hd``
    the head width and ``s`` the sequence a rank attends over (a ring's local chunk). Without
    the cluster's ``matmul_efficiency``: the flat ``efficiency`` for all three."""
    if cluster.matmul_efficiency is None:
        return (options.efficiency,) * 3
    act, tp = facts.bytes[3], choice.tensor
    local = facts.seq_len // choice.context
    tokens = choice.micro_batch_size * local
    gemms = block_gemms(facts, tp)
    flops = sum(w for _, _, w in gemms)
    time = sum(w / gemm_efficiency(tokens, i, o, cluster, act) for i, o, w in gemms)
    head_width = facts.d_model / facts.n_head
    span = local if choice.context > 1 and choice.context_scheme == "ring" else facts.seq_len
    scores = gemm_efficiency(span, head_width, span, cluster, act)
    # A model whose vocabulary the facts do not give: its head at the blocks' share.
    vocab = facts.vocab_size / tp
    head = gemm_efficiency(tokens, facts.d_model, vocab, cluster, act) if vocab else flops / time
    return flops / time, scores, head


def elementwise_bytes(facts: ModelFacts, choice: Choice) -> float:
    """Bytes one rank's block moves per token in its forward outside the matmuls, counted on
    Megatron's fused kernels at the activation dtype: each norm reads and writes the width
    (2 × 2h), each bias-dropout-add reads the branch and the residual and writes the sum and a
    byte mask (2 × 3.5h), the bias-GeLU reads and writes the split 4h, and the scale-mask-softmax
    with its dropout reads and writes each head's scores and writes a mask (4.5 per score,
    ``s`` scores a token per head). In ``act`` units: ``11·h_r + 8·h/tp + 4.5·(heads/tp)·s``,
    ``h_r`` the width a rank's norms and residuals see (``h``; ``h/tp`` with sequence
    parallelism, which splits them by sequence). Its share of a block is what makes narrow
    models slower per FLOP than wide ones at the same matmul sizes: ``h`` and ``s`` over ``h²``."""
    d, tp, act = facts.d_model, choice.tensor, facts.bytes[3]
    local = facts.seq_len // choice.context
    span = local if choice.context > 1 and choice.context_scheme == "ring" else facts.seq_len
    width = d / tp if choice.sequence_parallel else d
    heads = facts.n_head / tp / (choice.context if choice.context_scheme != "ring" else 1)
    return act * (11 * width + 8 * d / tp + 4.5 * heads * span)


def step_time(
    facts: ModelFacts, choice: Choice, cluster: Cluster, options: PlannerOptions
) -> StepTime:
    p_b, g_b, _, act = facts.bytes
    dp, tp, pp, m = choice.data, choice.tensor, choice.pipeline, choice.micro_batches
    cp = choice.context
    seq, d = facts.seq_len, facts.d_model
    local = seq // cp  # this rank's tokens of each sequence
    tokens_rank = choice.batch_per_rank * local  # tokens one rank processes per step
    recompute = {"full": 1 + options.forward_share, "selective": 1 + options.selective_share}.get(
        choice.ac_policy, 1.0
    )
    # A tensor-parallel block also costs what its FLOP share does not count: replicated norms, dispatch.
    split_cost = 1 + options.tp_overhead if tp > 1 else 1.0
    peak = cluster.peak_tflops * 1e12
    e_blocks, e_scores, e_head = matmul_efficiencies(facts, choice, cluster, options)
    v = choice.virtual_stages
    stages = stage_parts(facts, pp, v)
    block_parts = stage_block_parts(facts, pp, v)
    trained = [
        trained_part(choice.adapter, part, block_parts[s], options.lora_r)
        for s, (part, _) in enumerate(stages)
    ]
    weight = 6 if choice.adapter == "none" else 4  # a frozen weight has no gradient of its own
    compute = 0.0
    flops = _block_flops(facts, pp, v)
    for s, (part, blocks) in enumerate(stages):
        block_flops = flops[s] - inactive_flop_params(facts, blocks)
        other = part.flop_params - block_flops  # the head (embedding lookups have no matmul)
        attention = 12 * blocks * d * seq
        adapters = 6 * trained[s].flop_params if choice.adapter != "none" else 0
        # The plans split every matmul weight of a block and the head across the tensor ranks.
        # FLOPs over each kind's share of peak: seconds per token at a peak of 1 FLOP/s.
        per_token = (
            ((weight * block_flops + adapters) / e_blocks + attention / e_scores)
            * recompute
            * split_cost
            + weight * other / e_head
        ) / tp
        launches = m * blocks * options.launch_overhead_us * 1e-6
        # Memory-bound passes at the device's memory speed: forward, a backward of twice its
        # bytes, the recomputed forward (only where the shape model is on: a flat efficiency
        # already holds them).
        streamed = 0.0
        if cluster.memory_gbps is not None and cluster.matmul_efficiency is not None:
            streamed = 3 * recompute * blocks * elementwise_bytes(facts, choice)
            streamed /= cluster.memory_gbps * 1e9
        compute = max(compute, tokens_rank * (per_token / peak + streamed) + launches)
    # Data-parallel gradient sync of the largest stage (what trains: under LoRA the adapters).
    elements = max(t.local(tp) for t in trained)
    shards = dp * cp  # gradients are averaged, and ZeRO shards, over data × context
    gathered = act if facts.precision.endswith("mixed") else p_b
    # ZeRO-3 gathers every parameter (elements at the compute dtype, a frozen base as it is held).
    gathered_bytes = max(
        t.local(tp) * gathered
        + (
            frozen_bytes(choice.adapter, part.local(tp), projections(b).local(tp), gathered)
            if choice.adapter != "none"
            else 0.0
        )
        for t, (part, _), b in zip(trained, stages, block_parts)
    )
    # As the engines send them, micro-batch by micro-batch (planner/traffic.py).
    traffic = step_traffic(facts, choice, options.lora_r)
    if choice.expert > 1 and facts.experts is not None:
        traffic = expert_traffic(facts, choice)  # the dense part over ZeRO, the experts apart
    # Bytes at the all-reduce's rate: a reduce-scatter's and an all-gather's count 1/efficiency each.
    volume = (
        traffic.all_reduce
        + traffic.reduce_scatter / options.reduce_scatter_efficiency
        + traffic.all_gather / options.all_gather_efficiency
    )
    inside = shards * tp <= cluster.devices_per_node
    dp_bw = (
        cluster.intra_node_gbps if inside or cluster.nodes == 1 else cluster.inter_node_gbps
    ) * 1e9
    # Backward of the last micro-batch only, under a pipeline.
    hideable = (compute * 2 / 3) / (m if pp > 1 else 1)
    if choice.zero_stage == 3:
        hideable = compute / (m if pp > 1 else 1)
    latency = options.latency_us * 1e-6
    if shards == 1:
        collectives = 0
    # ZeRO-3 under a pipeline, per block: m + 1 gathers, one reduce-scatter (planner/traffic.py).
    elif choice.zero_stage == 3 and pp > 1:
        collectives = (m + 2) * facts.n_layer // pp
    # ZeRO-3, per block: gather in forward, gather and reduce-scatter in backward.
    elif choice.zero_stage == 3:
        collectives = 3 * facts.n_layer // pp * accumulation(choice)
    else:
        collectives = (2 if choice.zero_stage else 1) * max(
            1, -(-elements * g_b // (options.bucket_size_mb * 2**20))
        )
    dp_time = max(0.0, volume / dp_bw + collectives * latency - options.overlap * hideable)
    if choice.zero_stage == 3 and pp > 1 and shards > 1:
        # The gathers come micro-batch by micro-batch, prefetched behind any of them; the one
        # reduce-scatter runs after the schedule's last backward, behind nothing.
        scatter = traffic.reduce_scatter / options.reduce_scatter_efficiency / dp_bw
        gather = (volume - traffic.reduce_scatter / options.reduce_scatter_efficiency) / dp_bw
        dp_time = max(0.0, gather - options.overlap * compute) + scatter
        dp_time += collectives * latency
    # Tensor parallelism: activation all-reduces per block and micro-batch.
    blocks = max(b for _, b in stages)
    per_allreduce = 2 * _ring(tp) * choice.micro_batch_size * local * d * act
    count = 4 + (2 if choice.ac_policy == "full" else 0)
    tp_time = (
        m * blocks * count * (per_allreduce / (cluster.intra_node_gbps * 1e9) + latency)
        if tp > 1
        else 0.0
    )
    # Pipeline: activations forward and gradients back across each stage boundary.
    pp_time = 0.0
    if pp > 1:
        across = dp * tp >= cluster.devices_per_node and cluster.nodes > 1
        bw = (cluster.inter_node_gbps if across else cluster.intra_node_gbps) * 1e9
        pp_time = messages(pp, m, v) * (choice.micro_batch_size * local * d * act / bw + latency)
    cp_time = context_time(choice, blocks, local * d / tp, act, cluster, latency)
    ep_time = all_to_all_time(facts, choice, cluster, latency)
    bubble = compute * bubble_share(choice.schedule, pp, m, v)
    optimizer = 0.0
    if choice.offload == "none":  # the optimizer's pass over this rank's (ZeRO: sharded) parameters
        owned = elements / (shards if choice.zero_stage >= 1 else 1)
        # The experts are stepped 1/expert on each rank, sharded over their replica group or
        # whole (planner/expert_memory.py), not over ZeRO's data x context shards.
        if choice.expert > 1 and facts.experts is not None:
            held = facts.experts.expert_params
            owned += held / choice.expert / expert_shards(choice)
            owned -= held / (shards if choice.zero_stage >= 1 else 1)
        optimizer = owned / options.adam_params_per_s
    offload = 0.0
    if choice.offload != "none":
        shard = elements / (shards if choice.zero_stage >= 1 else 1)
        adam = shard / (options.cpu_adam_params_per_s / cluster.devices_per_node)
        # The store reads ahead and writes back while Adam steps.
        if choice.offload_device == "nvme":
            state = shard * offloaded_state_bytes(p_b, choice.offload_params)
            adam = max(adam, state / (cluster.nvme_gbps * 1e9 / cluster.devices_per_node))
        offload = adam + shard * (g_b + p_b) / (cluster.host_link_gbps * 1e9)
        # Per micro-batch: shards up for forward and backward, gradients down.
        if choice.offload_params:
            up = gathered_bytes / gathered * p_b / shards  # this rank's shards at their own dtype
            offload += m * (2 * up + shard * g_b) / (cluster.host_link_gbps * 1e9)
    tokens = choice.batch_per_rank * dp * seq
    return StepTime(
        compute,
        dp_time + tp_time + pp_time + cp_time + ep_time,
        bubble,
        offload,
        tokens,
        optimizer,
        options.step_overhead_us * 1e-6,
    )


def context_time(
    choice: Choice, blocks: int, width: float, act: int, cluster: Cluster, latency: float
) -> float:
    """Attention's exchanges over the context ranks in one step: per block and micro-batch,
    with ``n = micro-batch · width`` elements of each of q, k, v on a rank (``width``: this
    rank's tokens × its heads' width), the ring sends ``2n(3N-2)`` in ``3N-2`` messages and
    all-to-all ``8n(N-1)/N`` in 8 (docs/context-parallelism.md); none is hidden behind compute."""
    cp = choice.context
    if cp == 1:
        return 0.0
    n = choice.micro_batch_size * width
    if choice.context_scheme == "ring":
        sent, calls = 2 * n * (3 * cp - 2), 3 * cp - 2
    else:
        sent, calls = 8 * n * (cp - 1) / cp, 8
    inside = cp * choice.tensor <= cluster.devices_per_node or cluster.nodes == 1
    bw = (cluster.intra_node_gbps if inside else cluster.inter_node_gbps) * 1e9
    return choice.micro_batches * blocks * (sent * act / bw + calls * latency)


def mfu(
    facts: ModelFacts,
    time: StepTime,
    cluster: Cluster,
    world_size: int,
    adapter: str = "none",
    lora_r: int = 8,
) -> float:
    """The method's own training FLOPs (no recomputation) per second over the world's peak."""
    flops = model_flops_per_token(facts, adapter, lora_r)
    return flops * time.tokens_per_s / (world_size * cluster.peak_tflops * 1e12)
