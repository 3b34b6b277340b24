"""The strategy's offload options, validated before any process exists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_3d.offload.optimizer import DEFAULT_CHUNK_BYTES, DEVICES
from lightning_3d.offload.paths import check_offload_path


@dataclass(frozen=True)
class OffloadOptions:
    """Where the optimizer state lives (the ``offload`` group of
    :class:`~lightning_3d.options.Plan`), checked by :func:`offload_options`."""

    device: str = "none"
    """One of :data:`~lightning_3d.offload.optimizer.DEVICES`: ``"none"``, ``"cpu"``, ``"nvme"``."""
    path: Optional[str] = None
    """``"nvme"``: the directory that holds the state."""
    chunk_mb: float = DEFAULT_CHUNK_BYTES / 2**20
    """``"nvme"``: the state streams through RAM in chunks of this many MiB."""
    params: bool = False
    """With ZeRO-3: sharded parameters and gradients in CPU memory too."""
    delay_update: bool = False
    """ZeRO-Offload's one-step delayed parameter update."""
    direct_io: Optional[bool] = None
    """``"nvme"``: ``O_DIRECT``; ``None``: where the file system allows it."""
    overlap: bool = True
    """Parameters on an accelerator: transfers on side streams beside the CPU step."""

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * 2**20))


def offload_options(
    device: str,
    path: Optional[str],
    chunk_mb: Any,
    params: Any = False,
    zero_stage: int = 0,
    delay_update: Any = False,
    direct_io: Any = None,
    overlap: Any = True,
) -> dict[str, Any]:
    """``{"device", "path", "chunk_bytes", "params", "delay_update", "direct_io", "overlap"}``;
    ``ValueError`` naming a bad value.

    ``params=True`` (parameters offloaded to CPU memory as well) needs ``zero_stage=3``, whose
    FSDP2 shards are what moves, and an offload device.

    For ``"nvme"`` the directory is checked now (exists, is a directory, is writable); its free
    space is checked against the state's size when the optimizer is wrapped, before training.

    ``delay_update=True`` (ZeRO-Offload's one-step delayed parameter update, see
    ``OffloadedAdam.step``) needs an offload device; it changes the numerics.

    ``direct_io`` (``"nvme"`` only): ``None`` opens the state file with ``O_DIRECT`` where the file
    system allows, ``True`` requires it, ``False`` uses the page cache (see ``FileChunkStore``)."""
    if device not in ("none", *DEVICES):
        raise ValueError(f"offload={device!r}: use one of {['none', *DEVICES]}")
    if isinstance(chunk_mb, bool) or not isinstance(chunk_mb, (int, float)) or not chunk_mb > 0:
        raise ValueError(f"offload_chunk_mb={chunk_mb!r} must be a positive number of MiB")
    if not isinstance(params, bool):
        raise ValueError(f"offload_params={params!r} must be True or False")
    if params and (device == "none" or zero_stage != 3):
        raise ValueError(
            f"offload_params=True needs zero_stage=3 and offload='cpu' or 'nvme', "
            f"got zero_stage={zero_stage!r} and offload={device!r}"
        )
    if not isinstance(delay_update, bool):
        raise ValueError(f"offload_delay_update={delay_update!r} must be True or False")
    if not isinstance(overlap, bool):
        raise ValueError(f"offload_overlap={overlap!r} must be True or False")
    if delay_update and device == "none":
        raise ValueError(
            "offload_delay_update=True needs offload='cpu' or 'nvme', got offload='none'"
        )
    if direct_io is not None and not isinstance(direct_io, bool):
        raise ValueError(
            f"offload_direct_io={direct_io!r} must be True, False or None (where the file system allows)"
        )
    if direct_io is not None and device != "nvme":
        raise ValueError(
            f"offload_direct_io={direct_io!r} applies to offload='nvme' only, got offload={device!r}"
        )
    if device == "nvme":
        if path is None:
            raise ValueError(
                "offload='nvme' needs offload_path: a directory on the drive that holds the state"
            )
        path = check_offload_path(path, 0)
    return {
        "device": device,
        "path": path,
        "chunk_bytes": max(1, int(chunk_mb * 2**20)),
        "params": params,
        "delay_update": delay_update,
        "direct_io": direct_io,
        "overlap": overlap,
    }
