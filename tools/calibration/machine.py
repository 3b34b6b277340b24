"""Measure the constants the planner's time model needs, on the machine this runs on.

    python -m tools.calibration.machine [--d-model 256] [--batch 4] [--seq-len 128]

The step-time model (:mod:`lightning_3d.planner.timing`) needs, per rank: the matmul rate a
rank reaches (``Cluster.peak_tflops``, used with ``efficiency=1``), the bandwidth and fixed cost
of a collective between ranks of a node (``Cluster.intra_node_gbps``, ``latency_us``), and the
fixed cost of one block's forward and backward (``launch_overhead_us``). A CPU cannot report
them (``CPU_ASSUMED`` in :mod:`lightning_3d.strategy.auto` guesses them); this module times them:

- **block rate** (the ``peak_tflops`` used): one GPT block trained on a micro-batch of the run's
  shape, its FLOPs as the planner counts them over the measured forward + backward time, with the
  intra-op threads one rank gets (a world of ``w`` ranks on ``c`` cores: ``max(1, c // w)``); and
  the forward's share of that time (what full activation checkpointing's recompute costs:
  ``PlannerOptions.forward_share``). A bare matmul ``(tokens, d) @ (d, 4d)`` is timed too, for
  reference (on this CPU a block reaches 70-100% of it: softmax, norms, GELU and autograd are
  not matmuls);
- **collective cost**: gloo all-reduces between ``world`` local processes
  (:func:`tools.harness.world.run_world`) of a small and a large tensor; the small one is
  the latency, the difference their bandwidth, counted as the planner counts it (the bytes one
  rank sends in a ring, ``2·(n−1)/n`` of the tensor);
- **optimizer rate**: parameters per second AdamW updates with a rank's threads
  (``PlannerOptions.adam_params_per_s``), a memory-bound pass every step makes;
- **block overhead**: one transformer-sized block (``d`` wide) forward and backward on a single
  token, minus its matmul time at the measured rate: what every block costs per micro-batch
  regardless of its size (op dispatch, autograd bookkeeping).

Every figure is a median of repeats: a shared machine makes single timings noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class MachineConstants:
    """What :func:`measure` found. Rates per rank; ``threads``: intra-op threads per rank by world size."""

    # world size -> GFLOP/s one rank reaches in a whole block (its share of the cores)
    gflops: dict[int, float]
    intra_node_gbps: float  # GB/s one rank sends in a ring all-reduce
    latency_us: float  # fixed cost of one collective
    launch_overhead_us: float  # fixed cost of one block's forward + backward on one micro-batch
    threads: dict[int, int]  # world size -> intra-op threads per rank
    forward_share: float = 1 / 3  # of a block's forward + backward time, the forward's
    # world size -> parameters one rank's AdamW steps per second
    adam_params_per_s: Optional[dict[int, float]] = None
    # world size -> bare matmul GFLOP/s (for reference)
    matmul_gflops: Optional[dict[int, float]] = None
    # A reduce-scatter's bytes/s over the all-reduce's (ZeRO 1-3's gradients).
    reduce_scatter_efficiency: float = 1.0
    # An all-gather's likewise (ZeRO 1-2's updated parameters, ZeRO 3's gathers).
    all_gather_efficiency: float = 1.0
    # A tensor-parallel block's time beyond its FLOP share and all-reduces, over that share.
    tp_overhead: float = 0.0
    # What selective checkpointing adds to a block's forward + backward time.
    selective_share: float = 0.0
    # world size -> fixed cost of one optimizer step
    step_overhead_us: Optional[dict[int, float]] = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def threads_per_rank(world: int, cores: Optional[int] = None) -> int:
    """Intra-op threads one rank of ``world`` local ranks gets on ``cores`` cores (at least 1)."""
    cores = cores or os.cpu_count() or 1
    if world < 1:
        raise ValueError(f"world={world} must be a positive integer")
    return max(1, cores // world)


def median_time(fn: Callable[[], Any], repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_gflops(d_model: int, tokens: int, threads: int, repeats: int = 7) -> float:
    """GFLOP/s of an fp32 ``(tokens, d) @ (d, 4d)`` matmul with ``threads`` intra-op threads."""
    import torch

    if d_model < 1 or tokens < 1 or threads < 1:
        raise ValueError(f"d_model={d_model}, tokens={tokens}, threads={threads} must be positive")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(tokens, d_model), torch.randn(d_model, 4 * d_model)
        seconds = median_time(lambda: torch.mm(a, b), repeats=repeats)
    finally:
        torch.set_num_threads(before)
    return 2 * tokens * d_model * 4 * d_model / seconds / 1e9


def block_flops(d_model: int, tokens: int, seq_len: int) -> float:
    """FLOPs of one GPT block's forward and backward on ``tokens`` tokens, counted as the planner
    counts them (:mod:`lightning_3d.planner.timing`): ``6 · 12·d²`` per token for the weights
    (attention 4·d², MLP 8·d²) plus ``12 · d · seq_len`` for the attention scores."""
    return tokens * (6 * 12 * d_model * d_model + 12 * d_model * seq_len)


def block_rate(
    d_model: int, batch: int, seq_len: int, threads: int, repeats: int = 7
) -> tuple[float, float]:
    """(GFLOP/s, forward share) of one GPT block (``d_model`` wide, 64-wide heads) trained on a
    ``(batch, seq_len)`` micro-batch with ``threads`` threads: :func:`block_flops` over the
    measured forward + backward time, and the forward's share of that time. Unlike a bare
    matmul's rate this counts what a step also runs (softmax, norms, activations, autograd), and
    the share says what recomputing a forward (full activation checkpointing) costs."""
    import torch

    from lightning_3d.models.gpt import Block, GPTConfig

    if min(d_model, batch, seq_len, threads) < 1:
        raise ValueError(
            f"d_model={d_model}, batch={batch}, seq_len={seq_len}, threads={threads} must be positive"
        )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        block = Block(
            GPTConfig(
                n_embd=d_model,
                n_head=max(1, d_model // 64),
                block_size=seq_len,
                vocab_size=8,
                n_layer=1,
            )
        )
        x = torch.randn(batch, seq_len, d_model, requires_grad=True)
        both = median_time(lambda: block(x).sum().backward(), repeats=repeats)
        with torch.no_grad():
            forward = median_time(lambda: block(x), repeats=repeats)
    finally:
        torch.set_num_threads(before)
    return block_flops(d_model, batch * seq_len, seq_len) / both / 1e9, min(forward / both, 1.0)


def adam_params_per_s(params: int, threads: int, repeats: int = 7) -> float:
    """Parameters per second that ``torch.optim.AdamW`` (its default, multi-tensor) updates with
    ``threads`` threads, over ``params`` fp32 parameters in 4 tensors: a memory-bound pass over
    parameters, gradients and both moments that every optimizer step makes on every rank."""
    import torch

    if params < 4 or threads < 1:
        raise ValueError(f"params={params} must be >= 4 and threads={threads} >= 1")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        weights = [torch.nn.Parameter(torch.randn(params // 4)) for _ in range(4)]
        for w in weights:
            w.grad = torch.randn_like(w)
        optimizer = torch.optim.AdamW(weights, lr=1e-3)
        seconds = median_time(optimizer.step, repeats=repeats)
    finally:
        torch.set_num_threads(before)
    return 4 * (params // 4) / seconds


def fit_link(small: tuple[int, float], large: tuple[int, float], world: int) -> tuple[float, float]:
    """(GB/s one rank sends, latency in µs) of a ring all-reduce from two timings
    ``(bytes, seconds)``: ``t = latency + 2·(n−1)/n·bytes / bandwidth``. When noise makes the
    large one no slower than the small one, the large one alone gives the bandwidth (latency 0)."""
    (b0, t0), (b1, t1) = small, large
    if not b1 > b0 or world < 2 or not t1 > 0:
        raise ValueError(
            f"need two sizes, the second larger ({b0} -> {b1} bytes), a positive time ({t1} s) "
            f"and world={world} >= 2"
        )
    ring = 2 * (world - 1) / world
    if t1 <= t0:
        return ring * b1 / t1 / 1e9, 0.0
    per_byte = (t1 - t0) / (ring * (b1 - b0))
    latency = max(t0 - ring * b0 * per_byte, 0.0)
    return 1 / per_byte / 1e9, latency * 1e6


def rank_probe(
    rank: int, d_model: int, batch: int, seq_len: int, sizes: Sequence[int], repeats: int
) -> dict[str, Any]:
    """On each rank of a gloo world, all ranks busy at once as in a run: the matmul and block
    rates with this rank's threads, the block overhead, and median seconds of an all-reduce of
    each size (fp32)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    threads = torch.get_num_threads()
    rate = matmul_gflops(d_model, batch * seq_len, threads)
    block, forward_share = block_rate(d_model, batch, seq_len, threads)
    adam = adam_params_per_s(1 << 21, threads)
    overhead = block_overhead_us(d_model, rate, threads)
    selective = selective_share(d_model, batch, seq_len, threads)
    dist.barrier()
    # Every rank a tensor-parallel rank: the world's whole batch on each, as a tensor-parallel run has it.
    world = dist.get_world_size()
    tp_block, tp_allreduces = tp_block_seconds(d_model, batch * world, seq_len)
    # Its FLOPs at the block rate.
    share = block_flops(d_model, batch * world * seq_len, seq_len) / world / (block * 1e9)
    scatter, gather = scatter_gather_seconds(max(sizes))
    times = []
    for n in sizes:
        x = torch.ones(n)

        def once(x: torch.Tensor = x) -> None:
            dist.barrier()
            dist.all_reduce(x)

        barrier = median_time(dist.barrier, repeats=repeats)
        times.append(max(median_time(once, repeats=repeats) - barrier, 1e-9))
    return {
        "matmul_gflops": rate,
        "gflops": block,
        "adam_params_per_s": adam,
        "forward_share": forward_share,
        "overhead_us": overhead,
        "allreduce_s": times,
        "selective_share": selective,
        "tp_overhead": max((tp_block - tp_allreduces) / share - 1, 0.0),
        "scatter_s": scatter,
        "gather_s": gather,
    }


