"""Exports of an adapted model: the PEFT adapter directory and the merged model directory.

Both go through ``peft`` itself, so the files are exactly peft's: a fresh ``transformers`` model
of the same config is wrapped with ``peft.get_peft_model`` (the same adapter layers, the same
names as in training), given the trained tensors, and then either saved with
``PeftModel.save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``: what
``peft.PeftModel.from_pretrained(base, DIR)`` loads) or merged (``W + lora_alpha / r * B @ A``,
``merge_and_unload``) and saved with ``save_pretrained`` (what ``from_pretrained`` loads, no peft
needed). The tensors are the one-process state of the adapted model (``ThreeDStrategy``'s
``full_state_dict()`` on every rank, or ``module.state_dict()`` in one process).

Example (one process; ``module`` an ``HFCausalLM`` with an adapter)::

    export_adapter(module, "out/adapter")            # PEFT format
    export_adapter(module, "out/merged", merged=True)  # a plain transformers model
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_3d.adapters.options import AdapterOptions, require_peft

PREFIX = "model."  # HFCausalLM's attribute that holds the transformers model


def peft_model(
    hf_config: Union[Mapping[str, Any], Any], state: Mapping[str, Tensor], options: AdapterOptions
) -> Any:
    """A CPU ``peft.PeftModel`` of ``hf_config`` holding ``state`` (names of the adapted
    ``transformers`` model, or of ``HFCausalLM``: a leading ``model.`` is dropped); ``ValueError``
    naming the tensors that do not fit."""
    import transformers

    peft = require_peft()
    config = hf_config
    if isinstance(hf_config, Mapping):
        config = transformers.AutoConfig.for_model(**dict(hf_config))
    state = _without_bnb_4bit(state)
    names = [n[len(PREFIX) :] if n.startswith(PREFIX) else n for n in state]
    dtype = _dtype(state)
    state = {n: _plain(t, dtype) for n, t in zip(names, state.values())}
    with torch.device("cpu"):
        base = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = peft.get_peft_model(
        base, options.lora_config(getattr(config, "_name_or_path", None) or None)
    )
    inner = model.base_model.model  # the transformers model, adapted as in training
    expected = set(inner.state_dict())
    buffers = {n for n, _ in inner.named_buffers()}  # non-persistent ones: the model computes them
    state = {n: t for n, t in state.items() if n in expected or n not in buffers}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"adapter export: the state does not fit {type(inner).__name__} with "
            f"{options.method} adapters: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    inner.load_state_dict(state, strict=True)
    return model.eval()


_BNB_QUANT_STATE = ".quant_state.bitsandbytes__"  # ends the last entry a Params4bit writes


def _without_bnb_4bit(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """bitsandbytes' 4-bit bases (a ``Params4bit``'s packed codes, then its quant state as the
    entries ``<weight>.absmax``, ``.quant_map``, ... its ``state_dict`` writes) dequantized into
    one plain weight each, in the dtype they were quantized from; every other entry as it is."""
    markers = [name for name in state if _BNB_QUANT_STATE in name]
    if not markers:
        return dict(state)
    from bitsandbytes.functional import QuantState, dequantize_4bit

    plain = dict(state)
    for marker in markers:
        weight = marker[: marker.index(_BNB_QUANT_STATE)]
        parts = {
            name[len(weight) + 1 :]: plain.pop(name)
            for name in list(plain)
            if name.startswith(weight + ".")
        }
        quant_state = QuantState.from_dict(parts, device=torch.device("cpu"))
        plain[weight] = dequantize_4bit(plain[weight].detach().cpu(), quant_state)
    return plain


def _is_nf4(tensor: Tensor) -> bool:
    return hasattr(tensor, "get_original_weight")  # torchao's NF4Tensor (QLoRA's base)


def _plain(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """A CPU tensor a plain ``nn.Linear`` takes: QLoRA's NF4 base dequantized (torchao's
    ``get_original_weight``, the bf16 values it was quantized from, rounded to NF4) and cast
    to the model's ``dtype``; anything else as it is."""
    tensor = tensor.detach()
    if _is_nf4(tensor):
        tensor = tensor.get_original_weight().to(dtype)
    return tensor.to("cpu")


def _dtype(state: Mapping[str, Tensor]) -> torch.dtype:
    """The model's dtype: its first floating tensor's that is not an NF4 base (stored in bf16
    whatever the model computes in)."""
    floats = [t.dtype for t in state.values() if t.is_floating_point() and not _is_nf4(t)]
    return floats[0] if floats else torch.float32


def _default_use_cache(config: Any) -> Optional[bool]:
    """``use_cache`` as the config's class has it by default (``HFCausalLM`` turns it off for
    training; generation wants it on); ``None`` where the class has none."""
    try:
        return getattr(type(config)(), "use_cache", None)
    except Exception:  # noqa: BLE001 -- a config class that needs arguments: leave it as it is
        return None


def save_peft(
    hf_config: Any,
    state: Mapping[str, Tensor],
    options: AdapterOptions,
    directory: Union[str, Path],
    merged: bool = False,
) -> Path:
    """Write ``directory``: the PEFT adapter (``merged=False``) or the merged model (QLoRA: the
    NF4 base dequantized, the adapters merged into it; ``use_cache`` as the config class's
    default, not the training setting)."""
    directory = Path(directory)
    model = peft_model(hf_config, state, options)
    if merged:
        plain = model.merge_and_unload()
        use_cache = _default_use_cache(plain.config)
        if use_cache is not None:
            plain.config.use_cache = use_cache
        plain.save_pretrained(str(directory))
    else:
        model.save_pretrained(str(directory))
    return directory


def export_adapter(
    module: Any,
    directory: Union[str, Path],
    merged: bool = False,
    state: Optional[Mapping[str, Tensor]] = None,
) -> Path:
    """:func:`save_peft` for an ``HFCausalLM`` with an adapter; ``state``: its full one-process
    state (default: ``module.state_dict()``, right in one process)."""
    options = module.adapter
    if not options.enabled:
        raise ValueError(
            f"{type(module).__name__} has adapter method={options.method!r}: nothing to "
            "export as an adapter; save the model itself"
        )
    state = module.state_dict() if state is None else state
    return save_peft(module.model.config, state, options, directory, merged)
