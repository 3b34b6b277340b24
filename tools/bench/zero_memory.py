"""Per-rank model-state bytes under ZeRO 0-3 at data=2 and data=4, next to the paper's formula.

    python -m tools.bench.zero_memory [--n-embd 256] [--n-layer 4] [--data 2 4]

Trains the reference GPT for two fp32 AdamW steps per layout on gloo worlds and prints, for
rank 0, the bytes of parameters, gradients and optimizer state resident at the end of backward
(counted from the tensors: see ``lightning_3d.observe.memory``) and their ratio to the formula
(stage 0: 16Ψ, 1: 8Ψ + 8Ψ/N, 2: 4Ψ + 12Ψ/N, 3: 16Ψ/N). Peak RSS is printed too, measured with
``MALLOC_MMAP_THRESHOLD_=1048576`` so freed large tensors go back to the OS.
"""

from __future__ import annotations

import argparse
import os

from lightning_3d.observe.memory import zero_formula_bytes
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world


def measure(data: int, stage: int, model: dict) -> dict:
    run = Run(
        strategy={"zero_stage": stage},
        devices=data,
        steps=2,
        seed=1234,
        model=model,
        data={"block_size": model["block_size"]},
    )
    # Peak RSS: nothing inherited from a fork server.
    runs = run_world(fit_gpt, data, run, start_method="spawn")
    summary = runs[0]["summary"]
    return {"num_params": summary["num_params"], **summary["ranks"][0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--data", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")  # inherited by the spawned ranks
    model = dict(n_embd=args.n_embd, n_layer=args.n_layer, n_head=4, block_size=64)
    print(
        "| N | stage | params MB | grads MB | optim MB | total MB | formula MB | total/formula | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for data in args.data:
        for stage in (0, 1, 2, 3):
            row = measure(data, stage, model)
            total = row["param_bytes"] + row["grad_bytes"] + row["optimizer_state_bytes"]
            formula = zero_formula_bytes(row["num_params"], stage, data)
            mb = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
            print(
                f"| {data} | {stage} | {mb(row['param_bytes'])} | {mb(row['grad_bytes'])} | "
                f"{mb(row['optimizer_state_bytes'])} | {mb(total)} | {mb(formula)} | {total / formula:.3f} | "
                f"{row['peak_rss_mb']:.0f} |",
                flush=True,
            )
    print(f"\nΨ = {row['num_params']:,} parameters (fp32 AdamW); rank 0 of each layout.")


if __name__ == "__main__":
    main()
