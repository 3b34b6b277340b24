"""The planner's one-device step times against what ``python -m tools.bench.one_device`` measured.

    python -m tools.calibration.device_check bench_out/gpu/bench/one_device.json

The one-device benchmark times ``strategy="3d"`` with activation checkpointing none / selective /
full, and with ``offload="cpu"``, on one device (``bash .ci/gpu`` runs it on a GPU). This predicts
the same rows for the same
model, batch and precision on the device the benchmark found (:func:`lightning_3d.strategy.auto.found_cluster`
for its peak; run it on that machine) and prints measured against predicted, the rank of each,
and how far the planner's first choice among them measured from the fastest: the planner's
"first choice within 10 % of the fastest measured layout", on a GPU. Rows the planner does not
model (compile, the delayed offload update, the raw torch loop, Lightning ``auto``) are left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from lightning_3d.planner.choice import Choice, PlannerOptions
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.facts import ModelFacts
from lightning_3d.planner.timing import step_time

POLICIES = ("none", "selective", "full")
MODELLED_OFFLOADS = ("none", "cpu")  # of planner.choice.OFFLOADS: what the one-device bench runs


def planned_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The benchmark's ``3d`` rows the planner models: no option but a known checkpointing policy
    and CPU offload (so no compile, no delayed update)."""

    def modelled(options: dict[str, Any]) -> bool:
        return (
            set(options) <= {"ac_policy", "offload"}
            and options.get("ac_policy", "none") in POLICIES
            and options.get("offload", "none") in MODELLED_OFFLOADS
        )

    return [r for r in records if r.get("engine") == "3d" and modelled(r.get("options") or {})]


def compare(
    facts: ModelFacts,
    cluster: Cluster,
    options: PlannerOptions,
    records: list[dict[str, Any]],
    batch: int,
) -> list[dict[str, Any]]:
    """``{row, ac_policy, offload, measured_s, predicted_s, ratio}`` per modelled row, fastest
    measured first."""
    out = []
    for record in planned_rows(records):
        given = record.get("options") or {}
        policy, offload = given.get("ac_policy", "none"), given.get("offload", "none")
        choice = Choice(
            data=1,
            tensor=1,
            pipeline=1,
            zero_stage=0,
            ac_policy=policy,
            offload=offload,
            batch_per_rank=batch,
        )
        predicted = step_time(facts, choice, cluster, options).total
        out.append(
            {
                "row": record["row"],
                "ac_policy": policy,
                "offload": offload,
                "measured_s": record["step_s"],
                "predicted_s": predicted,
                "ratio": predicted / record["step_s"],
            }
        )
    return sorted(out, key=lambda r: r["measured_s"])


def report(rows: list[dict[str, Any]], cluster: Cluster, device: str = "cuda") -> str:
    """The table, with each row's measured and predicted rank, and the first choice's verdict
    (:func:`tools.calibration.step_time.verdict`, as the CPU calibration judges it)."""
    from tools.calibration.step_time import ranks, verdict

    measured = {r["row"]: r["measured_s"] for r in rows}
    predicted = {r["row"]: r["predicted_s"] for r in rows}
    judged = verdict(measured, predicted)
    assumed = (
        "the GPU defaults"
        if device == "cuda"
        else "parallelism=auto's CPU figures (strategy/auto.py)"
    )
    lines = [
        f"planner against the one-device benchmark on {device}: peak {cluster.peak_tflops:g} TFLOP/s, "
        f"efficiency, checkpointing and step costs from {assumed}",
        "| row | ac_policy | offload | measured s | predicted s | predicted/measured "
        "| measured rank | predicted rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r, m_rank, p_rank in zip(
        rows, ranks(list(measured.values())), ranks(list(predicted.values()))
    ):
        lines.append(
            f"| {r['row']} | {r['ac_policy']} | {r['offload']} | {r['measured_s']:.4f} | {r['predicted_s']:.4f} | "
            f"{r['ratio']:.2f} | {m_rank:g} | {p_rank:g} |"
        )
    lines.append(
        f"\nplanner's first choice {judged['first_choice']} measured {100 * judged['gap']:.1f}% slower than "
        f"the fastest ({judged['fastest']}): {'within' if judged['within'] else 'outside'} 10%"
    )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> str:
    parser = argparse.ArgumentParser(
        prog="python -m tools.calibration.device_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "bench_json", type=Path, help="one_device.json of python -m tools.bench.one_device"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    if not args.bench_json.is_file():
        parser.error(f"{args.bench_json} is not a file")
    bench = json.loads(args.bench_json.read_text())
    config, records = bench["config"], bench["records"]
    if not planned_rows(records):
        parser.error(
            f"{args.bench_json} has no 3d row the planner models (rows: {[r['row'] for r in records]})"
        )

    import torch

    from lightning_3d.models import LitGPT
    from lightning_3d.planner.facts import model_facts
    from lightning_3d.strategy.auto import CPU_OPTIONS, found_cluster

    gpu = config["accelerator"] == "gpu"
    cluster = found_cluster(1, 1, "cuda" if gpu else "cpu", config["precision"])
    if config.get("peak_tflops"):
        cluster = dataclasses.replace(cluster, peak_tflops=config["peak_tflops"])
    model = {k: v for k, v in config["model"].items() if k != "dropout"}
    with torch.device("meta"):
        module = LitGPT(**model)
    seq = model["block_size"]
    options = PlannerOptions(
        batch_size=config["batch"],
        seq_len=seq,
        precision=config["precision"],
        **({} if gpu else CPU_OPTIONS),
    )
    facts = model_facts(
        module, seq_len=seq, precision=config["precision"], policies=POLICIES, name="bench model"
    )
    text = report(
        compare(facts, cluster, options, records, config["batch"]),
        cluster,
        "cuda" if gpu else "cpu",
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
