"""Checkpoints: consolidated (layout-free) model and optimizer state, atomic files, checks,
safetensors and Hugging Face exports, and loading pretrained weights.

The modules form layers, each importing only those below it:

- ``files`` (atomic writes, weights-only reads), ``integrity`` (checksums recorded at save,
  verified at every read), ``pieces`` (DCP boxes of flat slices), ``view`` (the per-parameter
  state view: one-process names, fused q/k/v rows, full <-> local);
- ``sharded_files`` (a sharded directory on disk);
- ``checks`` (what a checkpoint holds), ``consolidated`` and ``sharded`` (the two writers,
  both over ``view``);
- ``io`` (Lightning's checkpoint IO plugin), ``export``, ``hf_export``, ``pretrained``,
  ``resume`` (run-directory checkpoint names and what ``resume=`` resolves to).

The strategy's save and load hooks live above this package, in
``lightning_3d.strategy.checkpoint_hooks``.
"""

from lightning_3d.checkpoint.checks import check_against, inspect_checkpoint
from lightning_3d.checkpoint.consolidated import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)
from lightning_3d.checkpoint.io import AtomicCheckpointIO

# The exports and the pretrained-weights reader, which a training run does not use, load on
# first use (``from lightning_3d.checkpoint import export_hf`` works as before), so that
# ``import lightning_3d`` stays within its module budget (tests/test_architecture.py).
_LAZY = {
    "export_safetensors": "lightning_3d.checkpoint.export",
    "export_hf": "lightning_3d.checkpoint.hf_export",
    "load_pretrained": "lightning_3d.checkpoint.pretrained",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = [
    "AtomicCheckpointIO",
    "check_against",
    "export_hf",
    "export_safetensors",
    "full_model_state",
    "full_optimizer_state",
    "inspect_checkpoint",
    "load_full_model_state",
    "load_full_optimizer_state",
    "load_pretrained",
]
