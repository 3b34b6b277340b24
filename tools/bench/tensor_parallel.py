"""tensor=2 on 2 processes vs the same model on 1 process: tokens/s ratio and per-rank bytes.

    python -m tools.bench.tensor_parallel [--repeats 3] [--steps 15]

Runs are interleaved (1-process, tp=2, 1-process, tp=2, ...) in one invocation, one intra-op
thread per process, and the median of each side's tokens/s (itself a median over steps after
warm-up) is reported with their ratio. Ratios within one run are comparable; absolute figures
between runs on a shared machine are not.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

MODEL = dict(n_embd=256, n_layer=4, n_head=8, block_size=128, warmup_steps=2)
DATA = dict(block_size=128, batch_size=16, max_bytes=2_000_000)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    single, tp2 = [], []
    for _ in range(args.repeats):
        one = fit_gpt(
            0,
            Run(
                strategy={"tensor": 1},
                devices=1,
                steps=args.steps,
                seed=1234,
                model=MODEL,
                data=DATA,
            ),
        )
        single.append(one["summary"]["tokens_per_s"])
        two = run_world(
            fit_gpt,
            2,
            Run(
                strategy={"tensor": 2},
                devices=2,
                steps=args.steps,
                seed=1234,
                model=MODEL,
                data=DATA,
            ),
        )
        tp2.append(two[0]["summary"]["tokens_per_s"])
        print(f"  1 process: {single[-1]:8.0f} tok/s   tensor=2: {tp2[-1]:8.0f} tok/s", flush=True)
    a, b = statistics.median(single), statistics.median(tp2)
    one_rank, two_rank = one["summary"]["ranks"][0], two[0]["summary"]["ranks"][0]
    print(
        "\n| layout | processes | tokens/s (median) | ratio | param bytes/rank "
        "| split-layer bytes/rank | logits bytes/rank |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| tensor=1 | 1 | {a:.0f} | 1.00 | {one_rank['param_bytes']:,} | {two_rank['tp_split_dense_bytes']:,} | "
        f"{two_rank['logits_dense_bytes']:,} |"
    )
    print(
        f"| tensor=2 | 2 | {b:.0f} | {b / a:.2f} | {two_rank['param_bytes']:,} "
        f"| {two_rank['tp_split_param_bytes']:,} | "
        f"{two_rank['logits_bytes']:,} |"
    )
    print(
        f"\nΨ = {one['summary']['num_params']:,}; global batch {DATA['batch_size']} x {DATA['block_size']} tokens; "
        f"{args.repeats} interleaved repeats of {args.steps} steps."
    )


if __name__ == "__main__":
    main()
