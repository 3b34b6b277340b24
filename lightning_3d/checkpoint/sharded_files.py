"""A sharded checkpoint directory on disk: its layout, and saving / reading it with DCP.

A sharded checkpoint is a directory (named like a checkpoint file, e.g. ``last.ckpt/``):

- DCP's ``.metadata`` and ``__<rank>_0.distcp`` files with the tensors, each stored under a name
  that does not depend on the layout and at its global shape: ``state_dict.<parameter>`` (the
  ``LightningModule``'s own names) and ``optimizer_states.<i>.<parameter>.<key>`` (``exp_avg``,
  ``step``, ...);
- ``meta.pt``: everything else Lightning puts in a checkpoint (loops, callbacks, LR schedulers,
  scaler, hyperparameters) and the optimizers' param groups with parameter *names*, written by
  rank 0 and read weights-only; and the CRC-32 of every DCP storage item (``integrity.py``),
  which every read verifies first.

This module knows the files, not the model: what each rank puts in (and reads back from) the
tensors is ``sharded.py``'s business. Kept apart so that the checks and exports, which read
these directories in one process, need nothing of the writers. A save goes to a temporary
directory first and is swapped in atomically (:func:`~lightning_3d.checkpoint.files.publish`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_3d.checkpoint.files import (
    fsync_dir,
    load_weights_only,
    publish,
    remove,
    remove_stale_temps,
    temp_path_for,
)
from lightning_3d.checkpoint.integrity import (
    KEY,
    check_tensors,
    file_crc,
    item_checksums,
    verify_items,
    warn_unchecked,
    with_checksums,
)
from lightning_3d.checkpoint.pieces import PiecesLoadPlanner, PiecesSavePlanner
from lightning_3d.compat import dcp_saved_metadata

FORMAT = "lightning_3d.sharded/1"
META_FILE = "meta.pt"
MODEL = "state_dict."


def optimizer_prefix(index: int) -> str:
    return f"optimizer_states.{index}."


def is_sharded_checkpoint(path: Any) -> bool:
    """A directory with DCP metadata (a sharded checkpoint, complete or not)."""
    path = Path(str(path))
    return path.is_dir() and (path / ".metadata").is_file()


# ------------------------------------------------------------------------------ save
def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint dict built from ``sharded.model_state`` / ``sharded.optimizer_state`` → (DCP
    tensors, the rest for ``meta.pt``)."""
    tensors = {MODEL + name: value for name, value in checkpoint["state_dict"].items()}
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    meta["format"] = FORMAT
    if "optimizer_states" in checkpoint:
        meta["optimizer_states"] = []
        for index, state in enumerate(checkpoint["optimizer_states"]):
            tensors.update(
                {optimizer_prefix(index) + fqn: v for fqn, v in state["tensors"].items()}
            )
            meta["optimizer_states"].append({k: v for k, v in state.items() if k != "tensors"})
    return tensors, meta


def save(tensors: Mapping[str, Any], meta: Mapping[str, Any], path: Any) -> None:
    """Write a sharded checkpoint at ``path`` (a collective: every rank calls it). ``tensors`` are
    this rank's; ``meta`` is written by rank 0. The directory appears complete or not at all."""
    path = Path(str(path).removeprefix("file://"))
    rank0 = dist.get_rank() == 0
    temp = [temp_path_for(path)]
    dist.broadcast_object_list(temp, src=0)  # rank 0's name: one directory for all ranks
    temp = Path(temp[0])
    if rank0:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path.parent)
    dist.barrier()
    try:
        metadata = dcp_saved_metadata(
            dcp.save(
                dict(tensors),
                planner=PiecesSavePlanner(),
                storage_writer=FileSystemWriter(temp, single_file_per_rank=True, sync_files=True),
            ),
            temp,
        )
        # Each rank checksums its share of the files just written (from the page cache).
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(
            parts, item_checksums(temp, metadata, dist.get_rank(), dist.get_world_size())
        )
        if rank0:
            record = with_checksums(meta)
            record[KEY]["items"] = sorted(item for part in parts for item in part)
            record[KEY]["metadata"] = file_crc(temp / ".metadata")
            with open(temp / META_FILE, "wb") as f:
                torch.save(record, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(temp)
            publish(temp, path)
    except BaseException:
        if rank0:
            remove(temp)
        raise
    finally:
        dist.barrier()


# ------------------------------------------------------------------------------ load
def read_metadata(path: Any) -> Metadata:
    """DCP's metadata, after checking that every file it names is there and long enough."""
    path = Path(str(path))
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:
        raise ValueError(
            f"{path / '.metadata'}: corrupted sharded checkpoint metadata "
            f"({type(error).__name__}: {error})"
        ) from error
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise ValueError(f"{path}: sharded checkpoint is missing its file {name}")
        if file.stat().st_size < size:
            raise ValueError(
                f"{file}: corrupted or truncated shard ({file.stat().st_size} bytes, the metadata needs {size})"
            )
    return metadata


def read_meta(path: Any) -> dict[str, Any]:
    """``meta.pt`` of a sharded checkpoint, read weights-only."""
    file = Path(str(path)) / META_FILE
    if not file.is_file():
        raise ValueError(f"{path}: incomplete sharded checkpoint (no {META_FILE})")
    meta = load_weights_only(file, mmap=False)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(
            f"{file}: not a lightning_3d sharded checkpoint (format {getattr(meta, 'get', dict)('format')!r})"
        )
    if KEY in meta:
        # Its own tensors (RNG states, ...); the shards: verify().
        check_tensors(meta, meta[KEY], file)
    return meta


def verify_shards(
    path: Any,
    metadata: Metadata,
    meta: Mapping[str, Any],
    prefix: str = "",
    distributed: bool = False,
) -> int:
    """Check the CRC-32 of every storage item under ``prefix`` against ``meta.pt``'s record;
    returns how many were checked (-1: none recorded, after a warning). ``distributed``: a
    collective, each rank reading its share, every rank raising the same error. ``ValueError``
    naming the file and the tensor."""
    record = meta.get(KEY)
    if not isinstance(record, Mapping) or "items" not in record:
        warn_unchecked(path)
        return -1
    if "metadata" in record and file_crc(Path(str(path)) / ".metadata") != record["metadata"]:
        raise ValueError(
            f"{Path(str(path)) / '.metadata'}: checksum mismatch (crc32 recorded "
            f"0x{record['metadata']:08x}): the checkpoint's index of its tensors is corrupted; "
            "refusing to load it"
        )
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    problems = verify_items(Path(str(path)), metadata, record["items"], prefix, rank, world)
    if distributed:
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, problems)
        problems = [problem for part in parts for problem in part]
    if problems:
        more = (
            f" (and {len(problems) - 1} more: {'; '.join(problems[1:4])})"
            if len(problems) > 1
            else ""
        )
        raise ValueError(problems[0] + more)
    return sum(1 for item in record["items"] if item[0].startswith(prefix))


