"""Optimizer step time and peak RSS: plain AdamW vs state offloaded to CPU RAM vs to NVMe.

    python -m tools.bench.offload [--numel 50000000] [--rounds 5] [--threads N] [--path DIR]
                                         [--direct-io auto|on|off]

Only the optimizer step is timed, on fixed random gradients of ``--numel`` fp32 parameters (cut
into 24 tensors, like a model's layers). Variants: ``none`` is ``torch.optim.AdamW`` as most
scripts build it (unfused on CPU), ``fused`` is ``AdamW(fused=True)``, the fastest CPU step torch
has and the yardstick for the offloaded ones (the issue's target: ``cpu`` >= 0.9x its params/s).
Each variant lives in its own process on the same seeded tensors, so its peak RSS is its own;
the parent asks them for one step at a time in turn (interleaved, only one running, the order
rotating each round, a pause between steps) and the table shows medians, and the best step as
params/s (on a shared machine the median carries the neighbours' load, the best much less).
Workers run with ``MALLOC_MMAP_THRESHOLD_=1048576`` (freed large tensors go back to the OS) and
``--threads`` intra-op threads (default: every core this process may use). The nvme variant
uses direct I/O (``O_DIRECT``) where the file system allows it (``--direct-io auto``, the
default): every step then reads and writes the whole state on the drive. Buffered
(``--direct-io off``, or a file system that refuses ``O_DIRECT``) the file usually sits in the
page cache on a machine with spare RAM, so the figures measure the streaming machinery
(syscalls, copies, overlap), not the drive, and RSS does not count that cache. A line below the
table says which mode was in effect, how much the page cache grew over the nvme run
(``/proc/meminfo`` "Cached": system-wide, so other processes' I/O shows too) and how many bytes
per step it read from and wrote to storage (``/proc/self/io``; reads served from the page
cache count nothing).
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

from tools import pythonpath

VARIANTS = ("none", "fused", "cpu", "nvme")
PAIR = "pair"  # fused and cpu on the same tensors in one process: the headline ratio
LAYERS = 24
PAUSE_S = 0.3  # between two timed steps: longer than OpenMP's spin-wait after a parallel region
DIRECT_IO = {"auto": "auto", "on": True, "off": False}


def _cached_bytes() -> int:
    """The kernel's page cache now (``Cached`` of ``/proc/meminfo``, all processes); 0 off Linux."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Cached:"))
    except (OSError, StopIteration):
        return 0


