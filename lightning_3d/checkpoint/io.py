"""``AtomicCheckpointIO``: Lightning's checkpoint IO plugin, with atomic saves and checked loads.

A save goes through :func:`~lightning_3d.checkpoint.files.atomic_write` (a temporary sibling
file, fsynced, renamed onto the final name), so a killed save never leaves a half-written file
under the final name; loads go through :func:`~lightning_3d.checkpoint.checks.load_lightning_checkpoint`
(weights only, with errors that name the file). Every save records the CRC-32 of each tensor
(``integrity.py``) and every load verifies them, refusing a damaged file naming the tensor.

Example::

    trainer = L.Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    # or ThreeDStrategy(checkpoint_io=AtomicCheckpointIO())
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from lightning_3d.checkpoint.checks import load_lightning_checkpoint
from lightning_3d.checkpoint.files import atomic_write
from lightning_3d.checkpoint.integrity import with_checksums
from lightning_3d.runtime.failures import naming_path


def _is_local(path: _PATH) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` checkpoints written atomically; loads are weights-only and checked.

    Lightning's ``TorchCheckpointIO`` (the class ``lightning.pytorch.plugins.io`` re-exports from
    ``lightning.fabric``), so it is accepted as ``Trainer(plugins=[AtomicCheckpointIO()])`` or as a
    strategy's ``checkpoint_io``. Remote (fsspec URL) paths fall back to Lightning's own save.

    Loading refuses arbitrary pickled objects (``torch.load(weights_only=True)``) and raises a
    ``ValueError`` naming the file when it is missing, a directory, not a Lightning checkpoint,
    or corrupted/truncated, or when a tensor's bytes differ from the CRC-32 recorded at save.
    """

    def write(self, checkpoint: dict[str, Any], file: BinaryIO) -> None:
        """Serialize ``checkpoint`` into an open binary file (a hook: tests slow it down)."""
        torch.save(checkpoint, file)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint does not take storage_options, got {storage_options!r}"
            )
        checkpoint = with_checksums(checkpoint)  # per tensor: verified on every load
        if not _is_local(path):
            super().save_checkpoint(checkpoint, path)
            return
        target = Path(str(path).removeprefix("file://"))

        def write(temp: Path) -> None:
            with open(temp, "wb") as f:
                self.write(checkpoint, f)

        with naming_path(target):  # a write that fails at close names no file
            atomic_write(target, write)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError(
                f"{type(self).__name__} loads weights only (no arbitrary unpickling); got weights_only=False "
                f"for {path}. Use Lightning's TorchCheckpointIO for a trusted checkpoint that needs it."
            )
        if not _is_local(path):
            return super().load_checkpoint(path, weights_only=True)
        local = Path(str(path).removeprefix("file://"))
        return load_lightning_checkpoint(
            local, map_location=map_location if map_location is not None else "cpu"
        )
