"""Checks on checkpoint files, with errors that name what is wrong — before anything is modified.

Three kinds are read, always without unpickling arbitrary objects:

- ``"lightning"``: a consolidated Lightning checkpoint (``torch.save`` of a dict with a
  ``"state_dict"`` of tensors under the ``LightningModule``'s names), read with
  ``torch.load(weights_only=True)``;
- ``"safetensors"``: a flat file of tensors (only its JSON header is read to inspect it);
- ``"sharded"``: a directory written by ``ThreeDStrategy(checkpoint_format="sharded")``
  (``sharded_files.py``), read here in one process at full size.

Example::

    info = inspect_checkpoint("last.ckpt")   # {"format": "lightning", "shapes": {...}, ...}
    check_against(shapes_of(module.state_dict()), info["shapes"])  # ValueError naming every mismatch
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Union

import torch
from torch import Tensor

from lightning_3d.checkpoint import sharded_files
from lightning_3d.checkpoint.files import ZIP_MAGIC, corrupted, load_weights_only
from lightning_3d.checkpoint.integrity import verify_tensors

PathLike = Union[str, "os.PathLike[str]"]
LIGHTNING = "lightning"
SAFETENSORS = "safetensors"
SHARDED = "sharded"
_PICKLE_MAGIC = b"\x80"  # torch.save's legacy format begins with a pickle protocol byte
_MAX_LISTED = 20  # names listed per category in a mismatch error
WEIGHTS = "state_dict."  # the model's tensors in a checkpoint dict (what exports verify)


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (
        f", ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    )


def shapes_of(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor in ``state`` (a DTensor reports its global shape)."""
    return {name: tuple(value.shape) for name, value in state.items() if isinstance(value, Tensor)}


def shared_prefix(names: Iterable[str]) -> str:
    """The first dotted component shared by every name, with its dot (``"model."``), else ``""``."""
    heads = {name.split(".", 1)[0] + "." if "." in name else "" for name in names}
    return heads.pop() if len(heads) == 1 else ""


