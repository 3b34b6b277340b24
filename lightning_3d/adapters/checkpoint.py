"""What an adapted model's checkpoint holds, and the check on loading one.

Saved (``HFCausalLM.on_save_checkpoint``): the adapters' tensors under the module's own names,
their optimizer state (the optimizer only ever held them), and the :class:`AdapterOptions` as a
dict under ``"adapter"``. The base is not saved: it is the model's own weights (its directory,
or its seeded random init), rebuilt the same way on resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_3d.adapters.lora import is_adapter_name
from lightning_3d.adapters.options import AdapterOptions

ADAPTER_KEY = "adapter"


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
    mine = module.adapter
    if (options.method, options.r, options.target_modules) != (
        mine.method,
        mine.r,
        mine.target_modules,
    ):
        raise ValueError(
            f"the checkpoint's adapter (method={options.method!r}, r={options.r}, "
            f"target_modules={options.target_modules!r}) is not the model's (method="
            f"{mine.method!r}, r={mine.r}, target_modules={mine.target_modules!r})"
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
