"""What an adapted model's checkpoint holds, and the check on loading one.

Saved (``HFCausalLM.on_save_checkpoint``): the adapters' tensors under the module's own names,
their optimizer state (the optimizer only ever held them), and the :class:`AdapterOptions` as a
dict under ``"adapter"``. The base is not saved: it is the model's own weights (its directory,
or its seeded random init), rebuilt the same way on resume.

What a resume or an export reads before anything runs: :func:`saved_adapter` (the options a
checkpoint records) and :func:`adapter_mismatch` (a base-vs-adapter mismatch with the run's
options, said as such instead of as the base's names missing from the checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from lightning_3d.adapters.lora import is_adapter_name
from lightning_3d.adapters.options import AdapterOptions

ADAPTER_KEY = "adapter"
EXPORT_COMMAND = "python -m lightning_3d.adapters"  # the adapter checkpoints' exporter
_OVERRIDE_DEFAULTS = AdapterOptions()  # conf/adapter/*.yaml's values: overrides name the others


def saved_adapter(entries: Mapping[str, Any]) -> Optional[AdapterOptions]:
    """The adapter options a checkpoint's entries record under ``"adapter"`` (a ``.ckpt``'s
    dict, a sharded checkpoint's ``meta.pt``); ``None`` for a whole model's checkpoint.
    ``ValueError`` for a record that is not options."""
    saved = entries.get(ADAPTER_KEY)
    if saved is None:
        return None
    try:
        return AdapterOptions.parse(saved)
    except (TypeError, ValueError) as err:
        raise ValueError(f"its {ADAPTER_KEY!r} entry is not adapter options: {err}") from None


def _targets(options: AdapterOptions) -> str:
    targets = options.target_modules
    return targets if isinstance(targets, str) else "[" + ",".join(targets) + "]"


def describe(options: AdapterOptions) -> str:
    """``method lora, r=8, targets all-linear`` (QLoRA's backend named when not torchao)."""
    backend = (
        f", quantization {options.quantization}"
        if options.method == "qlora" and options.quantization != "torchao"
        else ""
    )
    return f"method {options.method}, r={options.r}, targets {_targets(options)}{backend}"


def overrides(options: AdapterOptions, named: tuple[str, ...] = ()) -> str:
    """The app's command-line overrides that give a run these options (``named``: options
    spelled out even at their defaults, those a run set otherwise)."""
    out = [
        f"adapter={options.method}",
        f"model.adapter.r={options.r}",
        f"model.adapter.target_modules={_targets(options)}"
        if isinstance(options.target_modules, str)
        else f"model.adapter.target_modules='{_targets(options)}'",
    ]
    for name in ("lora_alpha", "lora_dropout", "quantization"):
        value = getattr(options, name)
        if value != getattr(_OVERRIDE_DEFAULTS, name) or name in named:
            out.append(f"model.adapter.{name}={value}")
    return " ".join(out)


# What a resume must keep: a different r or targets leave the checkpoint's adapters without a
# module or a shape, a different lora_alpha or dropout trains them on under another update.
COMPARED = ("method", "r", "lora_alpha", "lora_dropout", "target_modules")


def _value(options: AdapterOptions, name: str) -> Any:
    value = getattr(options, name)
    if name == "target_modules":
        return _targets(options)
    return float(value) if name in ("lora_alpha", "lora_dropout") else value


def differences(saved: AdapterOptions, mine: AdapterOptions) -> list[str]:
    """``lora_alpha 16 in the checkpoint, 32 in this run``, one per option of
    :data:`COMPARED` that differs."""
    return [
        f"{name} {_shown(a)} in the checkpoint, {_shown(b)} in this run"
        for name in COMPARED
        if (a := _value(saved, name)) != (b := _value(mine, name))
    ]


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def adapter_mismatch(
    saved: Optional[AdapterOptions], mine: Optional[AdapterOptions]
) -> Optional[str]:
    """What is wrong with resuming a checkpoint that records adapter ``saved`` (``None``: a
    whole model's) into a model with adapter ``mine`` (``None`` or method ``none``: no adapter),
    as one sentence naming the options that differ; ``None`` when the two agree
    (:data:`COMPARED`: method, ``r``, ``lora_alpha``, ``lora_dropout`` and targets)."""
    mine = mine if mine is not None and mine.enabled else None
    if saved is None and mine is None:
        return None
    if mine is None:
        return (
            f"this is an adapter checkpoint ({describe(saved)}): it holds only the adapters and "
            f"their optimizer state, not the base; resume with {overrides(saved)} (on the same "
            f"base: model.path), or export it with {EXPORT_COMMAND} CKPT DIR [--merged]"
        )
    if saved is None:
        return (
            f"this is a full model's checkpoint (no adapter), but the run has adapter={mine.method} "
            f"({describe(mine)}): resume it without an adapter (adapter=none), or fine-tune "
            f"adapters on its weights with examples/finetune.py finetune.pretrained=CKPT "
            f"adapter={mine.method} (a whole model's checkpoint becomes the base)"
        )
    differ = differences(saved, mine)
    if differ:
        named = tuple(name for name in COMPARED if any(d.startswith(name + " ") for d in differ))
        return (
            f"the checkpoint's adapter ({describe(saved)}) is not this run's ({describe(mine)}): "
            f"{'; '.join(differ)}; resume with the checkpoint's options, "
            f"{overrides(saved, named)}"
        )
    return None


def check_adapter_checkpoint(module: Any, checkpoint: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``checkpoint`` holds this module's adapters (same options, every
    adapter tensor this rank has) and nothing of the base."""
    saved = checkpoint.get(ADAPTER_KEY)
    if saved is None:
        raise ValueError(
            f"the checkpoint holds no adapter, but the model has adapter "
            f"method={module.adapter.method!r}: load a full model's checkpoint into a model "
            "without an adapter, or its weights as the base (model path)"
        )
    options = AdapterOptions.parse(saved)
    differ = differences(options, module.adapter)
    if differ:
        raise ValueError(
            f"the checkpoint's adapter ({describe(options)}) is not the model's "
            f"({describe(module.adapter)}): {'; '.join(differ)}"
        )
    state = checkpoint.get("state_dict")
    if state is None:  # a sharded checkpoint: read in place, checked by name there
        return
    base = sorted(n for n in state if not is_adapter_name(n))
    missing = sorted(n for n in module.state_dict() if is_adapter_name(n) and n not in state)
    if base or missing:
        raise ValueError(
            f"the adapter checkpoint does not fit the model: base tensors {base[:5]} "
            f"(of {len(base)}), adapter tensors missing {missing[:5]} (of {len(missing)})"
        )
