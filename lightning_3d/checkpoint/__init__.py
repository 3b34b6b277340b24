"""Checkpoints: consolidated (layout-free) model and optimizer state."""

from lightning_3d.checkpoint.consolidated import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)

__all__ = ["full_model_state", "full_optimizer_state", "load_full_model_state", "load_full_optimizer_state"]
