"""Export a consolidated Lightning checkpoint as one plain safetensors file of full weights.

The tensors are named as the plain ``nn.Module`` the ``LightningModule`` wraps: the attribute
prefix (``"model."`` for :class:`~lightning_3d.models.LitGPT`) is stripped, so the file loads
with nothing but torch and safetensors::

    from safetensors.torch import load_file
    gpt.load_state_dict(load_file("gpt.safetensors"), strict=True)

Command line: ``python -m lightning_3d.checkpoint consolidate last.ckpt gpt.safetensors``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from lightning_3d.checkpoint.checks import (
    WEIGHTS,
    PathLike,
    load_lightning_checkpoint,
    shared_prefix,
)
from lightning_3d.checkpoint.files import atomic_write, refuse_overlap


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_safetensors` wrote."""

    path: Path
    num_tensors: int
    num_params: int
    num_bytes: int  # size of the file written
    prefix: str  # the prefix stripped from every name ("" when none)


@contextmanager
def output_errors_named(output: Path) -> Iterator[None]:
    """An I/O error of the block as an ``OSError`` naming ``output`` (not the temporary file it
    was written to): safetensors' ``SafetensorError`` says ``No space left on device (os error
    28)`` in its message only."""
    try:
        yield
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(output)) from err
    except Exception as err:  # noqa: BLE001 -- SafetensorError has no errno of its own
        found = re.search(r"\(os error (\d+)\)", str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(output)) from err


def _strip(names: list[str], prefix: str | None) -> str:
    """The prefix to strip: ``prefix`` if given (every name must carry it), else the shared one."""
    if prefix is None:
        return shared_prefix(names)
    lacking = [n for n in names if not n.startswith(prefix)]
    if lacking:
        shown = ", ".join(lacking[:10]) + (
            f", ... and {len(lacking) - 10} more" if len(lacking) > 10 else ""
        )
        raise ValueError(
            f"--prefix {prefix!r} is not on every name: {len(lacking)} of {len(names)} lack it ({shown}); "
            f"the names share {shared_prefix(names)!r}"
        )
    return prefix


def _plain_tensors(state: dict[str, Tensor], strip: str) -> dict[str, Tensor]:
    """Contiguous CPU tensors under stripped names; tensors sharing memory are copied apart
    (safetensors stores each tensor once and refuses aliases)."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        plain = tensor.detach().to("cpu").contiguous()
        storage = plain.untyped_storage().data_ptr()
        if plain.numel() and storage in seen:
            plain = plain.clone()
        seen.add(storage)
        out[name[len(strip) :]] = plain
    return out


def export_safetensors(
    checkpoint: PathLike, output: PathLike, prefix: str | None = None, force: bool = False
) -> ExportResult:
    """Write the model weights of a Lightning checkpoint to ``output`` (safetensors), atomically.

    Args:
        checkpoint: a consolidated Lightning ``.ckpt`` file (what ``ThreeDStrategy`` writes).
        output: the ``.safetensors`` file to write (temp file, fsync, rename: never half-written).
        prefix: the ``LightningModule`` attribute prefix to strip from every name; ``None``
            strips the first dotted component when all names share it (``"model."``), ``""``
            keeps the names as they are.
        force: overwrite an existing ``output``.

    Raises ``FileExistsError`` (``output`` exists, no ``force``), ``FileNotFoundError`` and
    ``ValueError`` (``output`` is or is inside the checkpoint, even with ``force``; a weight
    whose checksum differs; see :mod:`lightning_3d.checkpoint.checks`) before anything is written.

    Example::

        >>> export_safetensors("last.ckpt", "gpt.safetensors").num_tensors  # doctest: +SKIP
        31
    """
    output = Path(output)
    if not Path(checkpoint).exists():
        raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
    refuse_overlap(Path(checkpoint), output)
    if output.is_dir():
        raise ValueError(
            f"output {output} is a directory; give a file name such as {output / 'model.safetensors'}"
        )
    if output.exists() and not force:
        raise FileExistsError(
            f"output {output} already exists; pass --force (force=True) to overwrite it"
        )
    # The weights' checksums.
    state = load_lightning_checkpoint(checkpoint, mmap=True, verify=WEIGHTS)
    strip = _strip(list(state["state_dict"]), prefix)
    tensors = _plain_tensors(state["state_dict"], strip)
    if "" in tensors:
        raise ValueError(
            f"prefix {strip!r} is a whole name in {checkpoint}; nothing would be left of it"
        )
    metadata = {
        "format": "pt",
        "source": Path(checkpoint).name,
        "stripped_prefix": strip,
        "global_step": str(state.get("global_step", "")),
    }

    from safetensors.torch import save_file

    with output_errors_named(output):
        atomic_write(output, lambda temp: save_file(tensors, str(temp), metadata=metadata))
    return ExportResult(
        path=output,
        num_tensors=len(tensors),
        num_params=sum(t.numel() for t in tensors.values()),
        num_bytes=output.stat().st_size,
        prefix=strip,
    )
