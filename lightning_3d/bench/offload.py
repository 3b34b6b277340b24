"""Optimizer step time and peak RSS: plain AdamW vs state offloaded to CPU RAM vs to NVMe.

    python -m lightning_3d.bench.offload [--numel 50000000] [--rounds 5] [--path DIR]

Only the optimizer step is timed, on fixed random gradients of ``--numel`` fp32 parameters (cut
into 24 tensors, like a model's layers). Each variant lives in its own process, so its peak RSS
is its own; the parent asks them for one step at a time in turn (interleaved, only one running)
and the table shows medians. Workers run with ``MALLOC_MMAP_THRESHOLD_=1048576`` (freed large tensors go back to the
OS) and ``--threads`` intra-op threads. The NVMe file usually sits in the page cache on a
machine with spare RAM, so its figures measure the streaming machinery (syscalls, copies,
overlap), not the drive; RSS does not count the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("none", "cpu", "nvme")
LAYERS = 24


def _worker(args: argparse.Namespace) -> None:
    """One variant in its own process: set up, then one timed step per ``step`` line on stdin."""
    import torch

    from lightning_3d.memory import peak_rss_mb
    from lightning_3d.offload import OffloadedAdam

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    sizes = [args.numel // LAYERS + (1 if i < args.numel % LAYERS else 0) for i in range(LAYERS)]
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    rss_before = peak_rss_mb()  # parameters + gradients + interpreter
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    if args.worker != "none":
        path = args.path if args.worker == "nvme" else None
        opt = OffloadedAdam.from_optimizer(opt, device=args.worker, path=path, chunk_bytes=args.chunk_mb * 2**20)
    opt.step()  # the first step creates the state: not timed
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = time.perf_counter()
        opt.step()
        print(json.dumps({"step_s": time.perf_counter() - start}), flush=True)
    resident = getattr(opt, "resident_state_bytes_peak", 8 * args.numel)
    if isinstance(opt, OffloadedAdam):
        opt.close()
    print(json.dumps({"peak_rss_mb": peak_rss_mb(), "rss_before_mb": rss_before,
                      "resident_state_mb": resident / 2**20}), flush=True)


def _start_worker(variant: str, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", OMP_NUM_THREADS=str(args.threads))
    command = [sys.executable, "-m", "lightning_3d.bench.offload", "--worker", variant, "--numel", str(args.numel),
               "--chunk-mb", str(args.chunk_mb), "--threads", str(args.threads), "--path", args.path]
    return subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ask(worker: subprocess.Popen, line: str) -> str:
    worker.stdin.write(line + "\n")
    worker.stdin.flush()
    answer = worker.stdout.readline()
    if not answer:
        raise RuntimeError(f"benchmark worker exited with {worker.wait()}")
    return answer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per variant, interleaved")
    parser.add_argument("--chunk-mb", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--path", default=tempfile.gettempdir(), help="directory for the nvme variant")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    start = time.perf_counter()
    # One process per variant, so each peak RSS is that variant's alone; they set up in parallel.
    workers = {v: _start_worker(v, args) for v in VARIANTS}
    for variant, worker in workers.items():
        if worker.stdout.readline().strip() != "ready":
            raise RuntimeError(f"benchmark worker {variant} failed to start ({worker.wait()})")
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant, worker in workers.items():  # interleaved, so drift hits every variant alike
            results[variant].append(json.loads(_ask(worker, "step")))
    for variant, worker in workers.items():
        results[variant].append(json.loads(_ask(worker, "end")))
        worker.wait()
    step_s = {v: statistics.median(r["step_s"] for r in rows[:-1]) for v, rows in results.items()}
    med = {v: {**rows[-1], "step_s": step_s[v]} for v, rows in results.items()}
    print(f"\n{args.numel:,} fp32 parameters, AdamW step only; {args.threads} intra-op thread(s), "
          f"chunk {args.chunk_mb} MiB, MALLOC_MMAP_THRESHOLD_=1048576; median of {args.rounds} interleaved "
          f"steps each; nvme path {args.path}")
    print("| offload | step s | vs none | peak RSS MB | RSS before optimizer MB | RSS added MB | state in RAM MB |")
    print("|---|---|---|---|---|---|---|")
    for variant, row in med.items():
        print(f"| {variant} | {row['step_s']:.3f} | {row['step_s'] / med['none']['step_s']:.2f}x | "
              f"{row['peak_rss_mb']:.0f} | {row['rss_before_mb']:.0f} | "
              f"{row['peak_rss_mb'] - row['rss_before_mb']:.0f} | {row['resident_state_mb']:.0f} |")
    state_mb = 8 * args.numel / 2**20
    print(f"\n(total {time.perf_counter() - start:.0f} s; state = exp_avg + exp_avg_sq = {state_mb:.0f} MB)")


if __name__ == "__main__":
    main()
