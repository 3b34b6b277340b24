"""One device: a raw torch loop, Lightning ``auto`` and ``ThreeDStrategy`` variants, side by side.

    python -m tools.bench --accelerator gpu                 # the rows below on one GPU
    python -m tools.bench.one_device --accelerator gpu --rows auto 3d --steps 40
    python -m tools.bench.one_device --accelerator cpu --quick   # a smoke run on CPU

The same ``LitGPT`` (defaults: 12 x 768, 12 heads, T = 1024, vocab 256, batch 16, bf16-mixed,
AdamW, ``gradient_clip_val=1.0``: the one-device table) trains ``--steps`` steps in each row:

- ``torch``: a plain loop a user would write (autocast, ``clip_grad_norm_``, AdamW and the LR
  schedule from ``LitGPT.configure_optimizers``), no Lightning;
- ``auto``: ``Trainer(strategy="auto")``;
- ``3d``: ``ThreeDStrategy()`` with nothing to shard; ``3d_ac_full`` / ``3d_ac_selective``: its
  activation checkpointing; ``3d_compile``: ``compile=True`` (``torch.compile`` per block);
  ``3d_offload_cpu``: ``offload="cpu"`` (the offload row: at least 0.6x of ``3d``), and
  ``3d_offload_cpu_delayed`` with ``offload_delay_update=True`` as well (one step behind: its
  losses differ, its speed is the point).

Each row runs in a process of its own (a world of one), rows interleaved over ``--repeats``.
Every step ends with ``torch.cuda.synchronize()`` in every row alike, so a step's time is its
kernels' time, not the launch queue's; tokens/s is the median over the steps after
``--warmup`` (compilation and the allocator's first steps fall there), then over repeats.

TFLOP/s counts model FLOPs only: ``6 Ψ + 12 L C T`` per token (forward + backward of the
parameters' matmuls and of attention's scores and weighted sums); recomputation under
activation checkpointing is not counted, so a checkpointed row shows what it delivers. MFU
divides by the device's dense peak at the run's precision
(:data:`lightning_3d.observe.flops.PEAK_TFLOPS`, or ``--peak-tflops``).

Writes OUT/one_device.md (the table) and OUT/one_device.json (every figure and the settings).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from lightning_3d.observe.flops import named_device_peak, transformer_flops_per_token
from tools.bench import cell

MODEL = {
    "vocab_size": 256,
    "block_size": 1024,
    "n_layer": 12,
    "n_head": 12,
    "n_embd": 768,
    "dropout": 0.0,
}
QUICK = {
    "model": {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64},
    "batch": 4,
    "steps": 4,
    "warmup": 1,
}
ROWS: dict[str, tuple[str, dict[str, Any]]] = {  # name: (engine, ThreeDStrategy options)
    "torch": ("torch", {}),
    "auto": ("auto", {}),
    "3d": ("3d", {}),
    "3d_ac_full": ("3d", {"ac_policy": "full"}),
    "3d_ac_selective": ("3d", {"ac_policy": "selective"}),
    "3d_compile": ("3d", {"compile": True}),
    # the 86 M offload row: Adam's state and fp32 masters in CPU memory; delayed: ZeRO-Offload's
    # one-step delayed update (the CPU step overlaps the next forward and backward; other numerics)
    "3d_offload_cpu": ("3d", {"offload": "cpu"}),
    "3d_offload_cpu_delayed": ("3d", {"offload": "cpu", "offload_delay_update": True}),
}
PRECISIONS = ("bf16-mixed", "bf16-true", "32-true")
DEFAULT_OUT = Path("bench_out") / "one_device"


# --- one row, inside its own process ----------------------------------------------------------


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _data(spec: dict[str, Any]) -> Any:
    from lightning_3d.data import TextDataModule

    tokens = spec["batch"] * spec["model"]["block_size"] * (spec["steps"] + 1)
    return TextDataModule(
        corpus="stdlib",
        block_size=spec["model"]["block_size"],
        batch_size=spec["batch"],
        max_bytes=max(400_000, 2 * tokens),
        seed=spec["seed"],
        val_fraction=0.01,
    )


def _fit_torch(spec: dict[str, Any]) -> dict[str, Any]:
    """The plain loop: what ``auto`` does, written by hand."""
    import contextlib
    import itertools

    import torch

    from lightning_3d.models import LitGPT

    device = torch.device("cuda", 0) if spec["accelerator"] == "gpu" else torch.device("cpu")
    lit = LitGPT(**spec["model"], warmup_steps=2, max_steps=spec["steps"])
    if spec["precision"] == "bf16-true":
        lit = lit.to(torch.bfloat16)
    lit = lit.to(device)
    config = lit.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    data = _data(spec)
    data.setup_for(1, 0)
    batches = itertools.cycle(data.train_dataloader())
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if spec["precision"] == "bf16-mixed"
        else contextlib.nullcontext()
    )
    times = []
    for _ in range(spec["steps"]):
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        _sync(device)
        start = time.perf_counter()
        with autocast:
            loss = lit._loss((x, y))  # LitGPT's own: cross-entropy of (B, T, vocab) logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lit.parameters(), spec["clip"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
    return {
        "step_s": times,
        "num_params": sum(p.numel() for p in lit.parameters()),
        "activations": {},
    }


def _fit_lightning(spec: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import LitGPT
    from lightning_3d.observe.summary import RunSummary

    class StepTimer(Callback):
        """Seconds per training step, each bracketed by a device synchronisation."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(
            self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
        ) -> None:
            _sync(pl_module.device)
            self.start = time.perf_counter()

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            _sync(pl_module.device)
            self.times.append(time.perf_counter() - self.start)

    module = LitGPT(**spec["model"], warmup_steps=2, max_steps=spec["steps"])
    timer, summary = StepTimer(), RunSummary(warmup_steps=min(spec["warmup"], spec["steps"] - 1))
    strategy = ThreeDStrategy(**spec["options"]) if spec["engine"] == "3d" else "auto"
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator=spec["accelerator"],
            devices=1,
            strategy=strategy,
            precision=spec["precision"],
            gradient_clip_val=spec["clip"],
            max_steps=spec["steps"],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[timer, summary],
            default_root_dir=root,
        )
        trainer.fit(module, _data(spec))
    num_params = summary.summary.get("num_params") or sum(p.numel() for p in module.parameters())
    return {
        "step_s": timer.times,
        "num_params": num_params,
        "activations": dict(summary.activations),
    }


