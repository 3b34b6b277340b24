"""Model FLOPs per token and the accelerator's peak: what model FLOP utilisation (MFU) is made of.

MFU = (training FLOPs the model needs per token × tokens per second per device) / the device's
peak dense FLOP/s at the precision of the run. It counts the model's FLOPs only, never what the
run spends beyond them (activation-checkpointing recomputation, pipeline bubbles, redundant
work of tensor-parallel peers), so it compares layouts on one scale; a layout that recomputes
shows a lower MFU, not a higher one.

FLOPs per token, for training (forward + backward), as in PaLM (Chowdhery et al. 2022, app. B)
and Megatron-LM: ``6·N + 12·L·d·T`` with

- ``N`` the model's parameters, each counted once (a tied embedding/head once; under tensor or
  pipeline parallelism the whole model's count, not one rank's). ``6·N``: every weight takes
  part in one multiply-add (2 FLOPs) per token forward, twice that backward. Embedding lookups
  and norms are counted too, as in the published figures (about 1 % of ``N`` at the README's
  GPT); a module that wants them out supplies its own count (below);
- ``L`` transformer blocks of attention width ``d`` (query heads × head size) and ``T`` the
  sequence length: the ``Q·Kᵀ`` and ``scores·V`` products, ``2·2·T·d`` FLOPs per token per layer
  forward, three times that with backward. Counted over the full ``T × T`` square, causal or
  not, as PaLM and Megatron do.

A module computes its own count by defining ``flops_per_token(seq_len: int) -> float`` (training
FLOPs per token at that sequence length, forward and backward); :func:`model_flops_per_token`
then calls it instead of the formula, e.g. for a mixture of experts, where only the active
experts' parameters count.

Peaks come from :data:`PEAK_TFLOPS`, published dense (no sparsity) tensor-core figures per
device name and dtype; any other device, and every CPU, has no known peak unless one is given
(``RunSummary(peak_tflops=...)``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

# (pattern searched in torch.cuda.get_device_name(), name, {dtype: dense TFLOP/s}); the first
# match wins, so more specific names come first. Figures: vendor datasheets, dense (half of the
# "with sparsity" figure where only that is printed); bf16/fp16 with fp32 accumulation.
# fp16 is bf16's figure on every listed device except the V100, which has no bf16 units.
PEAK_TFLOPS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"\bGH200\b", "GH200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"\bH200\b.*\bNVL\b", "H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH200\b", "H200 SXM", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"\bH100\b.*\bNVL\b", "H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (
        r"\bH100\b.*\bPCIe\b",
        "H100 PCIe",
        {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    ),
    (r"\bH100\b", "H100 SXM", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"\bA100\b", "A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bL40S\b", "L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL40\b", "L40", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", "L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", "A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bRTX 4090\b", "RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"\bRTX 3090\b", "RTX 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    (r"\bV100\b", "V100", {"fp16": 125.0, "fp32": 15.7}),
    (r"\bMI300X\b", "MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
)

# Transformer shape keys, in the spellings of this project's GPTConfig and of transformers' configs.
_LAYER_KEYS = ("n_layer", "num_hidden_layers", "num_layers")
_WIDTH_KEYS = ("n_embd", "hidden_size", "d_model")
_HEAD_KEYS = ("n_head", "num_attention_heads")


def check_peak_tflops(value: Any) -> Optional[float]:
    """``value`` as a peak in TFLOP/s: ``None`` (look the device up) or a positive finite number."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"peak_tflops must be a positive number of TFLOP/s per device (or None), got {value!r}"
        )
    return float(value)


def precision_dtype(precision: str) -> Optional[str]:
    """The matmul dtype a Lightning precision runs at: ``bf16``, ``fp16``, ``tf32``, ``fp32``, or
    ``None`` (fp64, transformer-engine fp8, ...: no entry in the table). ``32-true`` matmuls run
    as tf32 when ``torch.set_float32_matmul_precision`` allows it ("high" or "medium")."""
    text = str(precision)
    if text.startswith("bf16"):
        return "bf16"
    if text.startswith("16"):
        return "fp16"
    if text.startswith("32"):
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return None


@dataclass(frozen=True)
class Peak:
    """A device's peak dense TFLOP/s at the run's dtype, or ``None`` with ``source`` saying why."""

    tflops: Optional[float]
    source: str  # "override", "table: H200 SXM bf16 dense", or why no peak is known


