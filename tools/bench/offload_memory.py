"""Whole training steps of a 50M-parameter GPT in one process: offload none vs CPU vs NVMe.

    python -m tools.bench.offload_memory [--rounds 4] [--precisions 32-true bf16-true] \\
        [--n-layer 7 --n-embd 768] [--path DIR] [--out DIR]
    python -m tools.bench.offload_memory --accelerator gpu
        # + peak device memory, ZeRO-3 parameter offload

The reference ``LitGPT`` (n_embd=768, n_layer=7, n_head=12, block_size=128, vocab 256:
50,048,256 parameters) trains through ``Trainer(strategy=ThreeDStrategy(offload=...), devices=1)``
with AdamW. Every configuration runs in its own process, so its peak RSS is its own; the
processes of one precision start together, then the parent lets them take one training step at
a time in turn (order rotated each round, only one computing at a time) and the table shows
median step times. The first step (optimizer state created) is not timed. Workers run with
``MALLOC_MMAP_THRESHOLD_=1048576`` (freed large tensors go back to the OS; see DESIGN.md) and
``--threads`` intra-op threads. The model is built on ``meta`` and materialised in its final
place (``LitGPT(deferred_init=True)``; ``--eager-init`` for the old whole-fp32-first build).

Columns: peak RSS, and the same minus the RSS after imports and data (``over base``: what the
model, its training state and the activations added); bytes of parameters, gradients and optimizer
state resident at the optimizer step (``lightning_3d.observe.memory.model_state_bytes``; an offloaded
optimizer counts its RAM window). With bf16 parameters ``OffloadedAdam`` keeps fp32 master
weights and fp32 Adam moments in its store, while plain AdamW keeps bf16 moments and no master
copy. The NVMe file sits in the page cache on a machine with spare RAM (not counted in RSS), so
its step time measures the streaming machinery, not the drive.

bf16 matmuls are ~20x slower than fp32 on CPUs without AVX512-BF16/AMX (measured here: 108 s vs
4.6 s for a batch of 4x128 tokens), so bf16 rows use 1x32 tokens per step, next to an fp32 row at
1x32 without offload (the last column's reference: fp32 parameters, gradients and Adam state).
Runtime with the defaults: ~5-8 minutes on 2 cores.

With ``--accelerator gpu`` (one CUDA device) the same rows run on the GPU, plus a ZeRO-3 row
with ``offload_params=True`` per precision, and the table adds the peak device memory
(``torch.cuda.max_memory_allocated``) and its ratio to offload=none. Without a CUDA device that
flag is refused before anything starts.

With ``--sizes`` the benchmark runs a size ladder instead (:mod:`tools.bench.offload_ladder`):

    python -m tools.bench.offload_memory --accelerator gpu --device-memory-gb 24 --sizes 0.35B 1.3B 2.7B 6.7B

per size and offload mode one process, bf16-true, full activation checkpointing, 8 x 1024
tokens, vocab 32 000: fits?, build time, device and host peaks, step time (forward + backward
and optimizer + transfers), TFLOP/s, and the largest size that fits. ``--device-memory-gb``
caps the device with ``torch.cuda.set_per_process_memory_fraction`` (one GPU then stands for a
smaller one); a size that runs out of memory is a row "does not fit", not a crash.

Besides the printed table, ``OUT/summary.json`` (default ``bench_out/offload_memory``) holds every
row machine-readable: the configuration, step time (wall and CPU medians), peak RSS, RSS over
base, model-state bytes, the activation bytes per block of the row's first step (``RunSummary``'s
``activation_bytes_per_block``), and the ratios against offload=none and against fp32 without
offload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tools.bench import offload_ladder
from tools.bench.offload_worker import (
    MODEL,
    Row,
    model_config,
    read_reply,
    run_worker,
    start_worker,
    step_worker,
)

PRECISIONS = ("32-true", "bf16-true")
DEFAULT_OUT = Path("bench_out") / "offload_memory"


def gpu_groups(groups: dict[str, list[Row]]) -> dict[str, list[Row]]:
    """The rows for ``--accelerator gpu``: each group plus ZeRO-3 with parameter offload (CPU)."""
    return {
        precision: [*rows_, replace(rows_[0], offload="cpu", params=True)]
        for precision, rows_ in groups.items()
    }


def default_groups(checkpointing_rows: bool = True) -> dict[str, list[Row]]:
    """Rows run side by side (interleaved), per group. fp32 at 4x128 tokens, with and without
    activation checkpointing; bf16 at 1x32 tokens, next to an fp32 run at the same tokens (the
    fp32-master recipe that bf16 parameters + offloaded fp32 master weights replace)."""
    fp32 = [Row("32-true", 4, 128, offload) for offload in ("none", "cpu", "nvme")]
    if checkpointing_rows:
        fp32 += [Row("32-true", 4, 128, offload, "full") for offload in ("none", "nvme")]
    bf16 = [Row("bf16-true", 1, 32, offload) for offload in ("none", "cpu", "nvme")] + [
        Row("32-true", 1, 32)
    ]
    return {"32-true": fp32, "bf16-true": bf16}


def measure(rows: list[Row], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record per row: medians over ``args.rounds`` steps, the rows' steps interleaved."""
    workers = [start_worker(row, args) for row in rows]
    try:
        bases = [read_reply(w)["base_rss_mb"] for w in workers]
        steps: list[list[dict[str, Any]]] = [[] for _ in workers]
        for round_ in range(1 + args.rounds):
            order = list(range(len(workers)))
            for i in order[round_ % len(order) :] + order[: round_ % len(order)]:
                record = step_worker(workers[i])
                if round_:  # the first step creates the optimizer state: not timed
                    steps[i].append(record)
        finals = [read_reply(w) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait()
            w.log.close()
    return [
        {
            **asdict(row),
            "base_rss_mb": base,
            **final,
            "step_s": statistics.median(s["step_s"] for s in rec),
            "cpu_s": statistics.median(s["cpu_s"] for s in rec),
        }
        for row, base, final, rec in zip(rows, bases, finals, steps)
    ]


def _reference(r: dict[str, Any], results: list[dict[str, Any]], precision: str) -> dict[str, Any]:
    same = ("batch", "seq", "checkpointing")
    return next(
        x
        for x in results
        if x["precision"] == precision
        and x["offload"] == "none"
        and not x.get("params")
        and all(x[k] == r[k] for k in same)
    )


def rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each record with its ratios: against offload=none at the same precision, tokens and
    activation checkpointing (``*_vs_none``), and peak RSS against fp32 without offload at the
    same tokens (``peak_rss_vs_fp32_none``)."""
    out = []
    for r in results:
        ref, fp32 = _reference(r, results, r["precision"]), _reference(r, results, "32-true")
        over, ref_over = (
            r["peak_rss_mb"] - r["base_rss_mb"],
            ref["peak_rss_mb"] - ref["base_rss_mb"],
        )
        out.append(
            {
                **r,
                "tokens_per_step": r["batch"] * r["seq"],
                "over_base_mb": over,
                "step_s_vs_none": r["step_s"] / ref["step_s"],
                "peak_rss_vs_none": r["peak_rss_mb"] / ref["peak_rss_mb"],
                "over_base_vs_none": over / ref_over,
                "peak_rss_vs_fp32_none": r["peak_rss_mb"] / fp32["peak_rss_mb"],
                **(
                    {"device_peak_vs_none": r["device_peak_mb"] / ref["device_peak_mb"]}
                    if "device_peak_mb" in r
                    else {}
                ),
            }
        )
    return out


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one line per configuration; ratios against offload=none at the same precision,
    tokens and activation checkpointing (AC); the last column against fp32 without offload."""

    def mb(b):
        return f"{b / 2**20:.0f}"

    device = any("device_peak_mb" in r for r in results)
    header = (
        "| precision | offload | AC | tokens/step | step s | vs none | CPU s | peak RSS MB | vs none | "
        "over base MB | vs none | params MB | grads MB | optim in RAM MB | act. MB/block | peak vs fp32 none |"
        + (" device peak MB | vs none |" if device else "")
    )
    lines = [header, "|" + "---|" * (18 if device else 16)]
    for r in rows(results):
        act = r.get("activation_bytes_per_block")
        offload = r["offload"] + (" + params (ZeRO-3)" if r.get("params") else "")
        lines.append(
            f"| {r['precision']} | {offload} | {r['checkpointing']} | {r['batch']}x{r['seq']} | "
            f"{r['step_s']:.2f} | {r['step_s_vs_none']:.2f}x | {r['cpu_s']:.2f} | {r['peak_rss_mb']:.0f} | "
            f"{r['peak_rss_vs_none']:.2f}x | {r['over_base_mb']:.0f} | {r['over_base_vs_none']:.2f}x | "
            f"{mb(r['param_bytes'])} | {mb(r['grad_bytes'])} | {mb(r['optimizer_state_bytes'])} | "
            f"{'-' if act is None else f'{act / 2**20:.1f}'} | {r['peak_rss_vs_fp32_none']:.2f}x |"
            + (f" {r['device_peak_mb']:.0f} | {r['device_peak_vs_none']:.2f}x |" if device else "")
        )
    return "\n".join(lines)


def summary(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """summary.json: the settings, then :func:`rows`."""
    return {
        "benchmark": "offload_memory",
        "model": {
            "class": "LitGPT",
            **model_config(args.n_layer, args.n_embd, getattr(args, "vocab", MODEL["vocab_size"])),
        },
        "num_params": results[0]["num_params"],
        "optimizer": "AdamW",
        "threads": args.threads,
        "accelerator": getattr(args, "accelerator", "cpu"),
        "rounds": args.rounds,
        "nvme_path": args.path,
        "malloc_mmap_threshold": 1048576,
        "step_time": "median over the timed steps (the first step, creating the optimizer state, is not timed)",
        "rows": rows(results),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=4, help="timed steps per configuration, interleaved"
    )
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument(
        "--no-checkpointing-rows",
        action="store_true",
        help="skip the activation-checkpointing rows",
    )
    parser.add_argument(
        "--threads", type=int, help="intra-op threads per worker (default 1; --sizes: every core)"
    )
    parser.add_argument(
        "--n-layer", type=int, default=MODEL["n_layer"], help="blocks (default 7: 50M parameters)"
    )
    parser.add_argument(
        "--n-embd", type=int, default=MODEL["n_embd"], help="width, a multiple of 64 (default 768)"
    )
    parser.add_argument(
        "--vocab", type=int, help=f"vocabulary (default {MODEL['vocab_size']}; --sizes: 32000)"
    )
    parser.add_argument(
        "--device-memory-gb",
        type=float,
        help="gpu: cap this process's device memory (torch.cuda.set_per_process_memory_fraction)",
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        help="a size ladder instead of the default rows: names "
        "(0.35B 1.3B 2.7B 6.7B) or LAYERSxWIDTH (e.g. 24x2048); see offload_ladder",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        help="--sizes: offload modes per size (default: none cpu params; "
        "also nvme, cpu-blocking, cpu-delayed)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="--sizes: sequences per step (default 8)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=1024, help="--sizes: sequence length (default 1024)"
    )
    parser.add_argument(
        "--row-timeout-s", type=float, default=150.0, help="--sizes: seconds per row"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="--sizes: no row starts after this many seconds (the rest are 'not run')",
    )
    parser.add_argument(
        "--eager-init",
        action="store_true",
        help="build the model whole in fp32 on the host first (the old path) instead of on meta, "
        "materialised by the strategy straight into its final dtype, device and shard",
    )
    parser.add_argument("--path", default=tempfile.gettempdir(), help="directory for offload=nvme")
    parser.add_argument(
        "--out",
        "--outdir",
        dest="out",
        default=str(DEFAULT_OUT),
        help=f"directory for summary.json (default {DEFAULT_OUT})",
    )
    parser.add_argument(
        "--accelerator",
        choices=["cpu", "gpu"],
        default="cpu",
        help="gpu: one CUDA device, adds peak device memory and a ZeRO-3 parameter-offload row",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=PRECISIONS, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--offload", choices=["none", "cpu", "nvme"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", choices=["none", "full"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--params", type=lambda v: v == "True", default=False, help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--overlap", type=lambda v: v == "True", default=True, help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--delay", type=lambda v: v == "True", default=False, help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.n_layer < 1 or args.n_embd < 64 or args.n_embd % 64:
        parser.error(
            f"need --n-layer >= 1 and --n-embd a multiple of 64, got {args.n_layer} and {args.n_embd}"
        )
    if args.accelerator == "gpu" and not _cuda_available():
        parser.error("--accelerator gpu needs a CUDA device; torch sees none")
    if args.device_memory_gb is not None and (
        args.accelerator != "gpu" or args.device_memory_gb <= 0
    ):
        parser.error(
            f"--device-memory-gb needs --accelerator gpu and a positive size, got {args.device_memory_gb} "
            f"with --accelerator {args.accelerator}"
        )
    ladder = args.sizes is not None
    if args.threads is None:
        args.threads = (os.cpu_count() or 1) if ladder and not args.worker else 1
    if args.vocab is None:
        args.vocab = 32_000 if ladder else MODEL["vocab_size"]
    if args.worker:
        run_worker(args)
        return
    if ladder:
        try:
            offload_ladder.main(args)
        except ValueError as error:
            parser.error(str(error))
        return
    start = time.perf_counter()
    groups = default_groups(not args.no_checkpointing_rows)
    if args.accelerator == "gpu":
        groups = gpu_groups(groups)
    results = [
        record for precision in args.precisions for record in measure(groups[precision], args)
    ]
    where = "CPU" if args.accelerator == "cpu" else "one CUDA device"
    print(
        f"\nLitGPT {results[0]['num_params']:,} parameters, AdamW, ThreeDStrategy(devices=1) on {where}; "
        f"{args.threads} intra-op thread(s), MALLOC_MMAP_THRESHOLD_=1048576; median of {args.rounds} "
        f"interleaved steps (first step untimed); nvme path {args.path}\n"
    )
    print(table(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary(results, args), indent=2))
    print(f"\n(total {time.perf_counter() - start:.0f} s; summary: {out / 'summary.json'})")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