def fit_row(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train one row (``run_world`` target); step times, parameters and the device's peak."""
    import lightning as L
    import torch

    L.seed_everything(spec["seed"], verbose=False)
    gpu = spec["accelerator"] == "gpu"
    if gpu:
        torch.cuda.set_device(0)
        torch.cuda.reset_peak_memory_stats()
    result = _fit_torch(spec) if spec["engine"] == "torch" else _fit_lightning(spec)
    result["device_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20 if gpu else None
    result["device_name"] = torch.cuda.get_device_name(0) if gpu else "cpu"
    return result


# --- the parent: rows, repeats, figures --------------------------------------------------------


def check_settings(cfg: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming every bad value, before any process starts."""
    unknown = [r for r in cfg["rows"] if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known rows: {list(ROWS)}")
    for key in ("steps", "repeats", "batch"):
        if int(cfg[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    if not 0 <= cfg["warmup"] < cfg["steps"]:
        raise ValueError(f"warmup ({cfg['warmup']}) must be in [0, steps={cfg['steps']})")
    model = cfg["model"]
    if model["n_embd"] % model["n_head"]:
        raise ValueError(f"n_head ({model['n_head']}) must divide n_embd ({model['n_embd']})")
    if cfg["precision"] not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {cfg['precision']!r}")


def measure(cfg: dict[str, Any], log: Any = print, after_row: Any = None) -> dict[str, Any]:
    """Every row ``repeats`` times, interleaved; failures become notes, not crashes.
    ``after_row(raw so far)`` runs after each row (the files are rewritten: a run killed by an
    outer timeout keeps what it measured)."""
    from tools.harness.world import run_world

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg["rows"]}
    notes: dict[str, str] = {}
    for repeat in range(cfg["repeats"]):
        for name in cfg["rows"]:
            if name in notes:
                continue
            engine, options = ROWS[name]
            spec = {
                **{
                    k: cfg[k]
                    for k in (
                        "model",
                        "batch",
                        "steps",
                        "warmup",
                        "precision",
                        "clip",
                        "seed",
                        "accelerator",
                    )
                },
                "engine": engine,
                "options": options,
            }
            try:
                runs[name].append(run_world(fit_row, 1, spec, timeout=cfg["timeout_s"])[0])
            except (RuntimeError, TimeoutError) as error:
                lines = str(error).strip().splitlines()
                notes[name] = f"failed: {lines[-1][:200] if lines else type(error).__name__}"
                log(f"[repeat {repeat + 1}] {name}: {notes[name]}")
                continue
            steady = runs[name][-1]["step_s"][cfg["warmup"] :]
            log(
                f"[repeat {repeat + 1}/{cfg['repeats']}] {name}: median step {statistics.median(steady) * 1e3:.1f} ms"
            )
            if after_row is not None:
                after_row(
                    {
                        "runs": {k: v for k, v in runs.items() if k not in notes and v},
                        "notes": notes,
                    }
                )
    return {"runs": {k: v for k, v in runs.items() if k not in notes}, "notes": notes}


def summarize(cfg: dict[str, Any], raw: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per row: tokens/s, TFLOP/s, MFU, device peak and the one-device ratios."""
    tokens = cfg["batch"] * cfg["model"]["block_size"]
    records = []
    for name in cfg["rows"]:
        if name not in raw["runs"]:
            records.append({"row": name, "note": raw["notes"].get(name, "not run")})
            continue
        repeats = raw["runs"][name]
        step_s = statistics.median(statistics.median(r["step_s"][cfg["warmup"] :]) for r in repeats)
        first = repeats[0]
        per_token = transformer_flops_per_token(
            first["num_params"],
            cfg["model"]["n_layer"],
            cfg["model"]["n_embd"],
            cfg["model"]["block_size"],
        )
        tflops = tokens / step_s * per_token / 1e12
        peak = (
            cfg.get("peak_tflops")
            or named_device_peak(first["device_name"], cfg["precision"]).tflops
        )
        peaks = [r["device_peak_mb"] for r in repeats if r["device_peak_mb"] is not None]
        act = first["activations"].get("activation_bytes_per_block")
        records.append(
            {
                "row": name,
                "engine": ROWS[name][0],
                "options": ROWS[name][1],
                "device": first["device_name"],
                "num_params": first["num_params"],
                "step_s": step_s,
                "tokens_per_s": tokens / step_s,
                "flops_per_token": per_token,
                "tflops": tflops,
                "mfu": tflops / peak if peak else None,
                "device_peak_mb": max(peaks) if peaks else None,
                "activation_bytes_per_block": act,
                "step_s_runs": [statistics.median(r["step_s"][cfg["warmup"] :]) for r in repeats],
            }
        )
    by = {r["row"]: r for r in records if "note" not in r}
    for r in by.values():
        for base, key in (("auto", "vs_auto"), ("torch", "vs_torch"), ("3d", "vs_3d")):
            if base in by:
                r[key] = r["tokens_per_s"] / by[base]["tokens_per_s"]
    return records


def target_misses(records: list[dict[str, Any]]) -> list[str]:
    """The one-device targets (and the offload row) that this run misses (or could not measure), one line each."""
    by = {r["row"]: r for r in records if "note" not in r}
    misses = [f"{r['row']}: not measured ({r['note']})" for r in records if "note" in r]
    checks = [
        ("3d", "vs_auto", 0.99),
        ("3d", "vs_torch", 0.97),
        ("3d_ac_full", "vs_3d", 0.72),
        ("3d_ac_selective", "vs_3d", 0.85),
        ("3d_compile", "vs_3d", 1.15),
        ("3d_offload_cpu", "vs_3d", 0.6),
    ]
    for row, key, target in checks:
        value = by.get(row, {}).get(key)
        if value is not None and value < target:
            misses.append(f"{row}: {value:.3f}x {key[3:]} tokens/s (target >= {target})")
    selective, plain = by.get("3d_ac_selective", {}), by.get("3d", {})
    if selective.get("activation_bytes_per_block") and plain.get("activation_bytes_per_block"):
        ratio = selective["activation_bytes_per_block"] / plain["activation_bytes_per_block"]
        if ratio > 0.60:
            misses.append(
                f"3d_ac_selective: activations {ratio:.2f}x of no checkpointing (target <= 0.60)"
            )
    return misses


def table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| row | tokens/s | x auto | x torch | x 3d | TFLOP/s | MFU | device peak MB | act. MB/block |",
        "|---" * 9 + "|",
    ]
    for r in records:
        if "note" in r:
            lines.append(f"| {r['row']} | {r['note']} |" + " |" * 7)
            continue
        act = r["activation_bytes_per_block"]
        lines.append(
            f"| {r['row']} | {r['tokens_per_s']:,.0f} | {cell(r.get('vs_auto'), '.3f')} | "
            f"{cell(r.get('vs_torch'), '.3f')} | {cell(r.get('vs_3d'), '.3f')} | {r['tflops']:.3g} | "
            f"{cell(r['mfu'], '.1%')} | {cell(r['device_peak_mb'], '.0f')} | "
            f"{cell(act / 2**20 if act else None, '.1f')} |"
        )
    return "\n".join(lines)


def parse(argv: Optional[list[str]]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.one_device", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="gpu")
    parser.add_argument(
        "--rows", nargs="+", default=list(ROWS), help=f"subset of: {', '.join(ROWS)}"
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 steps: a smoke run")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 30)")
    parser.add_argument("--warmup", type=int, help="steps left out of the median (default 10)")
    parser.add_argument("--batch", type=int, help="sequences per step (default 16)")
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--n-embd", type=int)
    parser.add_argument("--n-head", type=int)
    parser.add_argument("--block-size", type=int, help="sequence length T (default 1024)")
    parser.add_argument("--precision", default="bf16-mixed", help=f"one of {', '.join(PRECISIONS)}")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (every row)")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="the device's peak for MFU (default: lightning_3d.observe.flops.PEAK_TFLOPS)",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per row run")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", "--outdir", dest="out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    model, batch, steps, warmup = dict(MODEL), 16, 30, 10
    if args.quick:
        model.update(QUICK["model"])
        batch, steps, warmup = QUICK["batch"], QUICK["steps"], QUICK["warmup"]
    for key in ("n_layer", "n_embd", "n_head", "block_size"):
        if getattr(args, key) is not None:
            model[key] = getattr(args, key)
    cfg = {
        "model": model,
        "batch": args.batch or batch,
        "steps": args.steps or steps,
        "warmup": warmup if args.warmup is None else args.warmup,
        "rows": args.rows,
        "repeats": args.repeats,
        "precision": args.precision,
        "clip": args.clip,
        "peak_tflops": args.peak_tflops,
        "timeout_s": args.timeout_s,
        "seed": args.seed,
        "accelerator": args.accelerator,
        "out": args.out,
    }
    check_settings(cfg)
    if args.accelerator == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--accelerator gpu needs a CUDA device; torch sees none")
    return cfg


def write(
    cfg: dict[str, Any], raw: dict[str, Any], seconds: float
) -> tuple[list[dict[str, Any]], str]:
    """OUT/one_device.md and OUT/one_device.json from the runs so far; the records and the text."""
    records = summarize(cfg, raw)
    m = cfg["model"]
    done = [r for r in records if "note" not in r]
    params = f"{done[0]['num_params']:,}" if done else "?"
    head = (
        f"LitGPT {params} parameters ({m['n_layer']} x {m['n_embd']}, "
        f"{m['n_head']} heads, T = {m['block_size']}, vocab {m['vocab_size']}), batch {cfg['batch']}, "
        f"{cfg['precision']}, AdamW, gradient_clip_val={cfg['clip']}; {cfg['steps']} steps per run, median after "
        f"{cfg['warmup']}, {cfg['repeats']} repeat(s); device: {done[0]['device'] if done else '?'}"
    )
    misses = target_misses(records)
    text = "\n".join(
        [
            head,
            "",
            table(records),
            "",
            "Targets missed:" if misses else "Targets: all met.",
            *[f"- {x}" for x in misses],
            "",
            f"(total {seconds:.0f} s)",
        ]
    )
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "one_device.md").write_text(text + "\n")
    (out / "one_device.json").write_text(
        json.dumps({"config": cfg, "records": records, "misses": misses}, indent=2, default=str)
    )
    return records, text


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    cfg = parse(argv)
    start = time.perf_counter()
    raw = measure(
        cfg,
        log=lambda line: print(line, file=sys.stderr, flush=True),
        after_row=lambda so_far: write(cfg, so_far, time.perf_counter() - start),
    )
    records, text = write(cfg, raw, time.perf_counter() - start)
    print(text)
    return records


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        sys.exit(f"error: {error}")
