"""Context parallelism measured: ``python -m tools.bench.context [T] [steps]``.

Trains the reference GPT (fp32, ZeRO-0, no checkpointing) on sequences of ``T`` tokens at
cp = 1, 2 and 4 with each scheme, one gloo world per row, and prints a markdown table per row:
tokens/s, activation bytes per block per rank (the run summary's meter) against cp=1's divided by
cp, and the attention's communication bytes per rank (the ring's sends, or the all-to-alls'
ring-equivalent bytes, counted by :func:`tools.bench.comm.count_collectives`) against
the formula, with ``n = B · H · T/cp · D`` elements of each of q, k, v per layer and step, fp32:

    ring      forward 2n(cp-1) + backward 2n(2cp-1)  = 2n(3cp-2) elements per layer
    alltoall  4 tensors each way, forward and back   = 8n(cp-1)/cp
"""

from __future__ import annotations

import sys
from typing import Any

from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

MODEL = dict(n_embd=64, n_head=8, n_layer=2, warmup_steps=1)
BATCH = 4
ROWS = [(1, "ring"), (2, "ring"), (2, "alltoall"), (4, "ring"), (4, "alltoall")]
ATTENTION_OPS = {"ring": ("dist.isend",), "alltoall": ("dist.all_to_all_single",)}


def attention_formula_bytes(scheme: str, context: int, length: int, steps: int) -> float:
    """Bytes one rank sends for attention over ``steps`` training steps (fp32, ``MODEL``)."""
    head_dim = MODEL["n_embd"] // MODEL["n_head"]
    n = BATCH * MODEL["n_head"] * (length // context) * head_dim
    per_layer = 2 * n * (3 * context - 2) if scheme == "ring" else 8 * n * (context - 1) / context
    return 4 * per_layer * MODEL["n_layer"] * steps if context > 1 else 0.0


def _rank(rank: int, run: Run) -> dict[str, Any]:
    from tools.bench.comm import count_collectives

    with count_collectives() as counter:
        out = fit_gpt(rank, run)
    return {"summary": out["summary"], "by_op": counter.snapshot(), "losses": out["losses"]}


def measure(length: int, steps: int, rows: list = ROWS) -> list[dict[str, Any]]:
    """One record per ``(context, scheme)`` of ``rows`` (the first: the cp=1 baseline)."""
    records = []
    for context, scheme in rows:
        run = Run(
            strategy={"context": context, "context_scheme": scheme},
            devices=context,
            steps=steps,
            model={**MODEL, "block_size": length},
            data={"block_size": length, "batch_size": BATCH},
            summary_warmup=1,
            initial_state=False,
        )
        result = run_world(_rank, context, run)[0]
        sent = sum(result["by_op"].get(op, (0, 0, 0.0))[2] for op in ATTENTION_OPS[scheme])
        records.append(
            {
                "context": context,
                "scheme": scheme if context > 1 else "—",
                "tokens_per_s": result["summary"]["tokens_per_s"],
                "activation_bytes": result["summary"]["ranks"][0]["activation_bytes_per_block"],
                "sent_bytes": sent,
                "formula_bytes": attention_formula_bytes(scheme, context, length, steps),
                "final_loss": result["losses"][-1],
            }
        )
    return records


def table(records: list[dict[str, Any]]) -> str:
    base = records[0]["activation_bytes"]
    rows = [
        "| cp | scheme | tokens/s | activation bytes / block / rank | vs cp=1 / cp | "
        "attention bytes sent / rank | vs formula | final loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ideal = base / r["context"]
        ratio = f"{r['sent_bytes'] / r['formula_bytes']:.3f}" if r["formula_bytes"] else "—"
        rows.append(
            f"| {r['context']} | {r['scheme']} | {r['tokens_per_s']:.0f} | "
            f"{r['activation_bytes']:,} | {r['activation_bytes'] / ideal:.3f} | "
            f"{r['sent_bytes']:,.0f} | {ratio} | {r['final_loss']:.6f} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    length = int(argv[0]) if argv else 512
    steps = int(argv[1]) if len(argv) > 1 else 4
    print(table(measure(length, steps)))


if __name__ == "__main__":
    main(sys.argv[1:])
