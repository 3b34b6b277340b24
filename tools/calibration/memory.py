"""The planner's predicted per-rank bytes next to what real runs measure, layout by layout.

    python -m tools.calibration.memory [--layouts dp2_z1 tp2 ...]
    python -m tools.calibration.memory --time [--rounds 3]   # step time: step_time.py

Runs the reference GPT (``tools.harness.runs.TINY_MODEL``, fp32, AdamW) on gloo worlds for
two steps per layout and prints, for every rank, the measured parameter / gradient / optimizer
bytes (``lightning_3d.observe.memory.model_state_bytes`` at the end of backward) and activation bytes per
block (the run summary's ``ActivationMeter``), the planner's prediction for that rank (its
pipeline stage), and their ratio. The tests hold every ratio within 10%.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any, Optional

from lightning_3d.planner.choice import Choice
from lightning_3d.planner.facts import ModelFacts
from lightning_3d.planner.memory import predicted_rank, ratio
from tools.calibration.layouts import LAYOUTS, choice_of, tiny_facts

KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "activation_bytes_per_block")


def compare(facts: ModelFacts, choice: Choice, summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Rows ``{rank, key, predicted, measured, ratio}`` for every rank of a run's summary."""
    rows = []
    for rank, measured in enumerate(summary["ranks"]):
        for key, value in predicted_rank(facts, choice, rank).items():
            if key in measured:
                got = measured[key]
                rows.append(
                    {
                        "rank": rank,
                        "key": key,
                        "predicted": value,
                        "measured": got,
                        "ratio": ratio(value, got),
                    }
                )
    return rows


def run_layout(name: str, steps: int = 2) -> dict[str, Any]:
    """A real run of layout ``name``; rank 0's summary (every rank's memory in ``ranks``)."""
    from tools.harness.runs import Run, fit_gpt
    from tools.harness.world import run_world

    strategy, world = LAYOUTS[name]
    run = Run(strategy=strategy, devices=world, steps=steps)
    result = fit_gpt(0, run) if strategy is None else run_world(fit_gpt, world, run)[0]
    return result["summary"]


def main(argv: Optional[list[str]] = None) -> None:
    from tools.calibration import step_time as time_calibration
    from tools.harness.runs import TINY_DATA

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=None,
        help=f"memory: {list(LAYOUTS)}; --time: {list(time_calibration.TIME_LAYOUTS)}",
    )
    parser.add_argument(
        "--time", action="store_true", help="calibrate step time instead (calibration/step_time.py)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="--time: every layout once per round")
    parser.add_argument(
        "--save", default=None, help="--time: write the raw measurements to this JSON file"
    )
    args = parser.parse_args(argv)
    known = time_calibration.TIME_LAYOUTS if args.time else LAYOUTS
    unknown = [n for n in args.layouts or () if n not in known]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; known: {list(known)}")
    if args.time:
        time_calibration.main(args.layouts or list(known), args.rounds, args.save)
        return
    args.layouts = args.layouts or list(LAYOUTS)
    facts = tiny_facts()
    print("| layout | rank | quantity | predicted | measured | predicted/measured |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for name in args.layouts:
        strategy, world = LAYOUTS[name]
        summary = run_layout(name)
        for row in compare(facts, choice_of(strategy, world, TINY_DATA["batch_size"]), summary):
            worst = max(worst, abs(row["ratio"] - 1))
            print(
                f"| {name} | {row['rank']} | {row['key']} | {row['predicted']:,.0f} | {row['measured']:,} | "
                f"{row['ratio']:.3f} |",
                flush=True,
            )
    print(
        f"\nlargest deviation: {100 * worst:.1f}% ({facts.num_params:,} parameters, fp32 AdamW, "
        f"global batch {TINY_DATA['batch_size']} x {facts.seq_len} tokens)"
    )


if __name__ == "__main__":
    main()
