"""The strategy's offload options, validated before any process exists."""

from __future__ import annotations

from typing import Any, Optional

from lightning_3d.offload.optimizer import DEVICES
from lightning_3d.offload.paths import check_offload_path


def offload_options(device: str, path: Optional[str], chunk_mb: Any) -> dict[str, Any]:
    """``{"device", "path", "chunk_bytes"}``; ``ValueError`` naming a bad value.

    For ``"nvme"`` the directory is checked now (exists, is a directory, is writable); its free
    space is checked against the state's size when the optimizer is wrapped, before training."""
    if device not in ("none", *DEVICES):
        raise ValueError(f"offload={device!r}: use one of {['none', *DEVICES]}")
    if isinstance(chunk_mb, bool) or not isinstance(chunk_mb, (int, float)) or not chunk_mb > 0:
        raise ValueError(f"offload_chunk_mb={chunk_mb!r} must be a positive number of MiB")
    if device == "nvme":
        if path is None:
            raise ValueError("offload='nvme' needs offload_path: a directory on the drive that holds the state")
        path = check_offload_path(path, 0)
    return {"device": device, "path": path, "chunk_bytes": max(1, int(chunk_mb * 2**20))}