def block_overhead_us(d_model: int, gflops: float, threads: int, repeats: int = 21) -> float:
    """Fixed µs of one GPT block's forward and backward on one token (``d_model`` wide), beyond
    its matmuls at ``gflops``."""
    import torch

    from lightning_3d.models.gpt import Block, GPTConfig

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        heads = max(1, d_model // 64)
        block = Block(
            GPTConfig(n_embd=d_model, n_head=heads, block_size=8, vocab_size=8, n_layer=1)
        )
        x = torch.randn(1, 1, d_model, requires_grad=True)
        seconds = median_time(lambda: block(x).sum().backward(), repeats=repeats)
    finally:
        torch.set_num_threads(before)
    matmuls = 6 * 12 * d_model * d_model / (gflops * 1e9)
    return max(seconds - matmuls, 0.0) * 1e6


def _gpt_block(d_model: int, seq_len: int) -> Any:
    """One block of the project's GPT, ``d_model`` wide with 64-wide heads, inside a ``blocks``
    list (so the built-in tensor-parallel plan's ``*.attn.wq``-style patterns name its layers)."""
    import torch

    from lightning_3d.models.gpt import Block, GPTConfig

    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList(
        [
            Block(
                GPTConfig(
                    n_embd=d_model,
                    n_head=max(1, d_model // 64),
                    block_size=seq_len,
                    vocab_size=8,
                    n_layer=1,
                )
            )
        ]
    )
    return holder


def selective_share(
    d_model: int, batch: int, seq_len: int, threads: int, repeats: int = 7
) -> float:
    """What ``selective`` activation checkpointing adds to a block's forward + backward, as a
    share of the plain block's time: it recomputes the block's elementwise ops (norms, GELU,
    softmax) in backward, no matmul FLOPs but memory traffic and dispatch, plus its caching
    mode's cost on every op. Timed on one GPT block of the run's micro-batch, both ways."""
    import torch

    from lightning_3d.parallel.activation_checkpoint import apply_activation_checkpointing

    if min(d_model, batch, seq_len, threads) < 1:
        raise ValueError(
            f"d_model={d_model}, batch={batch}, seq_len={seq_len}, threads={threads} must be positive"
        )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        holder = _gpt_block(d_model, seq_len)
        x = torch.randn(batch, seq_len, d_model, requires_grad=True)
        plain = median_time(lambda: holder.blocks[0](x).sum().backward(), repeats=repeats)
        apply_activation_checkpointing(holder, "selective")
        selective = median_time(lambda: holder.blocks[0](x).sum().backward(), repeats=repeats)
    finally:
        torch.set_num_threads(before)
    return max(selective / plain - 1, 0.0)


def tp_block_seconds(
    d_model: int, batch: int, seq_len: int, repeats: int = 7
) -> tuple[float, float]:
    """(seconds of a tensor-parallel block's forward + backward, seconds of its all-reduces) on
    this rank of an initialised world, every rank one tensor-parallel rank: one GPT block under
    the project's built-in plan (:data:`lightning_3d.parallel.plans.gpt.GPT_NAMES`) on a
    ``(batch, seq_len)`` micro-batch, and alone the 4 activation all-reduces it makes (2 forward,
    2 backward), so the caller can tell the block's own cost from the communication the time
    model already counts."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.parallel.plans.common import transformer_plan
    from lightning_3d.parallel.plans.gpt import GPT_NAMES
    from lightning_3d.parallel.tensor import apply_tensor_parallel

    world = dist.get_world_size()
    holder = _gpt_block(d_model, seq_len)
    apply_tensor_parallel(
        holder,
        init_device_mesh("cpu", (world,)),
        transformer_plan(GPT_NAMES, False),
        require_all=False,
    )
    x = torch.randn(batch, seq_len, d_model, requires_grad=True)

    def step() -> None:
        dist.barrier()
        holder.blocks[0](x).sum().backward()

    activation = torch.randn(batch, seq_len, d_model)

    def allreduces() -> None:
        dist.barrier()
        for _ in range(4):
            dist.all_reduce(activation)

    barrier = median_time(dist.barrier, repeats=repeats)
    block = median_time(step, repeats=repeats) - barrier
    return max(block, 1e-9), max(median_time(allreduces, repeats=repeats) - barrier, 0.0)


def scatter_gather_seconds(elements: int, repeats: int = 7) -> tuple[float, float]:
    """(seconds of a reduce-scatter, of an all-gather) of ``elements`` fp32 elements on this rank
    of an initialised world, as ZeRO 1-2 run them here: on gloo point to point
    (``ZeroDataParallel``'s ``scatter="auto"``: each row sent to its owner, the rows received
    added to this rank's own; each rank's slice sent to every peer, received in place),
    elsewhere the collectives."""
    import torch
    import torch.distributed as dist

    from lightning_3d.compat import all_gather_single, reduce_scatter_single
    from lightning_3d.parallel.point_to_point import add_rows, gather_rows, scatter_rows

    n, rank = dist.get_world_size(), dist.get_rank()
    full = torch.ones(elements // n * n)
    rows = full.view(n, -1)
    part = torch.empty(elements // n)
    gloo = dist.get_backend() == "gloo"

    def scatter() -> None:
        dist.barrier()
        if gloo:
            handle, received = scatter_rows(None, rows)
            handle.wait()
            add_rows(rows[rank], received)
        else:
            reduce_scatter_single(part, full)

    def gather() -> None:
        dist.barrier()
        if gloo:
            gather_rows(None, rows).wait()
        else:
            all_gather_single(full, part)

    barrier = median_time(dist.barrier, repeats=repeats)
    return (
        max(median_time(scatter, repeats=repeats) - barrier, 1e-9),
        max(median_time(gather, repeats=repeats) - barrier, 1e-9),
    )


def measure(
    d_model: int = 256,
    batch: int = 4,
    seq_len: int = 128,
    world: int = 2,
    small: int = 256,
    large: int = 1 << 20,
    repeats: int = 15,
) -> MachineConstants:
    """Every constant, measured here (see the module docstring): rates of a rank of a 1-process
    world (this process, its share of the cores) and of a ``world``-process one (every rank
    measuring at once, median over ranks); the link, block overhead and forward share inside the
    ``world``-process one."""
    from tools.harness.world import run_world

    if world < 2:
        raise ValueError(f"world={world} must be >= 2 to measure a link")
    threads = {1: threads_per_rank(1), world: threads_per_rank(world)}
    alone = matmul_gflops(d_model, batch * seq_len, threads[1])
    alone_block, _ = block_rate(d_model, batch * world, seq_len, threads[1])
    alone_adam = adam_params_per_s(1 << 21, threads[1])
    ranks = run_world(rank_probe, world, d_model, batch, seq_len, (small, large), repeats)
    found = from_probes(ranks, (small, large), world, alone_block, alone, threads, alone_adam)
    tiny = {
        1: tiny_step_seconds(0, 1),
        world: statistics.median(run_world(tiny_step_seconds, world, world)),
    }
    return step_overheads(found, tiny)


def from_probes(
    ranks: Sequence[Mapping[str, Any]],
    sizes: tuple[int, int],
    world: int,
    alone_block: float,
    alone_matmul: float,
    threads: Mapping[int, int],
    alone_adam: Optional[float] = None,
) -> MachineConstants:
    """:class:`MachineConstants` from every rank's :func:`rank_probe` (medians over ranks) and the
    1-process world's block, matmul (and Adam) rates. The reduce-scatter's and all-gather's
    efficiencies: the ring bytes one rank sends (``(n−1)/n`` of the ``max(sizes)`` fp32 tensor)
    per second, over the all-reduce's fitted bandwidth. Probes of an older version without these
    figures leave them at the defaults (1, 1, 0, 0)."""
    times = [statistics.median(r["allreduce_s"][i] for r in ranks) for i in range(2)]
    gbps, latency = fit_link((4 * sizes[0], times[0]), (4 * sizes[1], times[1]), world)
    med = {
        k: statistics.median(r[k] for r in ranks)
        for k in ("gflops", "matmul_gflops", "overhead_us", "forward_share", "adam_params_per_s")
    }
    extra: dict[str, float] = {}
    if all("scatter_s" in r for r in ranks):
        # Seconds at the all-reduce's bandwidth.
        sent = (world - 1) / world * 4 * max(sizes) / (gbps * 1e9)
        extra["reduce_scatter_efficiency"] = min(
            sent / statistics.median(r["scatter_s"] for r in ranks), 1.0
        )
        extra["all_gather_efficiency"] = min(
            sent / statistics.median(r["gather_s"] for r in ranks), 1.0
        )
        extra["tp_overhead"] = statistics.median(r["tp_overhead"] for r in ranks)
        extra["selective_share"] = statistics.median(r["selective_share"] for r in ranks)
    return MachineConstants(
        {1: alone_block, world: med["gflops"]},
        gbps,
        latency,
        med["overhead_us"],
        dict(threads),
        forward_share=med["forward_share"],
        matmul_gflops={1: alone_matmul, world: med["matmul_gflops"]},
        adam_params_per_s={
            1: alone_adam or med["adam_params_per_s"],
            world: med["adam_params_per_s"],
        },
        **extra,
    )


TINY_STEPS = 13  # a tiny run's optimizer steps: 10 after the run summary's 3 warm-up ones


def tiny_step_seconds(rank: int, world: int, steps: int = TINY_STEPS) -> float:
    """Median seconds of one optimizer step of the tests' tiny GPT (``TINY_MODEL``: 2 blocks of 32
    wide, 8 × 32 tokens), trained by Lightning on ``world`` ranks (1: Lightning's single device,
    in this process; more: one rank of a ``ThreeDStrategy`` data-parallel world, ZeRO 0). Its
    compute is a few milliseconds: the rest is what every step of such a world costs whatever
    the model, which :func:`step_overheads` isolates."""
    from tools.harness.runs import TINY_DATA, Run, fit_gpt

    run = Run(strategy=None if world == 1 else {"zero_stage": 0}, devices=world, steps=steps)
    summary = fit_gpt(rank, run)["summary"]
    return TINY_DATA["batch_size"] * TINY_DATA["block_size"] / summary["tokens_per_s"]


def step_overheads(
    constants: MachineConstants, tiny_seconds: Mapping[int, float]
) -> MachineConstants:
    """``constants`` with ``step_overhead_us``: per world size, the tiny GPT's measured step
    (:func:`tiny_step_seconds`) minus what the time model predicts for it from the other
    constants — the fixed cost of an optimizer step the model's other terms do not hold
    (Lightning's loop, the data loader, the strategy's per-step agreement collectives: the loss
    mean, the non-finite flag; in a world of ``n > 1`` ranks, one gloo round trip each)."""
    import dataclasses

    from lightning_3d.planner.timing import step_time
    from tools.calibration.layouts import choice_of, tiny_facts
    from tools.harness.runs import TINY_DATA

    facts = tiny_facts((1,))
    batch = TINY_DATA["batch_size"]
    without = dataclasses.replace(constants, step_overhead_us={w: 0.0 for w in tiny_seconds})
    overheads = {}
    for world, seconds in tiny_seconds.items():
        cluster, options = (
            machine_cluster(without, world),
            planner_options(without, batch, facts.seq_len, world),
        )
        choice = choice_of(None if world == 1 else {"zero_stage": 0}, world, batch)
        predicted = step_time(facts, choice, cluster, options).total
        overheads[world] = max(seconds - predicted, 0.0) * 1e6
    return dataclasses.replace(constants, step_overhead_us=overheads)


def measured(value: Optional[float]) -> bool:
    """Whether a constant was measured (not ``None`` nor ``nan``, what a round without a world of 2
    leaves for the figures only such a world measures)."""
    return value is not None and value == value


def machine_cluster(constants: MachineConstants, world: int) -> Any:
    """This machine as the planner's :class:`~lightning_3d.planner.Cluster` for a ``world``-rank
    run: one node, the measured block rate as the peak, the measured link inside and between
    nodes (``Cluster``'s default where none was measured: a 1-rank world sends nothing). Memory
    is not what is timed: generous."""
    from lightning_3d.planner.cluster import Cluster

    link = (
        {"intra_node_gbps": constants.intra_node_gbps, "inter_node_gbps": constants.intra_node_gbps}
        if measured(constants.intra_node_gbps)
        else {}
    )
    return Cluster(
        nodes=1,
        devices_per_node=world,
        device_memory_gb=1e3,
        host_memory_gb=1e3,
        peak_tflops=constants.gflops[world] / 1e3,
        host_link_gbps=10.0,
        **link,
    )


def planner_options(constants: MachineConstants, batch: int, seq_len: int, world: int) -> Any:
    """:class:`~lightning_3d.planner.PlannerOptions` for a ``world``-rank run on this machine:
    the measured block rate is the peak (``efficiency=1``), CPU ranks' communication does not
    overlap (``CPU_OPTIONS``), every other modelled cost as measured."""
    from lightning_3d.planner.choice import PlannerOptions
    from lightning_3d.strategy.auto import CPU_OPTIONS

    c = constants
    figures: dict[str, Any] = {
        "latency_us": c.latency_us,
        "launch_overhead_us": c.launch_overhead_us,
        "forward_share": c.forward_share,
        "selective_share": c.selective_share,
        "reduce_scatter_efficiency": c.reduce_scatter_efficiency,
        "all_gather_efficiency": c.all_gather_efficiency,
        "tp_overhead": c.tp_overhead,
        "adam_params_per_s": (c.adam_params_per_s or {}).get(world),
        "step_overhead_us": (c.step_overhead_us or {}).get(world),
    }
    # Not measured (no world of 2 ran): the option's default, which a 1-rank world does not use.
    known = {k: v for k, v in figures.items() if measured(v)}
    return PlannerOptions(
        batch_size=batch,
        seq_len=seq_len,
        precision="32-true",
        efficiency=1.0,
        **{**CPU_OPTIONS, **known},
    )


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="samples per rank of a 2-rank world")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    found = measure(args.d_model, args.batch, args.seq_len)
    for world, rate in found.gflops.items():
        print(
            f"world {world} ({found.threads[world]} thread(s) per rank): block {rate:.1f} GFLOP/s per rank "
            f"(bare matmul {found.matmul_gflops[world]:.1f})"
        )
    print(f"forward share of a block's time: {found.forward_share:.2f}")
    for world, rate in found.adam_params_per_s.items():
        print(f"AdamW, world {world}: {rate / 1e6:.0f} M parameters/s per rank")
    print(
        f"gloo all-reduce between 2 ranks: {found.intra_node_gbps:.2f} GB/s, {found.latency_us:.0f} us latency"
    )
    print(f"block forward+backward fixed cost: {found.launch_overhead_us:.0f} us")
    print(
        f"reduce-scatter / all-gather efficiency (of the all-reduce's bytes/s): "
        f"{found.reduce_scatter_efficiency:.2f} / {found.all_gather_efficiency:.2f}"
    )
    print(
        f"tensor-parallel block overhead: {found.tp_overhead:.2f} of its FLOP share; selective checkpointing "
        f"adds {found.selective_share:.2f} of a block's time"
    )
    for world, us in (found.step_overhead_us or {}).items():
        print(f"fixed cost of one optimizer step, world {world}: {us / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