def _storage_bytes() -> tuple[int, int]:
    """Bytes this process has read from and written to storage (``/proc/self/io``); 0s off Linux."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def _params(args: argparse.Namespace) -> list:
    """``--numel`` seeded fp32 parameters in ``LAYERS`` tensors, with seeded gradients."""
    import torch

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    sizes = [args.numel // LAYERS + (1 if i < args.numel % LAYERS else 0) for i in range(LAYERS)]
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    return params


def _pair_worker(args: argparse.Namespace) -> None:
    """Fused ``AdamW`` and ``OffloadedAdam(device="cpu")`` stepping the very same parameter and
    gradient tensors in one process (each with its own state), timed one after the other in
    alternating order per ``step`` line: the ratio without the memory placement and the load
    that differ between processes."""
    import torch

    from lightning_3d.offload import OffloadedAdam

    params = _params(args)
    fused = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    offloaded = OffloadedAdam.from_optimizer(
        torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01), chunk_bytes=args.chunk_mb * 2**20
    )
    fused.step(), offloaded.step()  # the first steps create the state: not timed
    print("ready", flush=True)
    pairs = [("fused_s", fused), ("cpu_s", offloaded)]
    for line in sys.stdin:
        if line.strip() != "step":
            break
        times = {}
        for name, opt in pairs:
            start, cpu_start = time.perf_counter(), time.process_time()
            opt.step()
            times[name] = time.perf_counter() - start
            times[f"cpu_{name}"] = time.process_time() - cpu_start  # all threads' CPU time
        pairs.reverse()
        print(json.dumps(times), flush=True)
    offloaded.close()
    print(json.dumps({}), flush=True)


def _worker(args: argparse.Namespace) -> None:
    """One variant in its own process: set up, then one timed step per ``step`` line on stdin."""
    import torch

    from lightning_3d.observe.memory import peak_rss_mb
    from lightning_3d.offload import OffloadedAdam

    params = _params(args)
    rss_before = peak_rss_mb()  # parameters + gradients + interpreter
    cached_before = _cached_bytes()
    opt = torch.optim.AdamW(
        params, lr=1e-4, weight_decay=0.01, fused=args.worker == "fused" or None
    )
    if args.worker in ("cpu", "nvme"):
        path = args.path if args.worker == "nvme" else None
        io = {"direct_io": DIRECT_IO[args.direct_io]} if args.worker == "nvme" else {}
        opt = OffloadedAdam.from_optimizer(
            opt, device=args.worker, path=path, chunk_bytes=args.chunk_mb * 2**20, **io
        )
    opt.step()  # the first step creates the state: not timed
    print("ready", flush=True)
    steps, storage_before = 0, _storage_bytes()
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = time.perf_counter()
        opt.step()
        steps += 1
        print(json.dumps({"step_s": time.perf_counter() - start}), flush=True)
    read, written = (after - before for after, before in zip(_storage_bytes(), storage_before))
    cache_added = _cached_bytes() - cached_before
    resident = getattr(opt, "resident_state_bytes_peak", 8 * args.numel)
    direct = getattr(getattr(opt, "_store", None), "direct_io", None)
    if isinstance(opt, OffloadedAdam):
        opt.close()
    print(
        json.dumps(
            {
                "peak_rss_mb": peak_rss_mb(),
                "rss_before_mb": rss_before,
                "resident_state_mb": resident / 2**20,
                "direct_io": direct,
                "page_cache_added_mb": cache_added / 2**20,
                "read_mb_per_step": read / 2**20 / max(steps, 1),
                "written_mb_per_step": written / 2**20 / max(steps, 1),
            }
        ),
        flush=True,
    )


def _start_worker(variant: str, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="1048576",
        OMP_NUM_THREADS=str(args.threads),
        PYTHONPATH=pythonpath(),
    )
    command = [
        sys.executable,
        "-m",
        "tools.bench.offload",
        "--worker",
        variant,
        "--numel",
        str(args.numel),
        "--chunk-mb",
        str(args.chunk_mb),
        "--threads",
        str(args.threads),
        "--path",
        args.path,
        "--direct-io",
        args.direct_io,
    ]
    return subprocess.Popen(
        command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


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
    parser.add_argument(
        "--rounds", type=int, default=5, help="timed steps per variant, interleaved"
    )
    parser.add_argument("--chunk-mb", type=int, default=16)
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="intra-op threads of every variant (default: all usable cores)",
    )
    parser.add_argument(
        "--path", default=tempfile.gettempdir(), help="directory for the nvme variant"
    )
    parser.add_argument(
        "--direct-io",
        choices=tuple(DIRECT_IO),
        default="auto",
        help="nvme variant: O_DIRECT on, off, or where the file system allows it (auto)",
    )
    parser.add_argument("--worker", choices=(*VARIANTS, PAIR), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("numel", "rounds", "chunk_mb", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.worker:
        (_pair_worker if args.worker == PAIR else _worker)(args)
        return
    start = time.perf_counter()
    # One process per variant, so each peak RSS is that variant's alone; they set up in parallel.
    everyone = (*VARIANTS, PAIR)
    workers = {v: _start_worker(v, args) for v in everyone}
    for variant, worker in workers.items():
        if worker.stdout.readline().strip() != "ready":
            raise RuntimeError(f"benchmark worker {variant} failed to start ({worker.wait()})")
    results: dict[str, list[dict]] = {v: [] for v in everyone}
    for round_index in range(args.rounds):
        # Interleaved, so drift hits every variant alike; the order rotates each round, and a
        # pause lets the last worker's OpenMP threads stop spinning before the next one starts.
        shift = round_index % len(everyone)
        for variant in everyone[shift:] + everyone[:shift]:
            time.sleep(PAUSE_S)
            results[variant].append(json.loads(_ask(workers[variant], "step")))
    for variant, worker in workers.items():
        results[variant].append(json.loads(_ask(worker, "end")))
        worker.wait()
    pairs = results.pop(PAIR)[:-1]
    step_s = {v: statistics.median(r["step_s"] for r in rows[:-1]) for v, rows in results.items()}
    best_s = {v: min(r["step_s"] for r in rows[:-1]) for v, rows in results.items()}
    med = {v: {**rows[-1], "step_s": step_s[v], "best_s": best_s[v]} for v, rows in results.items()}
    print(
        f"\n{args.numel:,} fp32 parameters, AdamW step only; {args.threads} intra-op thread(s), "
        f"chunk {args.chunk_mb} MiB, MALLOC_MMAP_THRESHOLD_=1048576; median of {args.rounds} interleaved "
        f"steps each; nvme path {args.path}"
    )
    print(
        "| offload | step s | vs none | M params/s | params/s vs fused | best M params/s | peak RSS MB "
        "| RSS before optimizer MB | RSS added MB | state in RAM MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for variant, row in med.items():
        print(
            f"| {variant} | {row['step_s']:.3f} | {row['step_s'] / med['none']['step_s']:.2f}x | "
            f"{args.numel / row['step_s'] / 1e6:.1f} | {med['fused']['step_s'] / row['step_s']:.2f}x | "
            f"{args.numel / row['best_s'] / 1e6:.1f} | "
            f"{row['peak_rss_mb']:.0f} | {row['rss_before_mb']:.0f} | "
            f"{row['peak_rss_mb'] - row['rss_before_mb']:.0f} | {row['resident_state_mb']:.0f} |"
        )
    nvme = med["nvme"]
    mode = {True: "on (O_DIRECT)", False: "off (page cache)"}.get(nvme["direct_io"], "?")
    print(
        f"\nnvme: direct I/O {mode} (--direct-io {args.direct_io}); page cache grew "
        f"{nvme['page_cache_added_mb']:.0f} MB over its run (/proc/meminfo Cached, system-wide); storage "
        f"reads {nvme['read_mb_per_step']:.0f} MB and writes {nvme['written_mb_per_step']:.0f} MB per step "
        f"(/proc/self/io)"
    )
    state_mb = 8 * args.numel / 2**20
    fused_s, cpu_s = (statistics.median(r[key] for r in pairs) for key in ("fused_s", "cpu_s"))
    print(
        f"\nSame tensors, one process, {args.threads} thread(s), median of {len(pairs)} interleaved pairs: "
        f"torch.optim.AdamW(fused=True) {args.numel / fused_s / 1e6:.1f} M params/s, "
        f"OffloadedAdam(device='cpu') {args.numel / cpu_s / 1e6:.1f} M params/s"
    )
    print(
        f"OffloadedAdam(device='cpu') vs torch.optim.AdamW(fused=True): {fused_s / cpu_s:.2f}x params/s "
        f"(target >= 0.9x; the table's separate processes: {med['fused']['step_s'] / med['cpu']['step_s']:.2f}x)"
    )
    # CPU seconds (all threads) barely count time spent preempted by other processes' load.
    fused_cpu, cpu_cpu = (
        statistics.median(r[key] for r in pairs) for key in ("cpu_fused_s", "cpu_cpu_s")
    )
    print(
        f"by CPU time per step (less sensitive to other load): fused {fused_cpu:.3f} s, OffloadedAdam "
        f"{cpu_cpu:.3f} s, {fused_cpu / cpu_cpu:.2f}x"
    )
    print(
        f"(total {time.perf_counter() - start:.0f} s; state = exp_avg + exp_avg_sq = {state_mb:.0f} MB)"
    )


if __name__ == "__main__":
    main()
