"""LoRA adapters put into a model with ``peft``, and the names that tell them from the base.

:func:`apply_adapter` calls ``peft.inject_adapter_in_model``: each target ``Linear`` (or GPT-2
``Conv1D``) becomes a ``peft.tuners.lora.Linear`` holding the frozen ``base_layer`` beside the
trained ``lora_A`` / ``lora_B`` (``{name}.lora_A.default.weight``). The model stays the
``transformers`` model it was (no ``PeftModel`` wrapper), so its tensor and pipeline plans, its
checkpoint names and everything else that finds modules by name keep working; the adapted
module's own name gains ``.base_layer`` only for the base weight.
"""

from __future__ import annotations

import sys

from torch import nn

from lightning_3d.adapters.options import AdapterOptions, require_peft

ADAPTER_PARTS = ("lora_A", "lora_B")  # the submodules peft adds that hold trained weights
BASE_PART = "base_layer"  # where peft moves the adapted module's own weight and bias


def apply_adapter(model: nn.Module, options: AdapterOptions) -> list[str]:
    """Put ``options``' adapters into ``model`` in place and freeze everything else; returns the
    names of the adapted modules (none for ``method="none"``). ``ValueError`` when the targets
    name no module of ``model``."""
    if not options.enabled:
        return []
    peft = require_peft()
    deferred = getattr(model, "deferred_init", None) is not None  # on meta: weights read later
    try:
        peft.inject_adapter_in_model(options.lora_config(), model, low_cpu_mem_usage=deferred)
    except ValueError as err:
        targets = options.target_modules
        raise ValueError(
            f"adapter target_modules={targets!r} for {type(model).__name__}: "
            f"{str(err).strip().splitlines()[0]}"
        ) from None
    if deferred:
        from lightning_3d.adapters.deferred import defer_adapters

        defer_adapters(model, adapted_modules(model))
    if options.method == "qlora" and options.quantization == "bitsandbytes":
        from lightning_3d.adapters.qlora_bnb import quantize_base_bnb

        quantize_base_bnb(model, adapted_modules(model))
    elif options.method == "qlora":
        from lightning_3d.adapters.qlora import quantize_base

        quantize_base(model, adapted_modules(model))
    return adapted_modules(model)


def adapted_modules(model: nn.Module) -> list[str]:
    """Names of the modules that hold a LoRA adapter (their ``base_layer`` is the base)."""
    lora = sys.modules.get("peft.tuners.lora")  # never imported: no model holds its layers
    if lora is None:
        return []
    return [name for name, module in model.named_modules() if isinstance(module, lora.LoraLayer)]


def is_adapter_name(name: str) -> bool:
    """Whether a parameter or state-dict name is an adapter's (``...lora_A.default.weight``)."""
    return any(part in ADAPTER_PARTS for part in name.split("."))


def adapter_state(state: dict) -> dict:
    """The adapter entries of a state dict."""
    return {name: value for name, value in state.items() if is_adapter_name(name)}


def base_view(names: list[str]) -> dict[str, str]:
    """The base's tensors under the names the model had before its adapters went in
    (``q_proj.weight``) -> their names now (``q_proj.base_layer.weight``); the adapters' left
    out. A model without adapters: each name to itself."""
    return {
        ".".join(part for part in name.split(".") if part != BASE_PART): name
        for name in names
        if not is_adapter_name(name)
    }
