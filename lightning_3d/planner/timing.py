"""Predicted time of one optimizer step: compute, exposed communication, pipeline bubble, offload.

**Compute**: training FLOPs per token of the slowest pipeline stage on one rank, ``6·N`` for its
matmul weights (forward 2, backward 4; tensor-split weights divided by ``tensor``) plus
``12·L·d·T / tensor`` for attention scores (PaLM's count, which ignores the causal mask's
savings), at ``peak_tflops × efficiency``. Full activation checkpointing runs each block's
forward again: blocks' time × (1 + ``forward_share``), 8/6 with the default share of 1/3 (the
forward's 2 of 6 FLOPs); selective recomputes only elementwise ops (no matmul FLOPs, so nothing
is added: its cost is memory traffic, outside this model).

**Communication** (ring collectives, bytes one rank sends over its link): data-parallel
gradient sync once per step — ZeRO 0 an all-reduce (2·(n−1)/n·G), ZeRO 1-2 a reduce-scatter of
gradients plus an all-gather of updated parameters, ZeRO 3 a reduce-scatter plus two parameter
all-gathers (forward and backward, in the compute dtype) — over the intra-node link when the
data-parallel group sits in one node (``data × tensor ≤ devices_per_node``, tensor innermost),
else the inter-node link; up to ``overlap`` of the backward time hides it (ZeRO-3's gathers
overlap the forward too). Tensor parallelism: per block and micro-batch, 2 all-reduces of the
activations in forward and 2 in backward (2 more when full checkpointing recomputes), always
exposed, on the intra-node link (tensor groups never cross nodes). Pipeline: each micro-batch's
activations forward and gradients back, one hop per stage.

**Bubble**: ``(p − 1) / m`` of the compute time (so ``(p−1)/(m+p−1)`` of compute + bubble), for
GPipe and 1F1B alike. Every collective and message also costs ``latency_us``, and every block's
forward and backward on one micro-batch ``launch_overhead_us`` (so tiny micro-batches are not
free). **Offload**: the host's Adam over this rank's shard, plus gradients down
and parameters up over the host link.

MFU counts the model's FLOPs (without recomputation) per second over the world's peak.

**Calibrated against measured runs** (``python -m lightning_3d.planner.calibration --time``:
a 3.3 M-parameter GPT, fp32, on this project's 2-core CPU, gloo; the table in the README).
What the measurements led to, each a device constant that ``lightning_3d.planner.machine``
measures rather than a per-layout factor:

- **optimizer step** (new, ``StepTime.optimizer``): Adam's memory-bound pass over the rank's parameters
  (ZeRO 1-3: its shard) at ``adam_params_per_s``; offloaded layouts keep the host's Adam. ZeRO
  1/2 measured 5-9% faster than ZeRO 0 at equal traffic, which only this term predicts;
- **full checkpointing** recomputes ``forward_share`` of a block's time (was a fixed 2/6 of its
  FLOPs); measured 0.31-0.33 here, so 8/6 stays the default, and full checkpointing measured
  1.2-1.3x a plain step, as predicted;
- **CPU ranks** do not overlap communication (``overlap=0``,
  :data:`lightning_3d.planner.auto.CPU_OPTIONS`): gloo reduces and copies on the rank's own core;
- the rate of a rank is the measured rate of a whole block (``machine.block_rate``), not a bare
  matmul's: 85-95% of it per core here, but 65% with two threads in one process.

Still under-predicted here (not fitted, see the README): tensor parallelism (measured 1.7-1.9x its
prediction; the all-reduces are ~15% of it, DTensor dispatch per op is the likely rest),
ZeRO-3 (1.5x: FSDP2's per-block gathers and copies beyond their traffic) and selective
checkpointing (+15% over no checkpointing, modelled as free).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_3d.parallel.stages import stage_blocks
from lightning_3d.planner.choice import Choice, PlannerOptions
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.facts import ModelFacts
from lightning_3d.planner.memory import stage_parts


@dataclass(frozen=True)
class StepTime:
    compute: float  # seconds
    comm: float  # exposed communication
    bubble: float
    offload: float
    tokens: int  # tokens per optimizer step, whole world
    optimizer: float = 0.0  # the on-device optimizer step (after the pipeline flushes: no bubble)

    @property
    def total(self) -> float:
        return self.compute + self.comm + self.bubble + self.offload + self.optimizer

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total if self.total > 0 else 0.0


def model_flops_per_token(facts: ModelFacts) -> float:
    return 6 * facts.flop_params + 12 * facts.n_layer * facts.d_model * facts.seq_len


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_time(facts: ModelFacts, choice: Choice, cluster: Cluster, options: PlannerOptions) -> StepTime:
    p_b, g_b, _, act = facts.bytes
    dp, tp, pp, m = choice.data, choice.tensor, choice.pipeline, choice.micro_batches
    seq, d = facts.seq_len, facts.d_model
    tokens_rank = choice.batch_per_rank * seq  # tokens one data-parallel rank processes per step
    recompute = 1 + options.forward_share if choice.ac_policy == "full" else 1.0
    speed = cluster.peak_tflops * 1e12 * options.efficiency
    stages = stage_parts(facts, pp)
    runs = stage_blocks(facts.n_layer, pp)
    compute = 0.0
    for s, (part, blocks) in enumerate(stages):
        block_flops = sum(facts.blocks[i].flop_params for i in runs[s])
        other = part.flop_params - block_flops  # the head (embedding lookups have no matmul)
        attention = 12 * blocks * d * seq
        # The plans split every matmul weight of a block and the head across the tensor ranks.
        per_token = ((6 * block_flops + attention) * recompute + 6 * other) / tp
        launches = m * blocks * options.launch_overhead_us * 1e-6
        compute = max(compute, tokens_rank * per_token / speed + launches)
    # Data-parallel gradient sync of the largest stage.
    elements = max(part.local(tp) for part, _ in stages)
    ring = _ring(dp)
    gathered = act if facts.precision.endswith("mixed") else p_b
    volume = {0: 2 * ring * elements * g_b, 1: ring * elements * (g_b + p_b), 2: ring * elements * (g_b + p_b),
              3: ring * elements * (g_b + 2 * gathered)}[choice.zero_stage]
    inside = dp * tp <= cluster.devices_per_node
    dp_bw = (cluster.intra_node_gbps if inside or cluster.nodes == 1 else cluster.inter_node_gbps) * 1e9
    hideable = (compute * 2 / 3) / (m if pp > 1 else 1)  # backward of the last micro-batch only, under a pipeline
    if choice.zero_stage == 3:
        hideable = compute / (m if pp > 1 else 1)
    latency = options.latency_us * 1e-6
    if dp == 1:
        messages = 0
    elif choice.zero_stage == 3:  # per block: gather in forward, gather and reduce-scatter in backward
        messages = 3 * facts.n_layer // pp
    else:
        messages = (2 if choice.zero_stage else 1) * max(1, -(-elements * g_b // (options.bucket_size_mb * 2**20)))
    dp_time = max(0.0, volume / dp_bw + messages * latency - options.overlap * hideable)
    # Tensor parallelism: activation all-reduces per block and micro-batch.
    blocks = max(b for _, b in stages)
    per_allreduce = 2 * _ring(tp) * choice.micro_batch_size * seq * d * act
    count = 4 + (2 if choice.ac_policy == "full" else 0)
    tp_time = m * blocks * count * (per_allreduce / (cluster.intra_node_gbps * 1e9) + latency) if tp > 1 else 0.0
    # Pipeline: activations forward and gradients back across each stage boundary.
    pp_time = 0.0
    if pp > 1:
        across = dp * tp >= cluster.devices_per_node and cluster.nodes > 1
        bw = (cluster.inter_node_gbps if across else cluster.intra_node_gbps) * 1e9
        pp_time = 2 * m * (choice.micro_batch_size * seq * d * act / bw + latency)
    bubble = compute * (pp - 1) / m
    optimizer = 0.0
    if choice.offload == "none":  # the optimizer's pass over this rank's (ZeRO: sharded) parameters
        optimizer = elements / (dp if choice.zero_stage >= 1 else 1) / options.adam_params_per_s
    offload = 0.0
    if choice.offload != "none":
        shard = elements / (dp if choice.zero_stage >= 1 else 1)
        adam = shard / (options.cpu_adam_params_per_s / cluster.devices_per_node)
        offload = adam + shard * (g_b + p_b) / (cluster.host_link_gbps * 1e9)
        if choice.offload == "cpu+params":  # per micro-batch: shards up for forward and backward, gradients down
            offload += m * shard * (2 * p_b + g_b) / (cluster.host_link_gbps * 1e9)
    tokens = choice.batch_per_rank * dp * seq
    return StepTime(compute, dp_time + tp_time + pp_time, bubble, offload, tokens, optimizer)


def mfu(facts: ModelFacts, time: StepTime, cluster: Cluster, world_size: int) -> float:
    return model_flops_per_token(facts) * time.tokens_per_s / (world_size * cluster.peak_tflops * 1e12)
