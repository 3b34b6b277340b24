"""The memory kit's rows for activation offload and low-bit AdamW states, counted from tensors.

    python -m tools.bench.memory_kit [--steps 200] [--out DIR]
    python -m tools.bench.memory_kit --quick     # 5 fine-tune steps: a smoke run

Two measurements on the reference GPT (``lightning_3d.models.gpt``), one process:

- **activation offload**: the activation meter (:class:`~lightning_3d.parallel.activations.
  ActivationMeter`, what ``summary.json`` reports) over one training step, per block: bytes
  saved for backward on the device and bytes offloaded to the host, with ``activation_offload``
  off and on, for ``ac_policy`` none and full; plus the step time (on a CPU the "host" copy is a
  copy in the same memory, so the time says what the copies cost, not what a GPU would overlap).
- **low-bit optimizer states**: AdamW, torchao's 8-bit and 4-bit AdamW and bitsandbytes' 8-bit
  AdamW fine-tune the same model (:data:`FINETUNE`, smaller) on the same bytes of the embedded
  stdlib corpus for ``--steps`` steps (same seed, same batches); the table gives the optimizer state's bytes by dtype
  (counted from the state tensors) and the final loss (mean of the last 10 steps) against fp32
  AdamW's. torchao's step runs eagerly here (``torch.compiler.set_stance("force_eager")``: the
  same quantized arithmetic, without a minute of compiling per shape on a 2-core CPU).

Prints a table and writes ``OUT/summary.json`` (default ``bench_out/memory_kit``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_3d.data.text import load_stdlib_corpus
from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    transformer_blocks,
)
from lightning_3d.parallel.activations import ActivationMeter
from lightning_3d.parallel.optimizers import build_optimizer, state_bytes_by_dtype

CONFIG = {"n_embd": 256, "n_layer": 4, "n_head": 8, "block_size": 128, "dropout": 0.0}
# The fine-tune: smaller, so that four optimizers x 200 eager steps fit minutes on 2 cores.
FINETUNE = {"n_embd": 128, "n_layer": 2, "n_head": 4, "block_size": 64, "dropout": 0.0}
BATCH = 8
LR = 1e-3
DEFAULT_OUT = Path("bench_out") / "memory_kit"


def _model(config: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**config))


def _batches(config: dict, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of BATCH windows of the stdlib corpus (inputs, next-byte targets)."""
    length = config["block_size"]
    data = torch.frombuffer(bytearray(load_stdlib_corpus(2_000_000)), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - length - 1, (BATCH,), generator=gen)
        windows = torch.stack([data[s : s + length + 1] for s in starts.tolist()])
        out.append((windows[:, :-1], windows[:, 1:]))
    return out


def activation_rows(config: dict, repeats: int = 3) -> list[dict[str, Any]]:
    """Per policy and offload setting: mean device and host bytes per block, step seconds."""
    model = _model(config)
    x, y = _batches(config, 1)[0]
    rows = []
    for policy in ("none", "full"):
        for offload in (False, True):
            apply_activation_checkpointing(model, policy, offload=offload)
            meter = ActivationMeter()
            unwatch = meter.watch(transformer_blocks(model))
            times = []
            for _ in range(repeats):
                meter.reset(model.parameters())
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                with meter.hooks():
                    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
                times.append(time.perf_counter() - start)
            unwatch()
            rows.append(
                {
                    "ac_policy": policy,
                    "activation_offload": offload,
                    "device_bytes_per_block": statistics.mean(meter.block_bytes.values()),
                    "host_bytes_per_block": statistics.mean(meter.block_host_bytes.values()),
                    "step_s": statistics.median(times),
                }
            )
    apply_activation_checkpointing(model, "none")
    return rows


def optimizer_rows(config: dict, steps: int) -> list[dict[str, Any]]:
    """Per optimizer: state bytes by dtype after the fine-tune, its losses' tail, seconds."""
    names = ["adamw", "adamw8bit", "adamw4bit"]
    if importlib.util.find_spec("bitsandbytes") is not None:
        names.append("adamw8bit_bnb")
    batches = _batches(config, steps)
    rows = []
    with torch.compiler.set_stance("force_eager"):
        for name in names:
            model = _model(config)
            decay = [p for p in model.parameters() if p.dim() >= 2]
            rest = [p for p in model.parameters() if p.dim() < 2]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
            optimizer = build_optimizer(name, groups, LR, (0.9, 0.95))
            losses, start = [], time.perf_counter()
            for x, y in batches:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
            by_dtype = state_bytes_by_dtype(optimizer)
            rows.append(
                {
                    "optimizer": name,
                    "state_bytes": by_dtype,
                    "state_total": sum(by_dtype.values()),
                    "final_loss": statistics.mean(losses[-10:]),
                    "seconds": time.perf_counter() - start,
                }
            )
    base = rows[0]
    for row in rows:
        row["state_ratio"] = row["state_total"] / base["state_total"]
        row["loss_change"] = row["final_loss"] / base["final_loss"] - 1
    return rows


def table(activations: list[dict], optimizers: list[dict]) -> str:
    lines = [
        "| ac_policy | activation_offload | device B/block | host B/block | step s |",
        "|---|---|---|---|---|",
    ]
    for r in activations:
        lines.append(
            f"| {r['ac_policy']} | {r['activation_offload']} | {r['device_bytes_per_block']:,.0f} "
            f"| {r['host_bytes_per_block']:,.0f} | {r['step_s']:.3f} |"
        )
    lines += [
        "",
        "| optimizer | state bytes by dtype | vs adamw | final loss | vs adamw | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for r in optimizers:
        dtypes = ", ".join(f"{k} {v:,}" for k, v in sorted(r["state_bytes"].items()))
        lines.append(
            f"| {r['optimizer']} | {dtypes} | {r['state_ratio']:.3f}x | {r['final_loss']:.4f} "
            f"| {r['loss_change']:+.2%} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.memory_kit", description=__doc__)
    parser.add_argument("--steps", type=int, default=200, help="fine-tune steps per optimizer")
    parser.add_argument("--quick", action="store_true", help="tiny model, 5 steps")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    if args.steps < 10 and not args.quick:
        parser.error(f"--steps={args.steps}: at least 10 (the final loss is the last 10's mean)")
    torch.set_num_threads(1)
    tiny = {"n_embd": 32, "n_layer": 2, "n_head": 4, "block_size": 32}
    config = dict(CONFIG, **tiny) if args.quick else CONFIG
    finetune = dict(FINETUNE, **tiny) if args.quick else FINETUNE
    steps = 10 if args.quick else args.steps
    activations, optimizers = activation_rows(config), optimizer_rows(finetune, steps)
    text = table(activations, optimizers)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "benchmark": "memory_kit",
        "model": config,
        "finetune_model": finetune,
        "batch": BATCH,
        "steps": steps,
        "activations": activations,
        "optimizers": optimizers,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
