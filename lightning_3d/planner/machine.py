"""Measure the constants the planner's time model needs, on the machine this runs on.

    python -m lightning_3d.planner.machine [--d-model 256] [--batch 4] [--seq-len 128]

The step-time model (:mod:`lightning_3d.planner.timing`) needs, per rank: the matmul rate a
rank reaches (``Cluster.peak_tflops``, used with ``efficiency=1``), the bandwidth and fixed cost
of a collective between ranks of a node (``Cluster.intra_node_gbps``, ``latency_us``), and the
fixed cost of one block's forward and backward (``launch_overhead_us``). A CPU cannot report
them (``CPU_ASSUMED`` in :mod:`lightning_3d.planner.auto` guesses them); this module times them:

- **block rate** (the ``peak_tflops`` used): one GPT block trained on a micro-batch of the run's
  shape, its FLOPs as the planner counts them over the measured forward + backward time, with the
  intra-op threads one rank gets (a world of ``w`` ranks on ``c`` cores: ``max(1, c // w)``); and
  the forward's share of that time (what full activation checkpointing's recompute costs:
  ``PlannerOptions.forward_share``). A bare matmul ``(tokens, d) @ (d, 4d)`` is timed too, for
  reference (on this CPU a block reaches 70-100% of it: softmax, norms, GELU and autograd are
  not matmuls);
- **collective cost**: gloo all-reduces between ``world`` local processes
  (:func:`lightning_3d.testing.world.run_world`) of a small and a large tensor; the small one is
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

    gflops: dict[int, float]  # world size -> GFLOP/s one rank reaches in a whole block (its share of the cores)
    intra_node_gbps: float  # GB/s one rank sends in a ring all-reduce
    latency_us: float  # fixed cost of one collective
    launch_overhead_us: float  # fixed cost of one block's forward + backward on one micro-batch
    threads: dict[int, int]  # world size -> intra-op threads per rank
    forward_share: float = 1 / 3  # of a block's forward + backward time, the forward's
    adam_params_per_s: Optional[dict[int, float]] = None  # world size -> parameters one rank's AdamW steps per second
    matmul_gflops: Optional[dict[int, float]] = None  # world size -> bare matmul GFLOP/s (for reference)

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


def block_rate(d_model: int, batch: int, seq_len: int, threads: int, repeats: int = 7) -> tuple[float, float]:
    """(GFLOP/s, forward share) of one GPT block (``d_model`` wide, 64-wide heads) trained on a
    ``(batch, seq_len)`` micro-batch with ``threads`` threads: :func:`block_flops` over the
    measured forward + backward time, and the forward's share of that time. Unlike a bare
    matmul's rate this counts what a step also runs (softmax, norms, activations, autograd), and
    the share says what recomputing a forward (full activation checkpointing) costs."""
    import torch

    from lightning_3d.models.gpt import Block, GPTConfig

    if min(d_model, batch, seq_len, threads) < 1:
        raise ValueError(f"d_model={d_model}, batch={batch}, seq_len={seq_len}, threads={threads} must be positive")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        block = Block(GPTConfig(n_embd=d_model, n_head=max(1, d_model // 64), block_size=seq_len, vocab_size=8,
                                n_layer=1))
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
        raise ValueError(f"need two sizes, the second larger ({b0} -> {b1} bytes), a positive time ({t1} s) "
                         f"and world={world} >= 2")
    ring = 2 * (world - 1) / world
    if t1 <= t0:
        return ring * b1 / t1 / 1e9, 0.0
    per_byte = (t1 - t0) / (ring * (b1 - b0))
    latency = max(t0 - ring * b0 * per_byte, 0.0)
    return 1 / per_byte / 1e9, latency * 1e6


def _rank_probe(rank: int, d_model: int, batch: int, seq_len: int, sizes: Sequence[int], repeats: int
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
    dist.barrier()
    times = []
    for n in sizes:
        x = torch.ones(n)

        def once() -> None:
            dist.barrier()
            dist.all_reduce(x)

        barrier = median_time(dist.barrier, repeats=repeats)
        times.append(max(median_time(once, repeats=repeats) - barrier, 1e-9))
    return {"matmul_gflops": rate, "gflops": block, "adam_params_per_s": adam, "forward_share": forward_share,
            "overhead_us": overhead, "allreduce_s": times}


def block_overhead_us(d_model: int, gflops: float, threads: int, repeats: int = 21) -> float:
    """Fixed µs of one GPT block's forward and backward on one token (``d_model`` wide), beyond
    its matmuls at ``gflops``."""
    import torch

    from lightning_3d.models.gpt import Block, GPTConfig

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        heads = max(1, d_model // 64)
        block = Block(GPTConfig(n_embd=d_model, n_head=heads, block_size=8, vocab_size=8, n_layer=1))
        x = torch.randn(1, 1, d_model, requires_grad=True)
        seconds = median_time(lambda: block(x).sum().backward(), repeats=repeats)
    finally:
        torch.set_num_threads(before)
    matmuls = 6 * 12 * d_model * d_model / (gflops * 1e9)
    return max(seconds - matmuls, 0.0) * 1e6


def measure(d_model: int = 256, batch: int = 4, seq_len: int = 128, world: int = 2, small: int = 256,
            large: int = 1 << 20, repeats: int = 15) -> MachineConstants:
    """Every constant, measured here (see the module docstring): rates of a rank of a 1-process
    world (this process, its share of the cores) and of a ``world``-process one (every rank
    measuring at once, median over ranks); the link, block overhead and forward share inside the
    ``world``-process one."""
    from lightning_3d.testing.world import run_world

    if world < 2:
        raise ValueError(f"world={world} must be >= 2 to measure a link")
    threads = {1: threads_per_rank(1), world: threads_per_rank(world)}
    alone = matmul_gflops(d_model, batch * seq_len, threads[1])
    alone_block, _ = block_rate(d_model, batch * world, seq_len, threads[1])
    alone_adam = adam_params_per_s(1 << 21, threads[1])
    ranks = run_world(_rank_probe, world, d_model, batch, seq_len, (small, large), repeats)
    return from_probes(ranks, (small, large), world, alone_block, alone, threads, alone_adam)


def from_probes(ranks: Sequence[Mapping[str, Any]], sizes: tuple[int, int], world: int, alone_block: float,
                alone_matmul: float, threads: Mapping[int, int], alone_adam: Optional[float] = None
                ) -> MachineConstants:
    """:class:`MachineConstants` from every rank's :func:`_rank_probe` (medians over ranks) and the
    1-process world's block, matmul (and Adam) rates."""
    times = [statistics.median(r["allreduce_s"][i] for r in ranks) for i in range(2)]
    gbps, latency = fit_link((4 * sizes[0], times[0]), (4 * sizes[1], times[1]), world)
    med = {k: statistics.median(r[k] for r in ranks) for k in ("gflops", "matmul_gflops", "overhead_us",
                                                                "forward_share", "adam_params_per_s")}
    return MachineConstants({1: alone_block, world: med["gflops"]}, gbps, latency, med["overhead_us"], dict(threads),
                            forward_share=med["forward_share"],
                            matmul_gflops={1: alone_matmul, world: med["matmul_gflops"]},
                            adam_params_per_s={1: alone_adam or med["adam_params_per_s"],
                                               world: med["adam_params_per_s"]})


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="samples per rank of a 2-rank world")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    found = measure(args.d_model, args.batch, args.seq_len)
    for world, rate in found.gflops.items():
        print(f"world {world} ({found.threads[world]} thread(s) per rank): block {rate:.1f} GFLOP/s per rank "
              f"(bare matmul {found.matmul_gflops[world]:.1f})")
    print(f"forward share of a block's time: {found.forward_share:.2f}")
    for world, rate in found.adam_params_per_s.items():
        print(f"AdamW, world {world}: {rate / 1e6:.0f} M parameters/s per rank")
    print(f"gloo all-reduce between 2 ranks: {found.intra_node_gbps:.2f} GB/s, {found.latency_us:.0f} us latency")
    print(f"block forward+backward fixed cost: {found.launch_overhead_us:.0f} us")


if __name__ == "__main__":
    main()
