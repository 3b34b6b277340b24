"""Pipeline bubble per schedule and micro-batch count, next to the ideal (p - 1) / (m + p - 1).

    python -m tools.bench.pipeline [--steps 8] [--micro-batches 4 8 16]

pipeline=2 on 2 gloo processes (one intra-op thread each), the reference GPT with 4 blocks.
Each rank's bubble fraction is 1 - (time inside its stages' forward/backward computations) /
(time of the whole schedule step), median over the steps after warm-up; the table shows the
mean over ranks. Per rank, the peak bytes of activations saved for backward (counted from the
tensors autograd keeps) and the most micro-batches in flight (forward done, backward not) are
printed for rank 0 / rank 1, with the peak RSS of the larger rank.
"""

from __future__ import annotations

import argparse
import os

from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

MODEL = dict(n_embd=256, n_layer=4, n_head=8, block_size=128, warmup_steps=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b"])
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")  # inherited by the spawned ranks
    p = 2
    print(
        "| schedule | m | bubble (measured) | ideal (p-1)/(m+p-1) | tokens/s | activations MB, rank 0 / 1 "
        "| in flight, rank 0 / 1 | peak RSS MB (max rank) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for m in args.micro_batches:
        data = dict(block_size=128, batch_size=m * 2, max_bytes=2_000_000)
        for schedule in args.schedules:
            strategy = {"pipeline": p, "schedule": schedule, "micro_batches": m}
            runs = run_world(
                fit_gpt,
                p,
                Run(
                    strategy=strategy,
                    devices=p,
                    steps=args.steps,
                    seed=1234,
                    model=MODEL,
                    data=data,
                ),
            )
            ranks = runs[0]["summary"]["ranks"]
            bubble = sum(r["bubble_fraction"] for r in ranks) / len(ranks)
            ideal = (p - 1) / (m + p - 1)
            rss = max(r["peak_rss_mb"] for r in ranks)
            acts = " / ".join(f"{r['activation_peak_bytes'] / 2**20:.1f}" for r in ranks)
            flight = " / ".join(str(r["in_flight_peak"]) for r in ranks)
            print(
                f"| {schedule} | {m} | {bubble:.3f} | {ideal:.3f} | {runs[0]['summary']['tokens_per_s']:.0f} | "
                f"{acts} | {flight} | {rss:.0f} |",
                flush=True,
            )
    print(
        f"\npipeline={p}, micro-batches of 2 samples x 128 tokens, {args.steps} steps per row; "
        "interleaved uses 2 virtual stages per rank (its ideal bubble is (p-1)/(2m+p-1);\n"
        "its in-flight counts are stage chunks of half the blocks)."
    )


if __name__ == "__main__":
    main()
