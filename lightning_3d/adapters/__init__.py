"""Parameter-efficient fine-tuning: LoRA (and QLoRA) adapters on a frozen base.

``HFCausalLM(adapter={"method": "lora", "r": 8})`` (Hydra: ``adapter=lora``) puts ``peft``'s
LoRA layers into the model before any parallel rewrite, so every layout sees them as ordinary
modules: only their parameters train and reach the optimizer, checkpoints hold only them (and
their optimizer state), and the export writes the directory ``peft.PeftModel.from_pretrained``
reads, or the merged model. See ``docs/adapters.md``.

- :mod:`~lightning_3d.adapters.options`: :class:`AdapterOptions`, peft's names and defaults;
- :mod:`~lightning_3d.adapters.lora`: putting the adapters in, telling them from the base;
- :mod:`~lightning_3d.adapters.export`: PEFT-format and merged exports.
"""

from lightning_3d.adapters.lora import (
    adapted_modules,
    adapter_state,
    apply_adapter,
    is_adapter_name,
)
from lightning_3d.adapters.options import METHODS, AdapterOptions

__all__ = [
    "METHODS",
    "AdapterOptions",
    "adapted_modules",
    "adapter_state",
    "apply_adapter",
    "is_adapter_name",
]
