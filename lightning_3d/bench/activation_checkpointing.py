"""Activation checkpointing policies on the reference GPT: saved bytes per block and step time.

    python -m lightning_3d.bench.activation_checkpointing [--repeats 4] [--steps 3] [--threads 1]

One model (n_embd=256, n_layer=4, n_head=8, block_size=128, batch 8, no dropout) is switched
between policies in place (applying a policy replaces the previous one). Saved bytes come from
:func:`~lightning_3d.parallel.checkpointing.activation_bytes_per_block`: storages created inside
each block and still alive when the forward returns, i.e. what backward will need. Step time is
one forward + cross-entropy + backward; policies run interleaved (the order rotates each repeat),
each repeat reports its median step, and the table shows the median over repeats. The table
leads with the process's CPU time (one intra-op thread by default), which other jobs on a shared
machine disturb far less than wall time; wall-time ratios are shown too. Ratios within one run
are comparable; absolute times between runs are not.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.parallel.checkpointing import (
    POLICIES,
    activation_bytes_per_block,
    apply_activation_checkpointing,
)

CONFIG = {"n_embd": 256, "n_layer": 4, "n_head": 8, "block_size": 128, "dropout": 0.0}
BATCH = 8


def _step_seconds(model: GPT, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(wall, CPU) seconds of one training step's forward + backward (gradients dropped first)."""
    model.zero_grad(set_to_none=True)
    wall, cpu = time.perf_counter(), time.process_time()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # logits (B, T, vocab) -> (B*T, vocab)
    loss.backward()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(repeats: int, steps: int) -> dict[str, dict]:
    """Per policy: checkpointed blocks, saved bytes per block, and step-time medians per repeat."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (BATCH, CONFIG["block_size"]), generator=gen)  # (B, T)
    y = torch.randint(0, 256, (BATCH, CONFIG["block_size"]), generator=gen)  # (B, T)
    results = {
        p: {
            "blocks": apply_activation_checkpointing(model, p),
            "bytes": list(activation_bytes_per_block(model, x, p).values()),
            "wall": [],
            "cpu": [],
        }
        for p in POLICIES
    }
    for repeat in range(repeats):
        order = POLICIES[repeat % len(POLICIES):] + POLICIES[: repeat % len(POLICIES)]
        for policy in order:
            apply_activation_checkpointing(model, policy)
            _step_seconds(model, x, y)  # warm-up: allocator and kernels after the switch
            walls, cpus = zip(*(_step_seconds(model, x, y) for _ in range(steps)))
            results[policy]["wall"].append(statistics.median(walls))
            results[policy]["cpu"].append(statistics.median(cpus))
        print(f"  repeat {repeat + 1}/{repeats} (CPU ms): "
              + "  ".join(f"{p} {results[p]['cpu'][-1] * 1e3:.0f}" for p in POLICIES), flush=True)
    apply_activation_checkpointing(model, "none")
    return results


def table(results: dict[str, dict]) -> str:
    """The markdown table: bytes against ``none`` and step time against ``none``."""
    base_bytes = sum(results["none"]["bytes"])
    base_wall, base_cpu = (statistics.median(results["none"][k]) for k in ("wall", "cpu"))
    lines = [
        ("| policy | checkpointed blocks | saved bytes/block (median) | saved bytes, all blocks | bytes vs none "
         "| fwd+bwd CPU time (median) | CPU time vs none | wall time vs none |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy, r in results.items():
        total = sum(r["bytes"])
        wall, cpu = statistics.median(r["wall"]), statistics.median(r["cpu"])
        lines.append(
            f"| {policy} | {len(r['blocks'])}/{len(r['bytes'])} | {statistics.median(r['bytes']):,.0f} | {total:,} "
            f"| {total / base_bytes:.2f} | {cpu * 1e3:.0f} ms | {cpu / base_cpu:.2f} | {wall / base_wall:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per policy per repeat")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadier on a shared machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = measure(args.repeats, args.steps)
    print()
    print(table(results))
    print(f"\nGPT {CONFIG}, batch {BATCH} x {CONFIG['block_size']} tokens, fp32, {args.threads} thread(s); every_n=2; "
          f"{args.repeats} interleaved repeats of {args.steps} timed steps. Saved bytes exclude parameters and "
          "what lives outside the blocks (embeddings, head, logits).")


if __name__ == "__main__":
    main()