def detect_format(path: PathLike) -> str:
    """``"lightning"`` or ``"safetensors"`` from the file's first bytes, ``"sharded"`` for a
    directory with DCP metadata.

    Raises ``FileNotFoundError`` for a missing path and ``ValueError`` for any other directory, an
    empty or truncated header, or a file of any other kind.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.is_dir():
        if (path / ".metadata").is_file():
            return SHARDED
        raise ValueError(
            f"{path} is a directory but not a checkpoint (no .metadata of a sharded checkpoint in it): pass a "
            ".ckpt file, a sharded checkpoint directory or a .safetensors file"
        )
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)
    if size == 0:
        raise ValueError(f"{path}: empty file (0 bytes): corrupted or truncated checkpoint file")
    if head.startswith(ZIP_MAGIC):
        return LIGHTNING
    if len(head) == 9 and head[8:9] == b"{":
        # safetensors: u64 little-endian header length, then the JSON header.
        (header_len,) = struct.unpack("<Q", head[:8])
        if 8 + header_len > size:
            raise ValueError(
                f"{path}: corrupted or truncated checkpoint file (safetensors header of {header_len} bytes, "
                f"file has {size} bytes)"
            )
        return SAFETENSORS
    if head.startswith(_PICKLE_MAGIC):  # after safetensors: a header length may begin with 0x80
        return LIGHTNING
    raise ValueError(
        f"{path} is neither a Lightning checkpoint (torch.save zip) nor a safetensors file "
        f"(first bytes {head[:8]!r})"
    )


def load_lightning_checkpoint(
    path: PathLike, mmap: bool = False, map_location: Any = "cpu", verify: str | None = ""
) -> dict[str, Any]:
    """The whole Lightning checkpoint dict, read weights-only, after checking its kind and shape.

    ``mmap``: tensors are read from the file on first use (zip format only); ``map_location``
    as in ``torch.load``. ``verify``: check the recorded checksums of the tensors whose dotted
    path starts with it (``""``: all, ``"state_dict."``: the model's; ``None``: none, and a
    ``.ckpt``'s ``"checksums"`` entry is left in the dict); without checksums, one warning.

    ``ValueError`` if it is safetensors, corrupted (a tensor's checksum differs, naming it), or
    lacks a ``"state_dict"`` of tensors.
    """
    path = Path(path)
    kind = detect_format(path)
    if kind == SHARDED:
        return sharded_files.read_consolidated(path, verify=verify)
    if kind != LIGHTNING:
        raise ValueError(f"{path} is a {kind} file, not a Lightning checkpoint (.ckpt)")
    checkpoint = load_weights_only(path, mmap, map_location)
    if not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get("state_dict"), Mapping):
        found = (
            sorted(map(str, checkpoint))[:_MAX_LISTED]
            if isinstance(checkpoint, Mapping)
            else type(checkpoint)
        )
        raise ValueError(
            f"{path} is a torch file but not a Lightning checkpoint: no 'state_dict' entry (found {found})"
        )
    not_tensors = sorted(
        k for k, v in checkpoint["state_dict"].items() if not isinstance(v, Tensor)
    )
    if not_tensors:
        raise ValueError(
            f"{path}: 'state_dict' entries that are not tensors: {_listed(not_tensors)}"
        )
    checkpoint = dict(checkpoint)
    if verify is not None:
        verify_tensors(checkpoint, path, verify)
    return checkpoint


def _safetensors_header(
    path: Path,
) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
            dtypes = {n: str(f.get_slice(n).get_dtype()) for n in names}
            return shapes, dtypes, dict(f.metadata() or {})
    except Exception as error:  # SafetensorError: bad header, offsets past the end of the file
        raise corrupted(path, error) from error


def read_tensors(path: PathLike, mmap: bool = False) -> tuple[str, dict[str, Tensor]]:
    """``(format, name → tensor)`` of a checkpoint: a Lightning ``state_dict`` or a safetensors file."""
    path = Path(path)
    kind = detect_format(path)
    if kind == LIGHTNING:
        return kind, dict(load_lightning_checkpoint(path, mmap=mmap, verify=WEIGHTS)["state_dict"])
    if kind == SHARDED:
        return kind, sharded_files.read_tensors(path)
    from safetensors.torch import load_file

    try:
        return kind, load_file(str(path), device="cpu")
    except Exception as error:
        raise corrupted(path, error) from error


def inspect_checkpoint(path: PathLike) -> dict[str, Any]:
    """What a checkpoint file holds, without building any model; raises on a bad file.

    Returns ``{"path", "format", "bytes", "shapes", "dtypes", "num_params", "global_step",
    "epoch", "has_optimizer_states", "metadata", "verified"}`` (step/epoch ``None`` for
    safetensors; ``verified``: how many tensors or shard items matched their recorded
    checksums, -1 when none are recorded, ``None`` for safetensors). Reads every tensor to do so.

    Example::

        >>> inspect_checkpoint("model.safetensors")["shapes"]["tok_emb.weight"]  # doctest: +SKIP
        (256, 768)
    """
    path = Path(path)
    kind = detect_format(path)
    size = (
        sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        if kind == SHARDED
        else path.stat().st_size
    )
    info: dict[str, Any] = {
        "path": str(path),
        "format": kind,
        "bytes": size,
        "global_step": None,
        "epoch": None,
        "has_optimizer_states": False,
        "metadata": {},
        "verified": None,
    }
    if kind == SAFETENSORS:
        info["shapes"], info["dtypes"], info["metadata"] = _safetensors_header(path)
    elif kind == SHARDED:
        meta, metadata = sharded_files.read_meta(path), sharded_files.read_metadata(path)
        info["verified"] = sharded_files.verify_shards(path, metadata, meta)
        entries = sharded_files.tensor_entries(metadata, sharded_files.MODEL)
        info["shapes"] = {name: tuple(md.size) for name, md in entries.items()}
        info["dtypes"] = {name: str(md.properties.dtype) for name, md in entries.items()}
        info["global_step"], info["epoch"] = meta.get("global_step"), meta.get("epoch")
        info["has_optimizer_states"] = bool(meta.get("optimizer_states"))
    else:
        checkpoint = load_lightning_checkpoint(path, mmap=True, verify=None)
        info["verified"] = verify_tensors(checkpoint, path)
        state = checkpoint["state_dict"]
        info["shapes"] = shapes_of(state)
        info["dtypes"] = {name: str(t.dtype) for name, t in state.items()}
        info["global_step"], info["epoch"] = checkpoint.get("global_step"), checkpoint.get("epoch")
        info["has_optimizer_states"] = bool(checkpoint.get("optimizer_states"))
    info["num_params"] = sum(int(torch.Size(s).numel()) for s in info["shapes"].values())
    return info


def check_against(
    module_shapes: Mapping[str, tuple[int, ...]],
    ckpt_shapes: Mapping[str, tuple[int, ...]],
    strict: bool = True,
    names: Iterable[str] | None = None,
    source: str = "checkpoint",
) -> None:
    """Raise one ``ValueError`` naming every difference between a model and a checkpoint.

    Args:
        module_shapes: name → shape of the tensors this process holds (``shapes_of(m.state_dict())``).
        ckpt_shapes: name → shape in the checkpoint (``inspect_checkpoint(p)["shapes"]``).
        strict: also refuse names missing from the checkpoint or not in the model.
        names: every name the whole model has, when this process holds only some (a pipeline
            stage); defaults to ``module_shapes``' names.
        source: how the checkpoint is named in the message (its path).
    """
    expected = set(names) if names is not None else set(module_shapes)
    problems = []
    if strict:
        missing, unexpected = (
            sorted(expected - set(ckpt_shapes)),
            sorted(set(ckpt_shapes) - expected),
        )
        if missing:
            problems.append(f"missing from the checkpoint ({len(missing)}): {_listed(missing)}")
        if unexpected:
            problems.append(
                f"unexpected in the checkpoint ({len(unexpected)}): {_listed(unexpected)}"
            )
    elif not expected & set(ckpt_shapes):
        problems.append(
            f"no names in common (model has e.g. {_listed(sorted(expected)[:3])}; "
            f"checkpoint has e.g. {_listed(sorted(ckpt_shapes)[:3])})"
        )
    mismatched = [
        f"{name}: checkpoint {tuple(ckpt_shapes[name])} vs model {tuple(shape)}"
        for name, shape in sorted(module_shapes.items())
        if name in ckpt_shapes and tuple(ckpt_shapes[name]) != tuple(shape)
    ]
    if mismatched:
        problems.append(f"shape mismatch ({len(mismatched)}): {_listed(mismatched)}")
    if problems:
        raise ValueError(f"{source} does not match the model: " + "; ".join(problems))
