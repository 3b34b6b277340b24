"""The activation bytes the planner measures per block, next to Korthikanti et al. (2022).

    python -m tools.calibration.activation_formula [--width 512] [--heads 8] [--seq 128]

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models": a GPT-3
block saves ``s·b·h·(34 + 5·a·s/h)`` bytes in 16-bit, 10 of the 34 replicated under ``t``-way
tensor parallelism and all of it divided by ``t`` with sequence parallelism. Of the 34, 2 are the
two dropout masks of the residual branches; fused attention keeps no ``a·s²`` term. So a block
without dropout and with fused attention should save 32, ``8 + 24/t`` and ``32/t`` (times
``s·b·h``). This prints, per token and in units of the width ``h`` (bytes / (s·b·h)), what the
planner's meter (the runs' own :class:`~lightning_3d.parallel.activations.ActivationMeter`)
measures on one block of the reference GPT and of a Llama-style Hugging Face block, at batch 1,
bf16, for each policy and tensor size, beside that formula. docs/planner.md explains each gap.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from lightning_3d.planner.facts import model_facts


def reference_gpt(width: int, heads: int, seq: int, dropout: float) -> nn.Module:
    from lightning_3d.models.gpt import GPT, GPTConfig

    config = GPTConfig(
        vocab_size=256, block_size=seq, n_layer=2, n_head=heads, n_embd=width, dropout=dropout
    )
    with torch.device("meta"):
        return GPT(config)


def llama(width: int, heads: int, seq: int) -> nn.Module:
    from lightning_3d.models.hf import HFCausalLM

    config = dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=width,
        intermediate_size=int(8 * width / 3) // 64 * 64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
    )
    with torch.device("meta"):
        return HFCausalLM(config=config)


def formula(tp: int, sp: bool, dropout: bool, heads: int, seq: int, width: int) -> float:
    """Korthikanti et al.'s bytes per token over ``h`` (16-bit, fused attention unless dropout
    is on: then the ``5·a·s/h`` term of the attention probabilities and their mask)."""
    base = 34.0 if dropout else 32.0
    quad = 5 * heads * seq / width if dropout else 0.0
    if sp:
        return (base + quad) / tp
    replicated = 10.0 if dropout else 8.0
    return replicated + (base - replicated) / tp + quad / tp


def rows(width: int, heads: int, seq: int) -> list[tuple[str, str, float, float]]:
    """(model, layout, measured, formula) per block, bytes per token over the width."""
    models = (
        ("reference GPT", reference_gpt(width, heads, seq, 0.0), False),
        ("reference GPT, dropout 0.1", reference_gpt(width, heads, seq, 0.1), True),
        ("Llama (transformers)", llama(width, heads, seq), False),
    )
    out = []
    for label, module, dropout in models:
        facts = model_facts(
            module,
            seq_len=seq,
            precision="bf16-mixed",
            policies=("none", "selective", "full"),
            tp_sizes=(1, 2),
            sequence_parallel=True,
        )
        for key, fit in sorted(facts.activations.items(), key=str):
            policy, tp, sp = key[0], key[1], len(key) > 2
            layout = f"{policy}, tp{tp}{' sp' if sp else ''}"
            measured = fit.bytes_per_sample(seq) / seq / width
            expected = formula(tp, sp, dropout, heads, seq, width) if policy == "none" else None
            out.append((label, layout, measured, expected))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    print(
        f"bytes saved per token / width, batch 1, bf16, h={args.width}, a={args.heads}, s={args.seq}"
    )
    print(f"{'model':28s} {'policy, layout':22s} {'measured':>9s} {'formula':>8s}")
    for label, layout, measured, expected in rows(args.width, args.heads, args.seq):
        shown = f"{expected:8.2f}" if expected is not None else f"{'':8s}"
        print(f"{label:28s} {layout:22s} {measured:9.2f} {shown}")


if __name__ == "__main__":
    main()
