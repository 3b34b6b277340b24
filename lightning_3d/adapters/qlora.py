"""QLoRA's base: each adapted module's frozen weight stored in NF4 (``torchao``'s ``NF4Tensor``).

NF4 keeps a weight in 4-bit codes with one scale per ``block_size`` elements (the scales
themselves quantized in blocks, "double quantization"); ``F.linear`` on an ``NF4Tensor``
dequantizes to the input's dtype for the matmul. The weight is rounded to bf16 before it is
quantized, so under ``bf16-mixed`` the base is computed in bf16 as in the QLoRA paper; the
adapters stay in the precision the module trains in. Only the adapted modules' weights are
quantized (embeddings, norms and the head stay as they are).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

BLOCK_SIZE = 64  # elements per scale (torchao's and the QLoRA paper's default)
SCALER_BLOCK_SIZE = 256  # scales per second-level scale (torchao's default)
# torchao 0.18's NF4Tensor.clone re-quantizes with the defaults: a weight must fit them.
MULTIPLE = BLOCK_SIZE * SCALER_BLOCK_SIZE
# Bytes one NF4 value costs: a 4-bit code, its share of an 8-bit scale per BLOCK_SIZE values and of
# a bf16 factor per SCALER_BLOCK_SIZE scales (0.5 + 1/64 + 1/8192 = 0.5157; the planner's figure).
NF4_BYTES_PER_VALUE = 0.5 + 1 / BLOCK_SIZE + 2 / (BLOCK_SIZE * SCALER_BLOCK_SIZE)


def require_nf4() -> Any:
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "adapter method='qlora' needs torchao: pip install 'lightning-3d[qlora]'"
        ) from err
    return NF4Tensor, to_nf4


def quantize_base(model: nn.Module, names: list[str]) -> list[str]:
    """Replace the base weight of each adapted module ``names`` of ``model`` with its NF4 form;
    returns their names. ``ValueError`` naming each base that cannot be: not an ``nn.Linear``
    (GPT-2's ``Conv1D``), or a size not a multiple of ``MULTIPLE`` (16384) elements."""
    _, to_nf4 = require_nf4()
    bases = [(name, model.get_submodule(name).get_base_layer()) for name in names]
    problems = [
        f"{name} ({type(base).__name__}, {tuple(base.weight.shape)})"
        for name, base in bases
        if type(base) is not nn.Linear or base.weight.numel() % MULTIPLE
    ]
    if problems:
        raise ValueError(
            f"adapter method='qlora' stores nn.Linear weights of a multiple of {MULTIPLE} "
            f"elements in NF4; these cannot be: {', '.join(problems[:4])}"
            + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
        )
    for _, base in bases:
        nf4 = to_nf4(base.weight.detach().to(torch.bfloat16), BLOCK_SIZE, SCALER_BLOCK_SIZE)
        base.weight = nn.Parameter(nf4, requires_grad=False)
    return [name for name, _ in bases]


def has_nf4(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is an ``NF4Tensor`` (never imports torchao)."""
    import sys

    nf4 = sys.modules.get("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    return nf4 is not None and any(isinstance(p, nf4.NF4Tensor) for p in module.parameters())


def check_qlora_plan(module: nn.Module, plan: Any, data: Any = None) -> None:
    """``ValueError`` naming the options when ``module`` holds an NF4 base and ``plan`` (a
    :class:`~lightning_3d.options.Plan`) asks for what it cannot take: :func:`refuse_qlora_plan`,
    and under ZeRO-3 over ``data`` ranks (``plan.layout.data`` when not given) an NF4 weight
    whose second-level scales do not split evenly over them (torchao shards each of its parts
    in ``data`` equal chunks: a weight must hold a multiple of ``data`` × 16384 values)."""
    from lightning_3d.adapters.qlora_bnb import has_bnb_4bit

    if has_bnb_4bit(module):
        refuse_qlora_plan(plan, "bitsandbytes")
        return
    if not has_nf4(module):
        return
    refuse_qlora_plan(plan)
    data = plan.layout.data if data is None else data
    if plan.layout.zero_stage != 3 or not isinstance(data, int) or data < 2:
        return
    uneven = [
        f"{name} ({tuple(p.shape)}: {p.numel()} values)"
        for name, p in module.named_parameters()
        if type(p).__name__ == "NF4Tensor" and p.numel() % (data * MULTIPLE)
    ]
    if uneven:
        raise ValueError(
            f"adapter method='qlora' with zero_stage=3 over data={data} ranks shards each NF4 "
            f"weight in {data} equal parts: a weight must hold a multiple of {data} x "
            f"{MULTIPLE} values; these do not: {', '.join(uneven[:4])}"
            + (f" (and {len(uneven) - 4} more)" if len(uneven) > 4 else "")
            + " (use zero_stage 1 or 2, fewer data ranks, or adapter method='lora')"
        )


def refuse_qlora_plan(plan: Any, quantization: str = "torchao") -> None:
    """``ValueError`` naming the options a QLoRA model cannot run ``plan`` with: tensor
    parallelism (an NF4 base does not split into DTensor shards), ZeRO-3 parameters offloaded to
    CPU (FSDP2's offload re-wraps each shard as a plain parameter; torchao 0.18's NF4 breaks
    there) and, with ``quantization="bitsandbytes"``, ZeRO-3 at all (its ``Params4bit`` keeps
    the scales outside the parameter FSDP2 would shard). The planner asks this of every QLoRA
    layout before the model exists."""
    layout, problems = plan.layout, []
    if layout.tensor > 1:
        problems.append(
            f"tensor={layout.tensor}: the NF4 base weights do not split into DTensor "
            "shards (use data or pipeline parallelism, or adapter method='lora')"
        )
    if layout.zero_stage == 3 and quantization == "bitsandbytes":
        problems.append(
            "zero_stage=3: bitsandbytes' 4-bit weights keep their scales beside the "
            "parameter, which FSDP2 cannot shard (ZeRO 0-2, or quantization='torchao')"
        )
    elif layout.zero_stage == 3 and plan.offload.params:
        problems.append(
            "zero_stage=3 with offload_params=True: FSDP2's CPU offload cannot move "
            "NF4 shards (offload the optimizer state only: offload_params=False)"
        )
    if problems:
        backend = "" if quantization == "torchao" else f" ({quantization})"
        raise ValueError(f"adapter method='qlora'{backend} cannot run with " + "; ".join(problems))
