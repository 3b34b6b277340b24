"""Checkpoints: consolidated (layout-free) model and optimizer state, atomic files, checks,
safetensors and Hugging Face exports, and loading pretrained weights."""

from lightning_3d.checkpoint.checks import check_against, inspect_checkpoint
from lightning_3d.checkpoint.consolidated import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)
from lightning_3d.checkpoint.export import export_safetensors
from lightning_3d.checkpoint.hf_export import export_hf
from lightning_3d.checkpoint.io import AtomicCheckpointIO
from lightning_3d.checkpoint.pretrained import load_pretrained

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
