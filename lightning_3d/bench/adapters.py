"""Full fine-tune, LoRA and QLoRA of one Llama-style model: model-state bytes against the
formula, peak RSS and tokens/s, one process per method.

    python -m lightning_3d.bench.adapters [--hidden 512 --layers 8 --vocab 8192] [--steps 4] \\
        [--batch 4 --seq 128] [--r 8] [--data 2 --zero-stage 3] [--out DIR]

The model is ``HFCausalLM(config=...)`` of a ``transformers`` Llama config built here (no
download): ``--hidden`` wide (64-wide heads, as many key/value heads as query heads), MLP width
8/3 of it rounded up to a multiple of 256, ``--layers`` blocks, ``--vocab`` tokens, untied head;
the defaults are 35.6 M parameters. Each method trains ``1 + --steps`` AdamW steps through
``ThreeDStrategy()`` on one CPU device (``--data N --zero-stage S``: N gloo processes) at
``32-true`` (the project's reference run, :func:`lightning_3d.harness.runs.fit_gpt`) in a
process of its own (``run_world``, spawned), so its peak RSS is its own; the methods run one
after another, one intra-op thread each, workers with ``MALLOC_MMAP_THRESHOLD_=1048576`` (freed
large tensors go back to the OS).

Rows: ``full`` (every weight trains), ``lora`` and ``qlora`` (``adapter=`` with ``r=--r``,
``lora_alpha=2r``, ``target_modules=all-linear``: every projection of the blocks; the embedding,
norms and head stay frozen as they are). Columns:

- Ψ: the base model's parameters; Φ: the adapters'; Ψq: the weights QLoRA stores in NF4 (every
  adapted projection); the rest of the base (embedding, norms, head) stays fp32;
- params / grads / optim MB: ``lightning_3d.observe.memory.model_state_bytes`` at the optimizer
  step of the second step (Adam's state exists), counted from the resident tensors;
- formula: fp32 weights, fp32 gradients and two fp32 Adam moments are 16 bytes a trained
  parameter (``docs/memory.md``), a frozen one keeps its 4 weight bytes only: full ``16Ψ``; LoRA
  ``4Ψ + 16Φ``; QLoRA ``0.516Ψq + 4(Ψ − Ψq) + 16Φ`` (torchao's NF4: 4-bit codes, one 8-bit
  scale per 64 values, one bf16 factor per 256 scales: 0.5 + 1/64 + 1/8192 bytes a value); the
  ratio measured / formula. The measured NF4 bytes run a little above (0.524 a value at width
  128): torchao keeps each weight's factors and mean as views into larger buffers, and
  ``model_state_bytes`` counts a storage whole;
- base MB: the frozen base's bytes (measured parameter bytes less the adapters'), and its
  ratio to the same weights in bf16 (2Ψ); ``NF4 vs bf16``: the quantized weights' bytes against
  2Ψq;
- peak RSS: the worker's, at the end of training, and the same less the RSS after imports;
- tokens/s: the median over the timed steps (the first step, which creates Adam's state, is not
  timed; ``RunSummary``'s ``tokens_per_s``).

- worst rank / formula: the rank holding the most against the same per-rank formula (with
  ``--data N --zero-stage S``: N processes, each stage dividing what it shards by N — Adam's
  moments from 1, gradients from 2, weights at 3 — so ``--data 2 --zero-stage 3`` expects half
  of each method's bytes on every rank);
- adapters' share: the adapter modules' part of a forward + backward, timed by hooks on a fresh
  copy of the model after training (``lightning_3d.bench.adapter_share``, one process).

Writes OUT/adapters.md (the table) and OUT/adapters.json (every figure and the settings); default
OUT is ``bench_out/adapters``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from lightning_3d.adapters.qlora import NF4_BYTES_PER_VALUE
from lightning_3d.harness.runs import Run, fit_gpt
from lightning_3d.harness.world import run_world

METHODS = ("full", "lora", "qlora")
DEFAULT_OUT = Path("bench_out") / "adapters"


def llama_config(hidden: int, layers: int, vocab: int, seq: int) -> dict[str, Any]:
    """A Llama config for ``HFCausalLM(config=...)``. The MLP width is a multiple of 256 and the
    width a multiple of 128, so every projection holds a multiple of 64 x 256 values (what
    torchao's NF4 needs)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=256 * math.ceil(8 * hidden / 3 / 256),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=max(seq, 128),
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    return config.to_dict()


def method_run(method: str, args: argparse.Namespace) -> Run:
    adapter = (
        None if method == "full" else {"method": method, "r": args.r, "lora_alpha": 2 * args.r}
    )
    return Run(
        strategy={"data": args.data, "zero_stage": args.zero_stage},  # ThreeDStrategy
        devices=args.data,
        steps=1 + args.steps,
        seed=1234,
        arch="hf",
        model={
            "hf": llama_config(args.hidden, args.layers, args.vocab, args.seq),
            "adapter": adapter,
            "lr": 1e-4,
            "warmup_steps": 0,
            "max_steps": 1 + args.steps,
        },
        data={"block_size": args.seq, "batch_size": args.batch, "max_bytes": 1_000_000},
        initial_state=False,  # a copy of the weights would count in the peak RSS
        summary_warmup=1,  # Adam's state is created in the first step: not timed
    )


def measure_method(rank: int, run: Run, threads: int) -> dict[str, Any]:
    """One method in this (spawned) process: train, then split the model-state bytes."""
    import lightning  # noqa: F401 -- the runtime, so that the RSS after imports counts it
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from lightning_3d.adapters import is_adapter_name
    from lightning_3d.observe.memory import peak_rss_mb

    torch.set_num_threads(threads)
    if run.model["adapter"] and run.model["adapter"]["method"] == "qlora":
        import torchao  # noqa: F401
    imports_rss = peak_rss_mb()
    result = fit_gpt(rank, run)
    summary, state = result["summary"], result["state"]
    if rank:  # rank 0 holds the full state and every rank's bytes (the run summary's)
        return {}
    qlora = bool(run.model["adapter"]) and run.model["adapter"]["method"] == "qlora"
    adapters = {k: v for k, v in state.items() if is_adapter_name(k)}
    base = {k: v for k, v in state.items() if k not in adapters}
    # QLoRA stores each adapted projection's weight in NF4 (the state holds it dequantized)
    quantized = {k: v for k, v in base.items() if qlora and k.endswith(".base_layer.weight")}
    # Every other tensor is plain: its bytes are its dtype's (fp32 here).
    dense_base_bytes = sum(
        v.numel() * v.element_size() for k, v in base.items() if k not in quantized
    )
    share = {}
    if rank == 0 and run.model["adapter"]:  # after training: its peak RSS is already taken
        share = _share(run)
    ranks = summary["ranks"]
    held = [r["param_bytes"] + r["grad_bytes"] + r["optimizer_state_bytes"] for r in ranks]
    rank0 = ranks[0]
    return {
        "base_params": sum(v.numel() for v in base.values()),
        "adapter_params": sum(v.numel() for v in adapters.values()),
        "quantized_params": sum(v.numel() for v in quantized.values()),
        "adapter_bytes": sum(v.numel() * v.element_size() for v in adapters.values()),
        "dense_base_bytes": dense_base_bytes,
        "param_bytes": rank0["param_bytes"],
        "grad_bytes": rank0["grad_bytes"],
        "optimizer_state_bytes": rank0["optimizer_state_bytes"],
        "max_rank_state_bytes": max(held),
        "peak_rss_mb": rank0["peak_rss_mb"],
        "imports_rss_mb": imports_rss,
        "tokens_per_s": summary["tokens_per_s"],
        "losses": summary["losses"],
        **share,
    }


def _share(run: Run) -> dict[str, Any]:
    """The adapters' share of a forward + backward on a fresh copy of the model (one process,
    one batch of the run's shape): ``lightning_3d.bench.adapter_share``."""
    import torch

    from lightning_3d.bench.adapter_share import adapter_share
    from lightning_3d.models.hf import HFCausalLM

    torch.manual_seed(run.seed)
    module = HFCausalLM(config=run.model["hf"], adapter=run.model["adapter"])
    size = (run.data["batch_size"], run.data["block_size"])
    batch = torch.randint(0, run.model["hf"]["vocab_size"], size)
    return adapter_share(module, batch, steps=max(1, run.steps - 1))


def formula(
    method: str, r: dict[str, Any], data: int = 1, zero_stage: int = 0
) -> tuple[str, float]:
    """The model-state bytes one rank should hold at fp32 (see the module docstring): weights W,
    gradients G and Adam's moments O, each divided over the ``data`` ranks from the ZeRO stage
    that shards it (O from 1, G from 2, W at 3)."""
    psi, phi, psi_q = r["base_params"], r["adapter_params"], r["quantized_params"]
    if method == "full":
        name, weights, trained = "16Ψ", 4 * psi, psi
    elif method == "lora":
        name, weights, trained = "4Ψ + 16Φ", 4 * (psi + phi), phi
    else:
        name = "0.516Ψq + 4(Ψ−Ψq) + 16Φ"
        weights, trained = NF4_BYTES_PER_VALUE * psi_q + 4 * (psi - psi_q + phi), phi
    if data > 1 and zero_stage:
        name = f"({name}) / {data}" if zero_stage == 3 else f"{name}, {zero_stage} of 3 / {data}"
    shard = [data if data > 1 and zero_stage >= stage else 1 for stage in (3, 2, 1)]
    return name, weights / shard[0] + 4 * trained / shard[1] + 8 * trained / shard[2]


def rows(
    results: dict[str, dict[str, Any]], data: int = 1, zero_stage: int = 0
) -> list[dict[str, Any]]:
    """Each method's record with its formula (per rank), base bytes and ratios."""
    out = []
    for method, r in results.items():
        name, expected = formula(method, r, data, zero_stage)
        state = r["param_bytes"] + r["grad_bytes"] + r["optimizer_state_bytes"]
        sharded = data if data > 1 and zero_stage == 3 else 1  # rank 0 holds 1/data of each
        base_bytes = r["param_bytes"] - r["adapter_bytes"] / sharded
        nf4_bytes = base_bytes - r["dense_base_bytes"] / sharded if r["quantized_params"] else None
        out.append(
            {
                "method": method,
                **r,
                "model_state_bytes": state,
                "formula": name,
                "formula_bytes": expected,
                "measured_vs_formula": state / expected,
                "max_rank_vs_formula": r["max_rank_state_bytes"] / expected,
                "base_bytes": base_bytes,
                "base_vs_bf16": base_bytes * sharded / (2 * r["base_params"]),
                "nf4_bytes": nf4_bytes,
                "nf4_vs_bf16": None
                if nf4_bytes is None
                else nf4_bytes * sharded / (2 * r["quantized_params"]),
            }
        )
    return out


def table(records: list[dict[str, Any]]) -> str:
    def mb(b: float) -> str:
        return f"{b / 2**20:.1f}"

    lines = [
        "| method | Ψ | Φ | Ψq (NF4) | params MB | grads MB | optim MB | model state MB | formula "
        "| formula MB | measured / formula | worst rank / formula | base MB | base vs bf16 "
        "| NF4 vs bf16 | peak RSS MB | over imports MB | tokens/s | adapters' share |",
        "|" + "---|" * 19,
    ]
    for r in records:
        nf4 = "-" if r["nf4_vs_bf16"] is None else f"{r['nf4_vs_bf16']:.3f}×"
        share = f"{r['adapters_share']:.1%}" if "adapters_share" in r else "-"
        lines.append(
            f"| {r['method']} | {r['base_params']:,} | {r['adapter_params']:,} | "
            f"{r['quantized_params']:,} | {mb(r['param_bytes'])} | {mb(r['grad_bytes'])} | "
            f"{mb(r['optimizer_state_bytes'])} | {mb(r['model_state_bytes'])} | {r['formula']} | "
            f"{mb(r['formula_bytes'])} | {r['measured_vs_formula']:.3f} | "
            f"{r['max_rank_vs_formula']:.3f} | {mb(r['base_bytes'])} | "
            f"{r['base_vs_bf16']:.3f}× | {nf4} | {r['peak_rss_mb']:.0f} | "
            f"{r['peak_rss_mb'] - r['imports_rss_mb']:.0f} | {r['tokens_per_s']:.0f} | {share} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="width, a multiple of 128")
    parser.add_argument("--layers", type=int, default=8, help="blocks")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (at least 256: bytes)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps after the first")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--r", type=int, default=8, help="LoRA rank (lora_alpha = 2r)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--data", type=int, default=1, help="data-parallel ranks (processes)")
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per worker")
    parser.add_argument(
        "--out", default=str(DEFAULT_OUT), help=f"directory (default {DEFAULT_OUT})"
    )
    args = parser.parse_args(argv)
    sizes = {
        k: getattr(args, k) for k in ("layers", "steps", "batch", "seq", "r", "threads", "data")
    }
    if args.hidden < 128 or args.hidden % 128 or args.vocab < 256 or min(sizes.values()) < 1:
        parser.error(
            f"need --hidden a multiple of 128, --vocab >= 256 and positive sizes, got "
            f"--hidden {args.hidden}, --vocab {args.vocab}, "
            + ", ".join(f"--{k} {v}" for k, v in sizes.items())
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    start = time.perf_counter()
    # A spawned worker inherits this environment: freed large tensors go back to the OS.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    results = {}
    for method in args.methods:
        run = method_run(method, args)
        results[method] = run_world(
            measure_method, args.data, run, args.threads, start_method="spawn"
        )[0]
        print(f"  {method}: {results[method]['tokens_per_s']:.0f} tokens/s", flush=True)
    records = rows(results, args.data, args.zero_stage)
    config = llama_config(args.hidden, args.layers, args.vocab, args.seq)
    layout = (
        f"ThreeDStrategy(data={args.data}, zero_stage={args.zero_stage}) on {args.data} CPU "
        "processes (gloo), bytes per rank"
        if args.data > 1
        else "ThreeDStrategy() on one CPU device"
    )
    heading = (
        f"Llama {args.layers} x {args.hidden} (MLP {config['intermediate_size']}), vocab "
        f"{args.vocab}, Ψ = {records[0]['base_params']:,}; AdamW, 32-true, {layout}, "
        f"{args.threads} thread(s) a process; {args.batch} x {args.seq} tokens a step, median of "
        f"{args.steps} timed steps; LoRA/QLoRA r={args.r}, all-linear"
    )
    text = heading + "\n\n" + table(records)
    print("\n" + text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapters.md").write_text(text + "\n")
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    (out / "adapters.json").write_text(
        json.dumps(
            {"benchmark": "adapters", "settings": settings, "model": config, "rows": records},
            indent=2,
        )
    )
    print(f"\n(total {time.perf_counter() - start:.0f} s; written to {out})")


if __name__ == "__main__":
    main()