def tensor_entries(metadata: Metadata, prefix: str) -> dict[str, TensorStorageMetadata]:
    return {
        fqn[len(prefix) :]: md
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


def load(targets: Mapping[str, Any], path: Any, metadata: Metadata, no_dist: bool = False) -> None:
    """Read ``targets`` (tensors, DTensors, :class:`~lightning_3d.checkpoint.pieces.Pieces`) in
    place. A collective unless ``no_dist``."""
    wrong = sorted(
        k
        for k in targets
        if not isinstance(metadata.state_dict_metadata.get(k), TensorStorageMetadata)
    )
    if wrong:
        raise ValueError(f"{path}: sharded checkpoint has no tensors for {wrong[:10]}")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to load in a single process.*"
            )
            dcp.load(
                dict(targets),
                storage_reader=FileSystemReader(Path(str(path))),
                planner=PiecesLoadPlanner(),
                no_dist=no_dist,
            )
    except Exception as error:
        raise ValueError(
            f"{path}: could not read the sharded checkpoint ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[-1][:300]})"
        ) from error


def read_tensors(path: Any, prefix: str = MODEL, verify: bool = True) -> dict[str, Tensor]:
    """Every tensor under ``prefix`` at full size, in this process alone (no process group):
    for export and inspection. Their checksums are verified first unless ``verify=False``."""
    metadata = read_metadata(path)
    if verify:
        verify_shards(path, metadata, read_meta(path), prefix)
    entries = tensor_entries(metadata, prefix)
    targets = {
        prefix + name: torch.empty(md.size, dtype=md.properties.dtype)
        for name, md in entries.items()
    }
    load(targets, path, metadata, no_dist=True)
    return {fqn[len(prefix) :]: t for fqn, t in targets.items()}


def read_consolidated(path: Any, verify: str | None = "") -> dict[str, Any]:
    """The sharded checkpoint as the consolidated format (what one process would have saved):
    full tensors, optimizer state keyed by parameter index. Read in this process alone, after
    verifying the checksums of the tensors under ``verify`` (``None``: of none)."""
    meta = read_meta(path)
    if verify is not None:
        verify_shards(path, read_metadata(path), meta, verify)
    tensors = read_tensors(path, prefix="", verify=False)
    checkpoint = {k: v for k, v in meta.items() if k not in ("format", "optimizer_states", KEY)}
    checkpoint["state_dict"] = {
        n[len(MODEL) :]: t for n, t in tensors.items() if n.startswith(MODEL)
    }
    if "optimizer_states" not in meta:
        return checkpoint
    checkpoint["optimizer_states"] = []
    for index, saved in enumerate(meta["optimizer_states"]):
        prefix = optimizer_prefix(index)
        per_name: dict[str, dict[str, Any]] = {}
        entries = [(fqn[len(prefix) :], v) for fqn, v in tensors.items() if fqn.startswith(prefix)]
        for fqn, value in [*entries, *saved.get("extras", {}).items()]:
            name, key = fqn.rsplit(".", 1)
            per_name.setdefault(name, {})[key] = value
        names = [n for group in saved["param_groups"] for n in group["params"]]
        state = {i: per_name[n] for i, n in enumerate(names) if n in per_name}
        groups, start = [], 0
        for group in saved["param_groups"]:
            groups.append({**group, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        checkpoint["optimizer_states"].append({"state": state, "param_groups": groups})
    return checkpoint