def device_peak(device: torch.device, precision: str, override: Optional[float] = None) -> Peak:
    """The peak MFU is measured against: ``override`` if given, else :data:`PEAK_TFLOPS`'s row
    for the CUDA device's name at ``precision``'s dtype."""
    override = check_peak_tflops(override)
    if override is not None:
        return Peak(override, "override")
    if device.type != "cuda":
        return Peak(None, f"no peak known for a {device.type} device; pass peak_tflops to get MFU")
    return named_device_peak(torch.cuda.get_device_name(device), precision)


def named_device_peak(name: str, precision: str) -> Peak:
    """:data:`PEAK_TFLOPS`'s figure for the device called ``name`` (``torch.cuda.get_device_name``)
    at ``precision``'s dtype, or ``Peak(None, why)``."""
    dtype = precision_dtype(precision)
    for pattern, label, figures in PEAK_TFLOPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            if dtype not in figures:
                return Peak(
                    None, f"no {dtype or precision} peak for {label} in the table; pass peak_tflops"
                )
            return Peak(figures[dtype], f"table: {label} {dtype} dense")
    return Peak(None, f"device {name!r} is not in the peak table; pass peak_tflops to get MFU")


def _int_of(config: Any, keys: tuple[str, ...]) -> Optional[int]:
    """The first of ``keys`` that ``config`` holds as an int. A transformers config whose layers
    differ (Gemma-4's per-layer head_dim) refuses a global read of a per-layer key: ``None``."""
    for key in keys:
        try:
            value = getattr(config, key, None)
        except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _attention_width(config: Any) -> Optional[int]:
    """heads × head_dim where the config has both (Qwen3: not the hidden size), else the width."""
    heads, head_dim = _int_of(config, _HEAD_KEYS), _int_of(config, ("head_dim",))
    return (
        heads * head_dim
        if heads is not None and head_dim is not None
        else _int_of(config, _WIDTH_KEYS)
    )


def transformer_shape(module: nn.Module) -> Optional[tuple[int, int]]:
    """``(layers, attention width)`` from the config of ``module`` or of its ``model``
    (``GPTConfig`` or a transformers config; where the layers differ, the mean of theirs);
    ``None`` where neither has one."""
    for owner in (module, getattr(module, "model", None)):
        config = getattr(owner, "config", None)
        if config is None:
            continue
        layers, width = _int_of(config, _LAYER_KEYS), _attention_width(config)
        per_layer = getattr(config, "per_layer_config", None)
        if per_layer is not None:
            widths = [_attention_width(layer) for layer in per_layer]
            if widths and None not in widths:
                layers, width = len(widths), round(sum(widths) / len(widths))
        if layers is not None and width is not None:
            return layers, width
    return None


def model_flops_per_token(module: nn.Module, num_params: int) -> tuple[Callable[[int], float], str]:
    """``(seq_len -> training FLOPs per token, the formula's name)`` for ``module`` of
    ``num_params`` parameters (counted once, whole model): the module's own
    ``flops_per_token`` where it has one, else ``6·N + 12·L·d·T``, else (no transformer config
    found) ``6·N``.

    Example::

        per_token, formula = model_flops_per_token(LitGPT(n_layer=12, n_embd=768), num_params=86_133_504)
        per_token(1024)  # 6 * 86_133_504 + 12 * 12 * 768 * 1024 = 630_047_232
    """
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be a non-negative int, got {num_params!r}")
    own = getattr(module, "flops_per_token", None)
    if callable(own):
        return (
            lambda seq_len: _checked(own(seq_len), seq_len)
        ), f"{type(module).__name__}.flops_per_token"
    shape = transformer_shape(module)
    if shape is None:
        return (
            lambda seq_len: 6.0 * num_params
        ), "6N (no transformer config found: attention left out)"
    layers, width = shape
    return (
        lambda seq_len: transformer_flops_per_token(num_params, layers, width, seq_len)
    ), "6N + 12*L*d*T"


def transformer_flops_per_token(num_params: int, layers: int, width: int, seq_len: int) -> float:
    """``6·N + 12·L·d·T``: training FLOPs per token of a transformer (see the module's docstring)."""
    return 6.0 * num_params + 12.0 * layers * width * seq_len


def _checked(value: Any, seq_len: int) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"flops_per_token({seq_len}) must return a positive finite number, got {value!r}"
        )
    return float(value)
