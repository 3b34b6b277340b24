"""Activation checkpointing policies on the reference GPT: saved bytes per block and step time.

    python -m tools.bench.activation_checkpointing [--repeats 4] [--steps 3] [--threads 1] [--out DIR]
    python -m tools.bench.activation_checkpointing --quick   # 1 repeat of 1 step: a smoke run

One model (n_embd=256, n_layer=4, n_head=8, block_size=128, batch 8, no dropout) is switched
between policies in place (applying a policy replaces the previous one). Saved bytes come from
:func:`~lightning_3d.parallel.activation_checkpoint.activation_bytes_per_block`: storages created inside
each block and still alive when the forward returns, i.e. what backward will need. Step time is
one forward + cross-entropy + backward; policies run interleaved (the order rotates each repeat),
each repeat reports its median step, and the table shows the median over repeats. The table
leads with the process's CPU time (one intra-op thread by default), which other jobs on a shared
machine disturb far less than wall time; wall-time ratios are shown too. Ratios within one run
are comparable; absolute times between runs are not.

Besides the printed table, ``OUT/summary.json`` (default ``bench_out/activation_checkpointing``)
holds the same figures per policy, machine-readable: saved bytes per block (each block, median,
all blocks, ratio to ``none``) and the step-time medians (CPU and wall) with their ratios to
``none``, plus the per-repeat medians and the settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.parallel.activation_checkpoint import (
    DEFAULT_EVERY_N,
    POLICIES,
    activation_bytes_per_block,
    apply_activation_checkpointing,
)

CONFIG = {"n_embd": 256, "n_layer": 4, "n_head": 8, "block_size": 128, "dropout": 0.0}
BATCH = 8
EVERY_N = DEFAULT_EVERY_N  # the strategy's default, used for "every_n"
DEFAULT_OUT = Path("bench_out") / "activation_checkpointing"


def _step_seconds(model: GPT, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(wall, CPU) seconds of one training step's forward + backward (gradients dropped first)."""
    model.zero_grad(set_to_none=True)
    wall, cpu = time.perf_counter(), time.process_time()
    # logits (B, T, vocab) -> (B*T, vocab)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
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
            "blocks": apply_activation_checkpointing(model, p, EVERY_N),
            "bytes": activation_bytes_per_block(model, x, p, EVERY_N),  # block name -> bytes
            "wall": [],
            "cpu": [],
        }
        for p in POLICIES
    }
    for repeat in range(repeats):
        order = POLICIES[repeat % len(POLICIES) :] + POLICIES[: repeat % len(POLICIES)]
        for policy in order:
            apply_activation_checkpointing(model, policy, EVERY_N)
            _step_seconds(model, x, y)  # warm-up: allocator and kernels after the switch
            walls, cpus = zip(*(_step_seconds(model, x, y) for _ in range(steps)))
            results[policy]["wall"].append(statistics.median(walls))
            results[policy]["cpu"].append(statistics.median(cpus))
        print(
            f"  repeat {repeat + 1}/{repeats} (CPU ms): "
            + "  ".join(f"{p} {results[p]['cpu'][-1] * 1e3:.0f}" for p in POLICIES),
            flush=True,
        )
    apply_activation_checkpointing(model, "none")
    return results


def figures(results: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """Per policy: saved bytes (per block, median, all blocks, vs ``none``) and step-time medians
    (CPU and wall seconds, vs ``none``); what the table prints and summary.json holds."""
    base_bytes = sum(results["none"]["bytes"].values())
    base_wall, base_cpu = (statistics.median(results["none"][k]) for k in ("wall", "cpu"))
    out = {}
    for policy, r in results.items():
        total = sum(r["bytes"].values())
        wall, cpu = statistics.median(r["wall"]), statistics.median(r["cpu"])
        out[policy] = {
            "blocks": len(r["bytes"]),
            "checkpointed_blocks": r["blocks"],
            "saved_bytes_per_block": r["bytes"],
            "saved_bytes_per_block_median": statistics.median(r["bytes"].values()),
            "saved_bytes_per_block_mean": total
            / len(r["bytes"]),  # what RunSummary reports for a run
            "saved_bytes_all_blocks": total,
            "saved_bytes_vs_none": total / base_bytes,
            "step_cpu_s_median": cpu,
            "step_cpu_vs_none": cpu / base_cpu,
            "step_wall_s_median": wall,
            "step_wall_vs_none": wall / base_wall,
            "step_cpu_s_per_repeat": r["cpu"],
            "step_wall_s_per_repeat": r["wall"],
        }
    return out


def table(results: dict[str, dict]) -> str:
    """The markdown table: bytes against ``none`` and step time against ``none``."""
    lines = [
        (
            "| policy | checkpointed blocks | saved bytes/block (median) | saved bytes, all blocks | bytes vs none "
            "| fwd+bwd CPU time (median) | CPU time vs none | wall time vs none |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy, f in figures(results).items():
        lines.append(
            f"| {policy} | {len(f['checkpointed_blocks'])}/{f['blocks']} | {f['saved_bytes_per_block_median']:,.0f} "
            f"| {f['saved_bytes_all_blocks']:,} | {f['saved_bytes_vs_none']:.2f} "
            f"| {f['step_cpu_s_median'] * 1e3:.0f} ms "
            f"| {f['step_cpu_vs_none']:.2f} | {f['step_wall_vs_none']:.2f} |"
        )
    return "\n".join(lines)


def summary(results: dict[str, dict], args: argparse.Namespace) -> dict[str, Any]:
    """summary.json: the settings, then :func:`figures` per policy."""
    return {
        "benchmark": "activation_checkpointing",
        "model": {"class": "GPT", **CONFIG},
        "batch": BATCH,
        "tokens_per_step": BATCH * CONFIG["block_size"],
        "precision": "32-true",
        "every_n": EVERY_N,
        "threads": args.threads,
        "repeats": args.repeats,
        "steps": args.steps,
        "saved_bytes": "storages created inside each block and alive when the forward returns "
        "(parameters, buffers and outputs excluded): what backward will need",
        "step_time": "one forward + cross-entropy + backward; median over steps, then over interleaved repeats",
        "policies": figures(results),
    }


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per policy per repeat")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (1: steadier on a shared machine)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 repeat of 1 timed step (a smoke run)"
    )
    parser.add_argument(
        "--out",
        "--outdir",
        dest="out",
        default=str(DEFAULT_OUT),
        help=f"directory for summary.json (default {DEFAULT_OUT})",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 1, 1
    torch.set_num_threads(args.threads)
    results = measure(args.repeats, args.steps)
    print()
    print(table(results))
    print(
        f"\nGPT {CONFIG}, batch {BATCH} x {CONFIG['block_size']} tokens, fp32, {args.threads} thread(s); "
        f"every_n={EVERY_N}; {args.repeats} interleaved repeats of {args.steps} timed steps. Saved bytes exclude "
        "parameters and what lives outside the blocks (embeddings, head, logits)."
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary(results, args), indent=2))
    print(f"summary: {out / 'summary.json'}")
    return results


if __name__ == "__main__":
    main()
