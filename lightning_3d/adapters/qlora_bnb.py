"""QLoRA's base in bitsandbytes' 4-bit NF4 (``adapter.quantization="bitsandbytes"``).

Each adapted module's frozen ``nn.Linear`` base becomes a ``bitsandbytes.nn.Linear4bit``
(``quant_type="nf4"``, statistics double-quantized, computed in the input's dtype: bf16 under
the bf16 precisions) holding the same weight, rounded to bf16 first as torchao's path does;
peft's LoRA layer keeps calling it as its ``base_layer``. bitsandbytes runs its CUDA kernels
where the model is on a GPU and its CPU ones otherwise. Its ``Params4bit`` keeps the codes as a
flat ``uint8`` parameter and the scales in a ``quant_state`` beside it, which tensor
parallelism cannot split and FSDP2 cannot shard: those layouts are refused
(:func:`~lightning_3d.adapters.qlora.refuse_qlora_plan`), and the start broadcast of frozen
weights sends the scales with the codes (:func:`~lightning_3d.parallel.tensor.plain_parts`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

BLOCK_SIZE = 64  # values per scale (bitsandbytes' 4-bit default, as torchao's)


def require_bnb() -> Any:
    try:
        import bitsandbytes
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "adapter quantization='bitsandbytes' needs bitsandbytes: pip install bitsandbytes "
            "(or quantization='torchao')"
        ) from err
    return bitsandbytes


def quantize_base_bnb(model: nn.Module, names: list[str]) -> list[str]:
    """Replace the base of each adapted module ``names`` of ``model`` with a 4-bit NF4
    ``Linear4bit`` of the same weight; returns the names. ``ValueError`` naming each base that is
    not an ``nn.Linear`` (GPT-2's ``Conv1D``)."""
    bnb = require_bnb()
    bases = [(name, model.get_submodule(name)) for name in names]
    wrong = [
        f"{name} ({type(m.get_base_layer()).__name__})"
        for name, m in bases
        if type(m.get_base_layer()) is not nn.Linear
    ]
    if wrong:
        raise ValueError(
            "adapter quantization='bitsandbytes' stores nn.Linear weights in 4 bits; these "
            f"are not: {', '.join(wrong[:4])}"
            + (f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else "")
        )
    for _, module in bases:
        base = module.get_base_layer()
        quantized = bnb.nn.Linear4bit(
            base.in_features,
            base.out_features,
            bias=base.bias is not None,
            compute_dtype=None,  # the input's: bf16 under bf16 precisions, as torchao's path
            quant_type="nf4",
            compress_statistics=True,
            device=base.weight.device,
        )
        weight = base.weight.detach().to(torch.bfloat16)
        quantized.weight = bnb.nn.Params4bit(
            weight, requires_grad=False, quant_type="nf4", blocksize=BLOCK_SIZE
        ).to(base.weight.device)
        if base.bias is not None:
            quantized.bias = nn.Parameter(base.bias.detach().clone(), requires_grad=False)
        module.base_layer = quantized
    return [name for name, _ in bases]


def has_bnb_4bit(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is bitsandbytes' ``Params4bit`` (never imports it)."""
    modules = sys.modules.get("bitsandbytes.nn.modules")
    return modules is not None and any(
        isinstance(p, modules.Params4bit) for p in module.parameters()
    )
