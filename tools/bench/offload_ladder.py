"""The offload size ladder: how large a model trains on one capped device, and how fast.

    python -m tools.bench.offload_memory --accelerator gpu --device-memory-gb 24 \\
        --sizes 0.35B 1.3B 2.7B 6.7B [--modes none cpu params] [--rounds 2] [--budget-s 420]

Per size (ascending) and offload mode, one worker process of
:mod:`tools.bench.offload_memory` trains ``LitGPT`` (vocab 32 000, 64-wide heads) in
bf16-true with full activation checkpointing on ``--batch-size`` x ``--seq-len`` tokens per step
(default 8 x 1024, the offload ladder's setting): one untimed step, then ``--rounds`` timed steps. Modes:
``none`` (no offload), ``cpu`` / ``nvme`` (Adam state and fp32 masters off the device) and
``params`` (ZeRO-3 with ``offload_params=True``: the parameters in CPU memory too) and
``cpu-blocking`` (``cpu`` with ``offload_overlap=False``: transfers in turn with the CPU step, so
``cpu`` against it is what the side streams save) and ``cpu-delayed`` (``cpu`` with
``offload_delay_update=True``: the CPU step beside the next forward and backward, one update
behind; other numerics).

Every (size, mode) is a row, whatever happens to it: its figures; "does not fit" when the
device (under ``--device-memory-gb``) runs out of memory; "did not finish within N s" when it
outlasts ``--row-timeout-s`` (with the phase it reached); "killed" when the OS ended it (host
memory, most likely); "not run" once ``--budget-s`` has passed or a smaller size of the same
mode did not fit. The model is built on ``meta`` and materialised by the strategy straight into
its final dtype, device and shard (``LitGPT(deferred_init=True)``; ``--eager-init``: whole in
fp32 on the host first, the old path). Figures: build time (model built, Trainer set up, up to
the first batch; ``build_peak_rss_mb`` in the JSON: the host peak by then),
device and host peaks, step time split into forward + backward (to ``on_before_optimizer_step``,
device synchronised) and the rest (clipping, the optimizer step and its transfers), TFLOP/s of
model FLOPs (:func:`lightning_3d.observe.flops.transformer_flops_per_token`; recomputation not counted).
Writes ``OUT/ladder.md`` and ``OUT/ladder.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from lightning_3d.observe.flops import transformer_flops_per_token
from tools.bench import offload_worker as om

# name: (n_layer, n_embd); GPT-3's shapes at these sizes (Brown et al. 2020, table 2.1).
SIZES = {"0.35B": (24, 1024), "1.3B": (24, 2048), "2.7B": (32, 2560), "6.7B": (32, 4096)}
MODES = ("none", "cpu", "nvme", "params", "cpu-blocking", "cpu-delayed")  # see the module docstring
DEFAULT_MODES = ("none", "cpu", "params")


def parse_size(name: str) -> tuple[int, int]:
    """``"1.3B"`` (a :data:`SIZES` name) or ``"24x2048"`` (layers x width) -> (n_layer, n_embd)."""
    if name in SIZES:
        return SIZES[name]
    match = re.fullmatch(r"(\d+)x(\d+)", name)
    if match is None:
        raise ValueError(
            f"size {name!r} is neither one of {list(SIZES)} nor LAYERSxWIDTH (e.g. 24x2048)"
        )
    n_layer, n_embd = int(match[1]), int(match[2])
    if n_layer < 1 or n_embd < 64 or n_embd % 64:
        raise ValueError(
            f"size {name!r}: need at least one layer and a width that is a multiple of 64"
        )
    return n_layer, n_embd


def check(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """The ladder's sizes, smallest first; ``ValueError`` naming every bad value before any work."""
    sizes = [(name, *parse_size(name)) for name in args.sizes]
    modes = args.modes or list(DEFAULT_MODES)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown offload modes {bad}; known: {list(MODES)}")
    for key in ("rounds", "batch_size", "seq_len"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.row_timeout_s <= 0 or args.budget_s <= 0:
        raise ValueError(
            f"--row-timeout-s ({args.row_timeout_s}) and --budget-s ({args.budget_s}) must be positive"
        )
    args.modes = modes
    return sorted(sizes, key=lambda s: s[1] * s[2] ** 2)


def row_of(mode: str, args: argparse.Namespace) -> om.Row:
    # CPUs without AMX crawl in bf16.
    precision = "bf16-true" if args.accelerator == "gpu" else "32-true"
    offload = "cpu" if mode in ("params", "cpu-blocking", "cpu-delayed") else mode
    return om.Row(
        precision,
        args.batch_size,
        args.seq_len,
        offload=offload,
        checkpointing="full",
        params=mode == "params",
        overlap=mode != "cpu-blocking",
        delay=mode == "cpu-delayed",
    )


def run_one(row: om.Row, n_layer: int, n_embd: int, args: argparse.Namespace) -> dict[str, Any]:
    """One worker, alone, under a deadline: its figures, or ``{"outcome": why not}``."""
    worker_args = argparse.Namespace(**{**vars(args), "n_layer": n_layer, "n_embd": n_embd})
    worker = om.start_worker(row, worker_args)
    expired = threading.Event()
    phase = "building"

    def expire() -> None:
        expired.set()
        worker.kill()

    timer = threading.Timer(args.row_timeout_s, expire)
    timer.start()
    try:
        ready = om.read_reply(worker)
        if "oom" in ready:
            return {"outcome": "does not fit", "phase": phase, "error": ready["oom"]}
        steps = []
        for index in range(1 + args.rounds):
            phase = f"step {index + 1} of {1 + args.rounds}"
            record = om.step_worker(worker)
            if "oom" in record:
                return {"outcome": "does not fit", "phase": phase, "error": record["oom"], **ready}
            if index:  # the first step creates the optimizer state: not timed
                steps.append(record)
        phase = "finishing"
        final = om.read_reply(worker)
    except (RuntimeError, OSError) as error:  # the worker died, or was killed
        code = worker.poll()
        if expired.is_set():
            return {"outcome": f"did not finish within {args.row_timeout_s:g} s", "phase": phase}
        if code is not None and code < 0:
            return {"outcome": f"killed by signal {-code} (host memory?)", "phase": phase}
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        return {
            "outcome": "failed",
            "phase": phase,
            "error": lines[-1][:300] if lines else repr(error),
        }
    finally:
        timer.cancel()
        if worker.poll() is None:
            worker.kill()
        worker.wait()
        worker.log.close()
    split = {
        k: statistics.median(s[k] for s in steps)
        for k in ("fwd_bwd_s", "optimizer_s", "cpu_step_s")
        if all(k in s for s in steps)
    }
    return {
        "outcome": "fits",
        **ready,
        **final,
        "step_s": statistics.median(s["step_s"] for s in steps),
        "cpu_s": statistics.median(s["cpu_s"] for s in steps),
        **split,
    }


def run_ladder(
    args: argparse.Namespace, log: Any = print, after_row: Any = None
) -> list[dict[str, Any]]:
    """Every (size, mode) row, smallest size first; see the module docstring for the outcomes.
    ``after_row(records so far)`` runs after each row (files rewritten as the ladder goes)."""
    sizes = check(args)
    start = time.perf_counter()
    failed: dict[str, str] = {}  # mode -> "<size> <what happened to it>"
    records = []
    for name, n_layer, n_embd in sizes:
        for mode in args.modes:
            row = row_of(mode, args)
            base = {"size": name, "n_layer": n_layer, "n_embd": n_embd, "mode": mode, **asdict(row)}
            if mode in failed:
                result = {"outcome": f"not run: {failed[mode]}"}
            elif time.perf_counter() - start > args.budget_s:
                result = {"outcome": f"not run: time budget of {args.budget_s:.0f} s spent"}
            else:
                t0 = time.perf_counter()
                result = run_one(row, n_layer, n_embd, args)
                result["wall_s"] = time.perf_counter() - t0
                if result["outcome"] != "fits":  # a larger size would not do better
                    failed[mode] = f"{name} {result['outcome']}"
            records.append(figures({**base, **result}, args.vocab))
            log(f"{name} {mode}: {_said(records[-1])}")
            if after_row is not None:
                after_row(records)
    return records


def figures(record: dict[str, Any], vocab: int) -> dict[str, Any]:
    """A row's derived figures: tokens per step, model FLOPs, TFLOP/s (rows that fit)."""
    out = {**record, "tokens_per_step": record["batch"] * record["seq"]}
    if record["outcome"] == "fits":
        per_token = transformer_flops_per_token(
            record["num_params"], record["n_layer"], record["n_embd"], record["seq"]
        )
        out["flops_per_token"] = per_token
        out["tflops"] = out["tokens_per_step"] * per_token / record["step_s"] / 1e12
    else:  # parameters from the shape alone (GPT: 12 L C^2 + embeddings), for the table
        positions = max(om.MODEL["block_size"], record["seq"])
        out["num_params"] = (
            12 * record["n_layer"] * record["n_embd"] ** 2 + (vocab + positions) * record["n_embd"]
        )
    return out


def largest_fitting(records: list[dict[str, Any]]) -> dict[str, Optional[str]]:
    """Per mode, the largest size (by parameters) that trained, or ``None``."""
    out: dict[str, Optional[str]] = {}
    for mode in dict.fromkeys(r["mode"] for r in records):  # in the order run
        fits = [r for r in records if r["mode"] == mode and r["outcome"] == "fits"]
        out[mode] = max(fits, key=lambda r: r["num_params"])["size"] if fits else None
    return out


def _said(r: dict[str, Any]) -> str:
    """A row in one line, for the log (what survives if the whole run is killed)."""
    if r["outcome"] != "fits":
        return (
            r["outcome"]
            + (f" ({r['phase']})" if "phase" in r else "")
            + (f": {r['error']}" if "error" in r else "")
        )
    peak = r.get("device_peak_mb")
    return (
        f"fits; build {r['build_s']:.1f} s, step {r['step_s']:.2f} s, {r['tflops']:.3g} TFLOP/s, "
        f"device peak {_f(peak / 1024 if peak else None, '.1f')} GB, host peak {r['peak_rss_mb'] / 1024:.1f} GB"
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _f(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(records: list[dict[str, Any]]) -> str:
    """One line per row. ``CPU step s``: the fused CPU Adam alone (offloaded rows; delayed: the
    update that ran beside the step); ``step / (fwd+bwd + CPU step)``: the offload ratio (target
    at most 1.3 at 1.3 B), what transfers, clipping and waits add to the two parts that must run."""
    lines = [
        "| size | params | mode | outcome | build s | step s | fwd+bwd s | optimizer s | CPU step s | "
        "step / (fwd+bwd + CPU step) | TFLOP/s | device peak GB | host peak GB |",
        "|---" * 13 + "|",
    ]
    for r in records:
        outcome = r["outcome"] + (
            f" ({r['phase']})" if r["outcome"] != "fits" and "phase" in r else ""
        )
        peak = r.get("device_peak_mb")
        cpu_step, fwd_bwd = r.get("cpu_step_s"), r.get("fwd_bwd_s")
        ratio = (
            r["step_s"] / (fwd_bwd + cpu_step)
            if cpu_step is not None and fwd_bwd is not None
            else None
        )
        lines.append(
            f"| {r['size']} | {_count(r['num_params'])} | {r['mode']} | {outcome} | {_f(r.get('build_s'), '.1f')} | "
            f"{_f(r.get('step_s'), '.2f')} | {_f(fwd_bwd, '.2f')} | {_f(r.get('optimizer_s'), '.2f')} | "
            f"{_f(cpu_step, '.2f')} | {_f(ratio, '.2f')} | "
            f"{_f(r.get('tflops'), '.3g')} | {_f(peak / 1024 if peak else None, '.1f')} | "
            f"{_f(r['peak_rss_mb'] / 1024 if 'peak_rss_mb' in r else None, '.1f')} |"
        )
    return "\n".join(lines)


def write(records: list[dict[str, Any]], args: argparse.Namespace, seconds: float) -> str:
    """OUT/ladder.md and OUT/ladder.json from the rows so far; the text."""
    largest = largest_fitting(records)
    cap = f"{args.device_memory_gb:g} GB" if args.device_memory_gb is not None else "uncapped"
    text = "\n".join(
        [
            f"LitGPT ladder, vocab {args.vocab}, {records[0]['precision'] if records else '?'}, full activation "
            f"checkpointing, {args.batch_size} x {args.seq_len} tokens per step, AdamW; "
            f"{args.accelerator}, device memory "
            f"{cap}; {args.threads} CPU threads per worker; median of {args.rounds} timed steps after one untimed",
            "",
            table(records),
            "",
            "Largest size that fits: "
            + ", ".join(f"{mode} {size or 'none'}" for mode, size in largest.items()),
            f"(total {seconds:.0f} s)",
        ]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ladder.md").write_text(text + "\n")
    settings = {
        k: v
        for k, v in vars(args).items()
        if k
        in (
            "accelerator",
            "device_memory_gb",
            "sizes",
            "modes",
            "rounds",
            "batch_size",
            "seq_len",
            "vocab",
            "threads",
            "row_timeout_s",
            "budget_s",
            "path",
        )
    }
    (out / "ladder.json").write_text(
        json.dumps(
            {
                "benchmark": "offload_ladder",
                "settings": settings,
                "largest_fitting": largest,
                "rows": records,
            },
            indent=2,
            default=str,
        )
    )
    return text


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    start = time.perf_counter()
    records = run_ladder(
        args, after_row=lambda so_far: write(so_far, args, time.perf_counter() - start)
    )
    print(write(records, args, time.perf_counter() - start))
    return records


__all__ = ["SIZES", "largest_fitting", "main", "parse_size", "run_ladder", "table"]
