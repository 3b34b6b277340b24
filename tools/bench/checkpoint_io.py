"""Save/load time and size of a consolidated checkpoint, and of its safetensors export.

    python -m tools.bench.checkpoint_io [--n-layer 7] [--n-embd 768] [--repeats 3] [--dir DIR]

Builds LitGPT (``n_head = n_embd / 64``, vocab 256, block 128: 50.0M parameters at the
defaults), takes one AdamW step on random gradients so the optimizer state is full-size, and
times, median of ``--repeats`` runs each:

- Lightning's ``TorchCheckpointIO`` save (serializes to memory, then writes) and
  :class:`~lightning_3d.checkpoint.io.AtomicCheckpointIO` save (temp file + fsync + rename)
  of the whole checkpoint (weights + AdamW state + counters);
- the weights-only load of that file;
- :func:`~lightning_3d.checkpoint.export.export_safetensors` (reads the .ckpt, writes the
  weights) and loading the result (``safetensors.torch.load_file``, and
  :func:`~lightning_3d.checkpoint.pretrained.load_pretrained` into a fresh LitGPT).

Loads read a file that was just written, so they are served from the page cache: they measure
deserialization and copies, not the disk. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_3d.checkpoint.export import export_safetensors
from lightning_3d.checkpoint.io import AtomicCheckpointIO
from lightning_3d.checkpoint.pretrained import load_pretrained
from lightning_3d.models import LitGPT


def build_checkpoint(n_layer: int, n_embd: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Lightning-format consolidated checkpoint of LitGPT after one AdamW step, and the
    model's constructor arguments."""
    kwargs = {
        "vocab_size": 256,
        "block_size": 128,
        "n_layer": n_layer,
        "n_head": n_embd // 64,
        "n_embd": n_embd,
    }
    torch.manual_seed(0)
    lit = LitGPT(**kwargs)
    opt = torch.optim.AdamW(lit.parameters(), lr=1e-4)
    for p in lit.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    checkpoint = {
        "epoch": 0,
        "global_step": 1,
        "state_dict": lit.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [],
        "hyper_parameters": dict(lit.hparams),
    }
    return checkpoint, kwargs


def median_seconds(action: Callable[[int], None], repeats: int) -> float:
    """Median wall time of ``action(i)`` over ``repeats`` runs."""
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        action(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(
    n_layer: int, n_embd: int, repeats: int, directory: Path
) -> tuple[list[tuple[str, int, float]], int]:
    """Rows of (operation, bytes of the file involved, median seconds), and the parameter count."""
    from lightning.fabric.plugins.io import TorchCheckpointIO
    from safetensors.torch import load_file

    checkpoint, kwargs = build_checkpoint(n_layer, n_embd)
    atomic, plain = AtomicCheckpointIO(), TorchCheckpointIO()
    ckpt, lightning_ckpt = directory / "last.ckpt", directory / "lightning.ckpt"
    rows = []
    seconds = median_seconds(lambda i: plain.save_checkpoint(checkpoint, lightning_ckpt), repeats)
    rows.append(("save .ckpt: Lightning TorchCheckpointIO", lightning_ckpt.stat().st_size, seconds))
    lightning_ckpt.unlink()
    seconds = median_seconds(lambda i: atomic.save_checkpoint(checkpoint, ckpt), repeats)
    rows.append(("save .ckpt: AtomicCheckpointIO (fsync + rename)", ckpt.stat().st_size, seconds))
    seconds = median_seconds(lambda i: atomic.load_checkpoint(ckpt), repeats)
    rows.append(("load .ckpt: AtomicCheckpointIO (weights_only)", ckpt.stat().st_size, seconds))
    out = directory / "model.safetensors"
    seconds = median_seconds(lambda i: export_safetensors(ckpt, out, force=True), repeats)
    rows.append(("export .ckpt -> .safetensors (weights only)", out.stat().st_size, seconds))
    seconds = median_seconds(lambda i: load_file(str(out)), repeats)
    rows.append(("load .safetensors: safetensors load_file", out.stat().st_size, seconds))
    fresh = LitGPT(**kwargs)
    seconds = median_seconds(lambda i: load_pretrained(fresh, out), repeats)
    rows.append(("load_pretrained(LitGPT, .safetensors)", out.stat().st_size, seconds))
    seconds = median_seconds(lambda i: load_pretrained(fresh, ckpt), repeats)
    rows.append(("load_pretrained(LitGPT, .ckpt)", ckpt.stat().st_size, seconds))
    return rows, sum(p.numel() for p in fresh.parameters())


def table(rows: list[tuple[str, int, float]], params: int, repeats: int) -> str:
    """The rows as a markdown table."""
    lines = [
        f"LitGPT, {params / 1e6:.1f}M parameters (fp32), median of {repeats}",
        "",
        "| operation | file MB | median s | MB/s |",
        "|---|---|---|---|",
    ]
    for name, size, seconds in rows:
        lines.append(f"| {name} | {size / 1e6:.1f} | {seconds:.3f} | {size / 1e6 / seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run the measurements in a temporary directory, print the table."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.checkpoint_io", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--n-layer", type=int, default=7)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dir", default=None, help="where to write the files (default: a temporary directory)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.n_layer < 1 or args.n_embd < 64 or args.n_embd % 64:
        parser.error(f"need repeats >= 1, n_layer >= 1, n_embd a multiple of 64; got {vars(args)}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows, params = run(args.n_layer, args.n_embd, args.repeats, Path(tmp))
    print(table(rows, params, args.repeats))


if __name__ == "__main__":
    main()
