"""The QLoRA tests' run: a tiny random Llama wide enough for NF4 (every adapted weight a
multiple of 64 x 256 values, and of that times 2 for FSDP2's shards), a clip always hit."""

from __future__ import annotations

from typing import Any

from tools.harness.runs import Run

WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_key_value_heads": 4}
STEPS, SEED = 3, 1234


def qlora_run(strategy: Any, adapter: dict, **changes: Any) -> Run:
    """``fit_gpt``'s run of QLoRA ``adapter`` under ``strategy`` (``None``: plain Lightning)."""
    model = {"adapter": adapter, "lr": 1e-2, "hf": WIDE}
    return Run(
        **{
            "strategy": strategy,
            "steps": STEPS,
            "seed": SEED,
            "arch": "hf_llama",
            "model": model,
            "trainer": {"gradient_clip_val": 0.05},
            **changes,
        }
    )
