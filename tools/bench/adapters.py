"""Full fine-tune, LoRA and QLoRA of one Llama-style model: model-state bytes against the
formula, peak RSS and tokens/s, one process per method.

    python -m tools.bench.adapters [--hidden 512 --layers 8 --vocab 8192] [--steps 4] \\
        [--batch 4 --seq 128] [--r 8] [--data 2 --zero-stage 3] [--out DIR]

The model is ``HFCausalLM(config=...)`` of a ``transformers`` Llama config built here (no
download): ``--hidden`` wide (64-wide heads, as many key/value heads as query heads), MLP width
8/3 of it rounded up to a multiple of 256, ``--layers`` blocks, ``--vocab`` tokens, untied head;
the defaults are 35.6 M parameters. Each method trains ``1 + --steps`` AdamW steps through
``ThreeDStrategy()`` on one CPU device (``--data N --zero-stage S``: N gloo processes) at
``32-true`` (the project's reference run, :func:`tools.harness.runs.fit_gpt`) in a
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
  copy of the model after training (``tools.bench.adapter_share``, one process).

Shape and device (the GPU targets, ``tools.bench.adapter_targets``): ``--heads``,
``--kv-heads`` and ``--mlp`` set the block (Llama-3-8B's: ``--hidden 4096 --mlp 14336 --heads 32
--kv-heads 8 --vocab 128256``); ``--precision`` (``32-true``, ``bf16-mixed``, ``bf16-true``) and
``--ac`` (``full`` / ``selective``: the strategy's ``ac_policy``) are the Trainer's and the
strategy's; ``--methods ... qlora-bnb`` adds QLoRA with ``quantization="bitsandbytes"`` (a method
whose package is not importable is skipped and named). ``--accelerator gpu`` (one CUDA device)
adds each row's device peaks at the end of training (``max_memory_allocated`` / ``_reserved``)
and skips the adapters' share (a CPU timing). ``--build-on device`` constructs the model under
``torch.device`` of the accelerator (init and NF4 quantization there; the build's peak is
reported apart and the peaks reset before training); the default ``host`` builds it on the CPU,
as ``HFCausalLM(config=..., adapter="qlora")`` does for users, which quantizes on the CPU
(about 0.3 µs a value here, one thread: 37 min for 8B's 7.0 B projection values). The table ends
with the two targets' verdicts: met, missed or not measured (and why).

Writes OUT/adapters.md (the table and verdicts) and OUT/adapters.json (every figure, the settings
and the verdicts); default OUT is ``bench_out/adapters``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

from lightning_3d.adapters.qlora import NF4_BYTES_PER_VALUE
from tools.bench import adapter_targets
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

METHODS = ("full", "lora", "qlora", "qlora-bnb")
# What each method imports beyond the project (a method whose package is missing is skipped).
NEEDS = {"full": (), "lora": ("peft",), "qlora": ("peft", "torchao")}
NEEDS["qlora-bnb"] = ("peft", "bitsandbytes")
DEFAULT_OUT = Path("bench_out") / "adapters"


def llama_config(
    hidden: int,
    layers: int,
    vocab: int,
    seq: int,
    heads: Optional[int] = None,
    kv_heads: Optional[int] = None,
    mlp: Optional[int] = None,
) -> dict[str, Any]:
    """A Llama config for ``HFCausalLM(config=...)``. By default 64-wide heads, as many key/value
    heads as query heads and an MLP width of 8/3 the width rounded up to a multiple of 256: with
    the width a multiple of 128 every projection holds a multiple of 64 x 256 values (what
    torchao's NF4 needs)."""
    from transformers import LlamaConfig

    heads = hidden // 64 if heads is None else heads
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=256 * math.ceil(8 * hidden / 3 / 256) if mlp is None else mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads if kv_heads is None else kv_heads,
        max_position_embeddings=max(seq, 128),
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    return config.to_dict()


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    return llama_config(
        args.hidden, args.layers, args.vocab, args.seq, args.heads, args.kv_heads, args.mlp
    )


def method_run(method: str, args: argparse.Namespace) -> Run:
    adapter = None
    if method != "full":
        adapter = {"method": method.split("-")[0], "r": args.r, "lora_alpha": 2 * args.r}
        if method == "qlora-bnb":
            adapter["quantization"] = "bitsandbytes"
    strategy = {"data": args.data, "zero_stage": args.zero_stage}  # ThreeDStrategy
    if args.ac != "none":
        strategy["ac_policy"] = args.ac
    if args.loss_chunks != "1":
        strategy["loss_chunks"] = "auto" if args.loss_chunks == "auto" else int(args.loss_chunks)
    on_device = {"cpu": "cpu", "gpu": "cuda"}[args.accelerator]
    return Run(
        strategy=strategy,
        devices=args.data,
        accelerator=args.accelerator,
        trainer={"precision": args.precision},
        # "device": construct (init, quantize) on the device; "host": on the CPU, as users do
        build_device=on_device if args.build_on == "device" else None,
        steps=1 + args.steps,
        seed=1234,
        arch="hf",
        model={
            "hf": model_config(args),
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
    adapter = run.model["adapter"] or {}
    qlora = adapter.get("method") == "qlora"
    if qlora:
        __import__(adapter.get("quantization", "torchao"))
    imports_rss = peak_rss_mb()
    result = fit_gpt(rank, run)
    summary, state = result["summary"], result["state"]
    if rank:  # rank 0 holds the full state and every rank's bytes (the run summary's)
        return {}
    adapters = {k: v for k, v in state.items() if is_adapter_name(k)}
    base = {k: v for k, v in state.items() if k not in adapters}
    # QLoRA stores each adapted projection's weight in NF4 (the state holds it dequantized)
    quantized = {k: v for k, v in base.items() if qlora and k.endswith(".base_layer.weight")}

    # bitsandbytes packs two 4-bit codes a byte in a flat uint8 parameter: two values a byte.
    def values(name: str, tensor: Any) -> int:
        packed = name in quantized and tensor.dtype == torch.uint8
        return tensor.numel() * (2 if packed else 1)

    # Every other tensor is plain: its bytes are its dtype's (fp32 here).
    dense_base_bytes = sum(
        v.numel() * v.element_size() for k, v in base.items() if k not in quantized
    )
    share = {}
    # after training (its peak RSS is already taken); on the CPU, where the bench's model is small
    if rank == 0 and adapter and run.accelerator == "cpu":
        share = _share(run)
    ranks = summary["ranks"]
    held = [r["param_bytes"] + r["grad_bytes"] + r["optimizer_state_bytes"] for r in ranks]
    rank0 = ranks[0]
    return {
        "base_params": sum(values(k, v) for k, v in base.items()),
        "adapter_params": sum(v.numel() for v in adapters.values()),
        "quantized_params": sum(values(k, v) for k, v in quantized.items()),
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
        # on a CUDA device: the peaks at the end of training, and the build's (--build-on device)
        **{k: rank0[k] for k in ("device_peak_mb", "device_reserved_mb") if k in rank0},
        "build_device_peak_mb": result["build_device_peak_mb"],
        **share,
    }


def _share(run: Run) -> dict[str, Any]:
    """The adapters' share of a forward + backward on a fresh copy of the model (one process,
    one batch of the run's shape): ``tools.bench.adapter_share``."""
    import torch

    from lightning_3d.models.hf import HFCausalLM
    from tools.bench.adapter_share import adapter_share

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
    elif method == "qlora":
        name = "0.516Ψq + 4(Ψ−Ψq) + 16Φ"
        weights, trained = NF4_BYTES_PER_VALUE * psi_q + 4 * (psi - psi_q + phi), phi
    else:  # bitsandbytes: the codes are the parameter, their scales sit beside it (not counted)
        name = "0.5Ψq + 4(Ψ−Ψq) + 16Φ"
        weights, trained = 0.5 * psi_q + 4 * (psi - psi_q + phi), phi
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
    device = any("device_peak_mb" in r for r in records)  # a GPU run: two more columns
    if device:
        lines[0] += " device peak MB | device reserved MB |"
        lines[1] += "---|---|"
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
        if device:
            lines[-1] += f" {r['device_peak_mb']:.0f} | {r['device_reserved_mb']:.0f} |"
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
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS[:3]))
    parser.add_argument("--data", type=int, default=1, help="data-parallel ranks (processes)")
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per worker")
    parser.add_argument(
        "--out", default=str(DEFAULT_OUT), help=f"directory (default {DEFAULT_OUT})"
    )
    add_device_options(parser)
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
    problem = device_problem(args)
    if problem:
        parser.error(problem)
    return args


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """The block's shape beyond the width, the precision, checkpointing and the device."""
    parser.add_argument("--heads", type=int, help="query heads (default: 64-wide heads)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    parser.add_argument("--mlp", type=int, help="MLP width (default: 8/3 --hidden, to 256)")
    parser.add_argument(
        "--precision", default="32-true", choices=("32-true", "bf16-mixed", "bf16-true")
    )
    parser.add_argument("--ac", default="none", choices=("none", "full", "selective"))
    parser.add_argument(
        "--loss-chunks",
        default="1",
        help="the head and loss in this many chunks, or auto (vocabulary / width); 1: whole logits",
    )
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument(
        "--build-on",
        default="host",
        choices=("host", "device"),
        help="construct the model on the CPU (users' way) or on the device (fast quantization)",
    )


def device_problem(args: argparse.Namespace) -> str:
    """One line naming the values when the shape or device options cannot work, else ''."""
    heads = args.hidden // 64 if args.heads is None else args.heads
    kv_heads = heads if args.kv_heads is None else args.kv_heads
    if heads < 1 or args.hidden % heads or kv_heads < 1 or heads % kv_heads:
        return (
            f"need --heads dividing --hidden and --kv-heads dividing --heads, got --hidden "
            f"{args.hidden}, --heads {heads}, --kv-heads {kv_heads}"
        )
    if args.loss_chunks != "auto" and not (args.loss_chunks.isdigit() and int(args.loss_chunks)):
        return (
            f"need --loss-chunks a positive integer or auto, got --loss-chunks {args.loss_chunks}"
        )
    if args.mlp is not None and (args.mlp < 128 or args.mlp % 128):
        return f"need --mlp a multiple of 128 (NF4 blocks), got --mlp {args.mlp}"
    if args.accelerator == "gpu" and (args.data != 1 or not _cuda_available()):
        return (
            f"--accelerator gpu needs one CUDA device and --data 1, got --data {args.data}, "
            f"CUDA available: {_cuda_available()}"
        )
    return ""


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def missing(method: str) -> str:
    """Why ``method`` cannot run here ('' when it can): a package it needs is not importable."""
    import importlib.util

    absent = [name for name in NEEDS[method] if importlib.util.find_spec(name) is None]
    return f"{', '.join(absent)} not importable" if absent else ""


def heading(args: argparse.Namespace, config: dict[str, Any], records: list[dict]) -> str:
    where = "one CUDA device" if args.accelerator == "gpu" else "one CPU device"
    layout = (
        f"ThreeDStrategy(data={args.data}, zero_stage={args.zero_stage}) on {args.data} CPU "
        "processes (gloo), bytes per rank"
        if args.data > 1
        else f"ThreeDStrategy() on {where}"
    )
    if args.ac != "none":
        layout += f", activation checkpointing {args.ac}"
    if args.loss_chunks != "1":
        layout += f", loss in chunks ({args.loss_chunks})"
    shape = ""
    if config["num_key_value_heads"] != config["num_attention_heads"] or args.heads is not None:
        shape = f", {config['num_attention_heads']}/{config['num_key_value_heads']} heads (q/kv)"
    built = ", built on the device" if args.build_on == "device" else ""
    return (
        f"Llama {args.layers} x {args.hidden} (MLP {config['intermediate_size']}{shape}), vocab "
        f"{args.vocab}, Ψ = {records[0]['base_params']:,}; AdamW, {args.precision}, {layout}"
        f"{built}, {args.threads} thread(s) a process; {args.batch} x {args.seq} tokens a step, "
        f"median of {args.steps} timed steps; LoRA/QLoRA r={args.r}, all-linear"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    start = time.perf_counter()
    # A spawned worker inherits this environment: freed large tensors go back to the OS.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    results, skipped = {}, {}
    for method in args.methods:
        if missing(method):
            skipped[method] = missing(method)
            print(f"  {method}: skipped ({skipped[method]})", flush=True)
            continue
        run = method_run(method, args)
        results[method] = run_world(
            measure_method, args.data, run, args.threads, start_method="spawn"
        )[0]
        r = results[method]
        device = (
            f", device peak {r['device_peak_mb']:.0f} MB (reserved {r['device_reserved_mb']:.0f})"
            if "device_peak_mb" in r
            else ""
        )
        took = time.perf_counter() - start
        print(f"  {method}: {r['tokens_per_s']:.0f} tokens/s{device} ({took:.0f} s)", flush=True)
        write(args, results, skipped)  # after each method: a later one may time out
    text = write(args, results, skipped)
    print("\n" + text)
    print(f"\n(total {time.perf_counter() - start:.0f} s; written to {args.out})")


def write(args: argparse.Namespace, results: dict[str, Any], skipped: dict[str, str]) -> str:
    """OUT/adapters.md and OUT/adapters.json of the methods measured so far; returns the table."""
    records = rows(results, args.data, args.zero_stage)
    config = model_config(args)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings.update(heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"])
    settings.update(mlp=config["intermediate_size"], skipped=skipped)
    verdicts = adapter_targets.verdicts(records, settings)
    text = heading(args, config, records) + "\n\n" + table(records) if records else "no rows"
    text += "\n\nTargets:\n\n" + "\n".join(f"- {line}" for line in verdicts)
    if skipped:
        text += "\n\nSkipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapters.md").write_text(text + "\n")
    record = {"benchmark": "adapters", "settings": settings, "model": config, "rows": records}
    record["targets"] = verdicts
    (out / "adapters.json").write_text(json.dumps(record, indent=2))
    return text


if __name__ == "__main__":
    main()
