"""``python -m tools.bench``: the same GPT under lightning_3d and its peers, side by side.

    python -m tools.bench                       # the defaults of tools/bench/bench.yaml
    python -m tools.bench --quick --rows ddp 3d_zero1
    python -m tools.bench --repeats 5 steps=20 model.n_embd=512
    python -m tools.bench --rows ddp 3d_zero0 3d_zero1 3d_zero2 3d_zero3 lightning_fsdp \
        --repeats 3 --write-docs                       # regenerate docs/benchmarks.md's table
    python -m tools.bench --accelerator gpu     # one CUDA device: tools.bench.one_device

Writes OUTDIR/bench.md (the printed table), OUTDIR/bench.json (raw figures) and, when
matplotlib is importable, OUTDIR/bench.png; ``--write-docs [PAGE]`` also puts the table into the
generated block of PAGE (default docs/benchmarks.md) and the chart beside it
(:mod:`tools.bench.page`). Rows and formulas: :mod:`tools.bench.compare`.

The default rows are multi-process worlds on CPUs (gloo). ``--accelerator gpu`` runs the rows
that fit one device instead (raw torch loop, Lightning ``auto``, ``3d`` with and without
activation checkpointing and compile; tokens/s, TFLOP/s, MFU): every other argument goes to
:mod:`tools.bench.one_device` (``--rows``, ``--steps``, ``--outdir``, ...). That path
needs no OmegaConf, which GPU images often lack.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from tools.bench import compare
from tools.bench.page import DEFAULT_PAGE, replace_block, write_docs

LEGEND = (
    "Formulas: AR all-reduce, RS reduce-scatter, AG all-gather; E = 4 bytes (fp32); Ψ parameters of the model, "
    "Ψ_rank of this rank's stage or tensor slice; N data-parallel ranks; t tensor ranks; L blocks; B·T·C "
    "per-data-rank batch x sequence x width. 'sent' is what one rank sends with the ring algorithm, computed from "
    "the tensor bytes of every collective call it made (tools/bench/comm.py), mean over ranks; state and "
    "RSS are the largest rank's. Details: tools/bench/compare.py."
)
DEFAULT_CONFIG = Path(__file__).with_name("bench.yaml")  # beside this file: tools/ is not installed


def default_config() -> Any:
    """The defaults of ``tools/bench/bench.yaml``."""
    from omegaconf import OmegaConf

    return OmegaConf.create(DEFAULT_CONFIG.read_text())


def load_config(argv: list[str] | None) -> tuple[dict[str, Any], list[str]]:
    """Defaults from the YAML file, then --quick, then flags and key=value overrides."""
    from omegaconf import OmegaConf

    parser = argparse.ArgumentParser(
        prog="python -m tools.bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", help="YAML of defaults (default: tools/bench/bench.yaml)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps, 1 repeat")
    parser.add_argument("--rows", nargs="+", help=f"subset of rows: {', '.join(compare.ROWS)}")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--outdir")
    parser.add_argument(
        "--accelerator",
        choices=["cpu"],
        default="cpu",
        help="cpu (these rows); gpu: the one-device rows, see tools.bench.one_device",
    )
    parser.add_argument(
        "--write-docs",
        nargs="?",
        const=str(DEFAULT_PAGE),
        metavar="PAGE",
        help=f"also write the table into PAGE's generated block (default {DEFAULT_PAGE})",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.n_embd=128")
    args = parser.parse_args(argv)
    if args.config is None:
        cfg = default_config()
    elif Path(args.config).is_file():
        cfg = OmegaConf.load(args.config)
    else:
        raise ValueError(f"config file {args.config!r} does not exist")
    quick = cfg.pop("quick", {})
    if args.quick:
        cfg = OmegaConf.merge(cfg, quick)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise ValueError(f"overrides must look like key=value, got {bad}")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(args.overrides))
    flags = {
        "rows": args.rows,
        "repeats": args.repeats,
        "steps": args.steps,
        "outdir": args.outdir,
        "write_docs": args.write_docs,
    }
    cfg = OmegaConf.merge(cfg, {k: v for k, v in flags.items() if v is not None})
    return OmegaConf.to_container(cfg, resolve=True), sys.argv if argv is None else [
        "<argv>",
        *argv,
    ]


def header(cfg: dict[str, Any], command: list[str]) -> list[str]:
    """Date, machine, versions, the exact command and the settings every row shares."""
    import lightning
    import torch

    mem_kb = (
        next(
            (
                int(line.split()[1])
                for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")
            ),
            0,
        )
        if Path("/proc/meminfo").exists()
        else 0
    )
    versions = f"torch {torch.__version__}, lightning {lightning.__version__}"
    if compare.deepspeed_available():
        from importlib.metadata import version

        versions += f", deepspeed {version('deepspeed')}"
    m, d = cfg["model"], cfg["data"]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    now = datetime.datetime.now(datetime.timezone.utc)
    return [
        f"- date: {now.isoformat(timespec='seconds')}",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{mem_kb / 2**20:.1f} GiB memory; "
        f"{versions}; load average (1, 5, 15 min) at the end: {load} (this run's own ranks "
        "count: 2-3 on 2 cores; more means other work shared the machine)",
        f"- command: `{' '.join(['python -m tools.bench', *command[1:]])}`",
        f"- model: GPT n_embd {m['n_embd']}, {m['n_layer']} layers, {m['n_head']} heads, T = {m['block_size']}; "
        f"global batch {d['batch_size']} sequences; fp32 AdamW; one intra-op thread per process",
        f"- {cfg['steps']} steps per run, tokens/s = median over steps after {cfg['warmup_steps']}; "
        f"{cfg['repeats']} interleaved repeats, median reported with (min–max) over the repeats; "
        "x ddp's spread is of ratios to the ddp run of the same repeat; "
        f"bytes counted from step {cfg['comm_skip']}",
        f"- ranks run with MALLOC_MMAP_THRESHOLD_={cfg['malloc_mmap_threshold']} (glibc); peak RSS is the "
        "largest rank's; model state is counted from tensors (largest rank, next to its ZeRO formula)",
    ]


def chart(records: list[dict[str, Any]], path: str) -> bool:
    """Bar charts of tokens/s vs ddp and model state per rank; False when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if "note" not in r]
    names = [r["row"] for r in done]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.45 * len(done) + 1.5))
    left.barh(names, [r.get("vs_ddp") or 0 for r in done], color="tab:blue")
    left.axvline(1.0, color="k", lw=0.8)
    left.set_xlabel("tokens/s relative to Lightning ddp (same world size)")
    right.barh(
        names, [r["state_bytes"] / 2**20 for r in done], color="tab:orange", label="measured"
    )
    right.scatter(
        [r["state_formula_bytes"] / 2**20 for r in done],
        names,
        color="k",
        marker="|",
        s=200,
        label="ZeRO formula",
    )
    right.set_xlabel("model-state MB per rank (largest rank)")
    right.legend(loc="lower right")
    for axis in (left, right):
        axis.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def accelerator_of(argv: list[str]) -> tuple[str, list[str]]:
    """``--accelerator X`` (or ``--accelerator=X``) taken out of ``argv``: (X or "cpu", the rest)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--accelerator", default="cpu")
    known, rest = parser.parse_known_args(argv)
    return known.accelerator, rest


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    accelerator, rest = accelerator_of(sys.argv[1:] if argv is None else argv)
    if accelerator == "gpu":
        from tools.bench import one_device

        return one_device.main([*rest, "--accelerator", "gpu"])
    cfg, command = load_config(argv)
    compare.check_settings(cfg)  # bad rows or sizes fail here, before any process starts
    if cfg.get("write_docs"):  # a page without its block fails now, not after the runs
        page = Path(cfg["write_docs"])
        replace_block(page.read_text() if page.is_file() else "", "", str(page))
    raw = compare.run_all(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    records = compare.summarize(cfg, raw)
    out = Path(cfg["outdir"])
    out.mkdir(parents=True, exist_ok=True)
    misses = compare.target_misses(records)
    text = "\n".join(
        [
            *header(cfg, command),
            "",
            compare.table(records),
            "",
            LEGEND,
            "",
            "Targets missed:" if misses else "Targets: all met.",
            *[f"- {m}" for m in misses],
        ]
    )
    print(text)
    (out / "bench.md").write_text(text + "\n")
    raw_figures = {"config": cfg, "records": records, "errors": raw["errors"]}
    (out / "bench.json").write_text(json.dumps(raw_figures, indent=2, default=str))
    charted = chart(records, str(out / "bench.png"))
    if charted:
        print(f"\nchart: {out / 'bench.png'}")
    if cfg.get("write_docs"):
        write_docs(Path(cfg["write_docs"]), text, out / "bench.png" if charted else None)
        print(f"wrote {cfg['write_docs']}")
    return records


if __name__ == "__main__":
    main()
