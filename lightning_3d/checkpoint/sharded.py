"""Sharded checkpoints: every rank writes only what it holds, with ``torch.distributed.checkpoint``.

A sharded checkpoint is a directory (named like a checkpoint file, e.g. ``last.ckpt/``):

- DCP's ``.metadata`` and ``__<rank>_0.distcp`` files with the tensors, each stored under a name
  that does not depend on the layout and at its global shape:
  ``state_dict.<parameter>`` (the ``LightningModule``'s own names) and
  ``optimizer_states.<i>.<parameter>.<key>`` (``exp_avg``, ``step``, ...). FSDP2 shards and
  tensor-parallel ``DTensor`` s go to DCP as they are; ZeRO 1/2 flat slices as :class:`Pieces`
  (``pieces.py``); tensors replicated over ranks are written once (DCP's de-duplication spreads
  them over the ranks). Fused q/k/v projections under tensor parallelism (whose rows are
  regrouped per rank) are saved whole, in the plain model's row order.
- ``meta.pt``: everything else Lightning puts in a checkpoint (loops, callbacks, LR schedulers,
  scaler, hyperparameters) and the optimizers' param groups with parameter *names*, written by
  rank 0 and read weights-only.

Loading reads, on each rank, exactly the boxes its current layout holds — which is what makes a
checkpoint saved under one layout resume under any other (data, tensor, pipeline size, ZeRO
stage, offload). A save goes to a temporary directory first and is swapped in atomically.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_3d.checkpoint.consolidated import _fused_params, _groups, _sharded_by_engine, _to_full, _to_local_like
from lightning_3d.checkpoint.io import fsync_dir, remove_stale_temps, temp_path_for
from lightning_3d.checkpoint.pieces import Pieces, PiecesLoadPlanner, PiecesSavePlanner, flat_boxes, flat_index
from lightning_3d.parallel.tensor import local_tensor
from lightning_3d.parallel.tied import param_names
from lightning_3d.parallel.zero import ZeroDataParallel

FORMAT = "lightning_3d.sharded/1"
META_FILE = "meta.pt"
MODEL = "state_dict."


def optimizer_prefix(index: int) -> str:
    return f"optimizer_states.{index}."


def is_sharded_checkpoint(path: Any) -> bool:
    """A directory with DCP metadata (a sharded checkpoint, complete or not)."""
    path = Path(str(path))
    return path.is_dir() and (path / ".metadata").is_file()


# ------------------------------------------------------------------------------ placement
def _global_offset(param: Tensor) -> tuple[int, ...]:
    if isinstance(param, DTensor):
        return tuple(compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)[1])
    return (0,) * param.dim()


def _param_pieces(param: Tensor, flat: Tensor, start: int, stop: int, base: int) -> list:
    """Boxes of elements ``[start, stop)`` of ``param``'s local tensor, whose values sit at
    ``flat[k - base]`` for element ``k``, in the parameter's global coordinates."""
    shape = tuple(local_tensor(param).shape)
    origin = _global_offset(param)
    parts = []
    for offsets, sizes in flat_boxes(shape, start, stop):
        first = flat_index(shape, offsets) - base
        view = flat[first : first + math.prod(sizes)].view(sizes)
        parts.append((tuple(o + g for o, g in zip(offsets, origin)), view))
    return parts


def _owned_range(engine: ZeroDataParallel, bucket: Any, offset: int, param: Tensor) -> tuple[int, int, int]:
    """The part ``[a, b)`` of ``param``'s local elements in this rank's slice, and the base
    such that element ``k`` is at ``slice[k - base]``."""
    lo = engine.rank * bucket.shard_numel
    numel = local_tensor(param).numel()
    a, b = max(offset, lo), min(offset + numel, lo + bucket.shard_numel)
    return a - offset, max(a, b) - offset, lo - offset


def _fused_by_name(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Parameter name → (chunks, tp) of the fused projections tensor parallelism regrouped."""
    by_id = _fused_params(module)
    return {name: by_id[id(p)] for name, p in module.named_parameters() if id(p) in by_id}


# ------------------------------------------------------------------------------ save
def model_state(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` ready for DCP: DTensors and plain tensors as they are (no copy),
    fused tensor-parallel projections whole. A collective only when fused projections exist."""
    fused = _fused_by_name(module)
    return {
        name: _to_full(value, fused[name]) if fused.get(name) else value
        for name, value in module.state_dict().items()
    }


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, engine: Optional[ZeroDataParallel],
                    order: Optional[list[str]] = None) -> dict[str, Any]:
    """The optimizer's state for DCP, ``{"tensors": {"<param>.<key>": ...}, "param_groups": [...],
    "elementwise": [...], "extras": {...}}``. A collective (names are merged over ranks)."""
    name_of = param_names(module)  # a tied weight under its one-process name
    fused = _fused_params(module)
    tensors: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    elementwise: set[str] = set()

    def put(fqn: str, value: Any) -> None:
        if isinstance(value, Tensor):
            tensors[fqn] = value
        else:
            extras[fqn] = value

    if _sharded_by_engine(engine):
        has_fused = any(id(p) in fused for b in engine.buckets for p in b.params)
        gathered = engine.gather_param_states(optimizer) if has_fused else {}
        for bucket in engine.buckets:
            for key, value in optimizer.state.get(bucket.slice, {}).items():
                flat = isinstance(value, Tensor) and value.dim() == 1
                elementwise |= {key} if flat else set()
                for p, offset in zip(bucket.params, bucket.offsets):
                    fqn = f"{name_of[id(p)]}.{key}"
                    if id(p) in fused and flat:
                        put(fqn, _to_full(gathered[id(p)][key], fused[id(p)]))
                    elif flat:
                        start, stop, base = _owned_range(engine, bucket, offset, p)
                        tensors[fqn] = Pieces(p.shape, _param_pieces(p, local_tensor(value), start, stop, base))
                    else:
                        put(fqn, _scalar(fqn, value))
    else:
        for p in (p for group in _groups(optimizer, engine) for p in group):
            for key, value in optimizer.state.get(p, {}).items():
                whole = isinstance(value, Tensor) and value.dim() >= 1 and value.shape == p.shape
                elementwise |= {key} if whole else set()
                fqn = f"{name_of[id(p)]}.{key}"
                put(fqn, (_to_full(value, fused[id(p)]) if id(p) in fused else value) if whole else _scalar(fqn, value))
    groups = [[name_of[id(p)] for p in group] for group in _groups(optimizer, engine)]
    param_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if dist.is_available() and dist.is_initialized():
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (groups, sorted(elementwise), extras))
        position = {name: i for i, name in enumerate(order or [])}
        groups = [
            sorted({n for part in parts for n in part[0][g]}, key=lambda n: position.get(n, 0))
            for g in range(len(groups))
        ]
        elementwise = {k for part in parts for k in part[1]}
        extras = {k: v for part in parts for k, v in part[2].items()}
    for group, names in zip(param_groups, groups):
        group["params"] = names
    return {"tensors": tensors, "param_groups": param_groups, "elementwise": sorted(elementwise), "extras": extras}


def _scalar(fqn: str, value: Any) -> Any:
    # Replicated entries are written once: a per-rank tensor under one name would lose data.
    if isinstance(value, Tensor) and value.dim() > 0:
        raise ValueError(f"optimizer state {fqn!r} of shape {tuple(value.shape)} is neither per-element nor a "
                         "scalar: sharded checkpoints cannot place it (use checkpoint_format='consolidated')")
    return value


def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint dict built from :func:`model_state` / :func:`optimizer_state` → (DCP tensors,
    the rest for ``meta.pt``)."""
    tensors = {MODEL + name: value for name, value in checkpoint["state_dict"].items()}
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    meta["format"] = FORMAT
    if "optimizer_states" in checkpoint:
        meta["optimizer_states"] = []
        for index, state in enumerate(checkpoint["optimizer_states"]):
            tensors.update({optimizer_prefix(index) + fqn: v for fqn, v in state["tensors"].items()})
            meta["optimizer_states"].append({k: v for k, v in state.items() if k != "tensors"})
    return tensors, meta


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _publish(temp: Path, path: Path) -> None:
    """Put the complete directory ``temp`` at ``path``, replacing what is there atomically."""
    if not (path.exists() or path.is_symlink()):
        os.rename(temp, path)
    elif _exchange(temp, path):
        _remove(temp)  # now the previous checkpoint
    else:  # no atomic exchange: a short window in which ``path`` is absent (old one kept aside)
        old = path.with_name(f".{path.name}.old.tmp-{os.getpid()}")
        os.rename(path, old)
        os.rename(temp, path)
        _remove(old)
    fsync_dir(path.parent)


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
        dcp.save(dict(tensors), storage_writer=FileSystemWriter(temp, single_file_per_rank=True, sync_files=True),
                 planner=PiecesSavePlanner())
        if rank0:
            with open(temp / META_FILE, "wb") as f:
                torch.save(dict(meta), f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(temp)
            _publish(temp, path)
    except BaseException:
        if rank0:
            _remove(temp)
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
        raise ValueError(f"{path}: corrupted sharded checkpoint metadata ({type(error).__name__}: {error})") from error
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
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
    from lightning_3d.checkpoint.checks import _torch_load

    file = Path(str(path)) / META_FILE
    if not file.is_file():
        raise ValueError(f"{path}: incomplete sharded checkpoint (no {META_FILE})")
    meta = _torch_load(file, mmap=False)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{file}: not a lightning_3d sharded checkpoint (format {getattr(meta, 'get', dict)('format')!r})")
    return meta


def tensor_entries(metadata: Metadata, prefix: str) -> dict[str, TensorStorageMetadata]:
    return {
        fqn[len(prefix):]: md
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


def load(targets: Mapping[str, Any], path: Any, metadata: Metadata, no_dist: bool = False) -> None:
    """Read ``targets`` (tensors, DTensors, :class:`Pieces`) in place. A collective unless ``no_dist``."""
    wrong = sorted(k for k in targets if not isinstance(metadata.state_dict_metadata.get(k), TensorStorageMetadata))
    if wrong:
        raise ValueError(f"{path}: sharded checkpoint has no tensors for {wrong[:10]}")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(dict(targets), storage_reader=FileSystemReader(Path(str(path))), planner=PiecesLoadPlanner(),
                     no_dist=no_dist)
    except Exception as error:
        raise ValueError(f"{path}: could not read the sharded checkpoint ({type(error).__name__}: "
                         f"{str(error).strip().splitlines()[-1][:300]})") from error


def model_targets(module: nn.Module, names: Iterable[str]) -> tuple[dict[str, Any], list]:
    """DCP targets for ``module``'s state (its own storage, so loading is in place), and the
    fused projections to copy in afterwards."""
    fused = _fused_by_name(module)
    own = module.state_dict()
    targets, after = {}, []
    for name in names:
        value = own[name]
        if fused.get(name):
            whole = torch.zeros(value.shape, dtype=value.dtype)
            after.append((name, whole, fused[name]))
            targets[MODEL + name] = whole
        else:
            targets[MODEL + name] = value
    return targets, after


@torch.no_grad()
def finish_model(module: nn.Module, after: list) -> None:
    params = dict(module.named_parameters())
    for name, whole, fused in after:
        target = params[name]
        local_tensor(target).copy_(local_tensor(_to_local_like(whole, target, fused)))


def optimizer_targets(
    module: nn.Module, optimizer: torch.optim.Optimizer, engine: Optional[ZeroDataParallel],
    saved: Mapping[str, TensorStorageMetadata], meta: Mapping[str, Any], prefix: str,
) -> tuple[dict[str, Any], Any]:
    """DCP targets for one optimizer's state in this layout, and a function that installs them
    (call it after :func:`load`). ``saved``: the checkpoint's ``<param>.<key>`` entries."""
    _check_groups(module, optimizer, engine, meta)
    name_of = param_names(module)  # a tied weight under its one-process name
    fused = _fused_params(module)
    elementwise = set(meta["elementwise"])
    keys_of: dict[str, dict[str, TensorStorageMetadata]] = {}
    for fqn, md in saved.items():
        name, key = fqn.rsplit(".", 1)
        keys_of.setdefault(name, {})[key] = md
    for fqn, value in meta.get("extras", {}).items():
        name, key = fqn.rsplit(".", 1)
        keys_of.setdefault(name, {})[key] = value
    targets: dict[str, Any] = {}
    # (state owner, its state, fused whole-parameter states, fused parameters inside a ZeRO slice)
    installs: list[tuple[Tensor, dict[str, Any], list, list]] = []

    def scalar(fqn: str, md: Any) -> Any:
        if not isinstance(md, TensorStorageMetadata):
            return md  # a plain Python value from meta.pt
        targets[prefix + fqn] = torch.zeros(md.size, dtype=md.properties.dtype)
        return targets[prefix + fqn]

    if _sharded_by_engine(engine):
        for bucket in engine.buckets:
            names = [name_of[id(p)] for p in bucket.params]
            keys = {k: md for n in names for k, md in keys_of.get(n, {}).items()}
            if not keys:
                continue
            state, in_slice = {}, []
            for key, md in keys.items():
                if key not in elementwise:
                    first = next(n for n in names if key in keys_of.get(n, {}))
                    state[key] = scalar(f"{first}.{key}", md)
                    continue
                flat = torch.zeros(bucket.shard_numel, dtype=md.properties.dtype, device=bucket.flat.device)
                for p, offset, name in zip(bucket.params, bucket.offsets, names):
                    if key not in keys_of.get(name, {}):
                        continue
                    start, stop, base = _owned_range(engine, bucket, offset, p)
                    if id(p) in fused:
                        whole = targets[prefix + f"{name}.{key}"] = torch.zeros(p.shape, dtype=md.properties.dtype)
                        in_slice.append((whole, p, fused[id(p)], flat, start, stop, base))
                    else:
                        targets[prefix + f"{name}.{key}"] = Pieces(p.shape, _param_pieces(p, flat, start, stop, base))
                state[key] = engine.slice_dtensor(flat, bucket.params[0])
            installs.append((bucket.slice, state, [], in_slice))
    else:
        for p in (p for group in _groups(optimizer, engine) for p in group):
            name = name_of[id(p)]
            if name not in keys_of:
                continue
            state, whole_states = {}, []
            for key, md in keys_of[name].items():
                if key not in elementwise:
                    state[key] = scalar(f"{name}.{key}", md)
                elif id(p) in fused:
                    whole = targets[prefix + f"{name}.{key}"] = torch.zeros(p.shape, dtype=md.properties.dtype)
                    whole_states.append((key, whole, fused[id(p)]))
                else:
                    state[key] = targets[prefix + f"{name}.{key}"] = torch.zeros_like(p, dtype=md.properties.dtype)
            installs.append((p, state, whole_states, []))

    def install() -> None:
        for group, saved_group in zip(optimizer.param_groups, meta["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        for owner, state, whole_states, in_slice in installs:
            for key, whole, fusion in whole_states:
                state[key] = _to_local_like(whole, owner, fusion, whole.dtype)
            for whole, p, fusion, flat, start, stop, base in in_slice:
                local = local_tensor(_to_local_like(whole, p, fusion, flat.dtype)).reshape(-1)
                flat[start - base : stop - base].copy_(local[start:stop])
            optimizer.state[owner] = state

    return targets, install


def _check_groups(module: nn.Module, optimizer: torch.optim.Optimizer, engine: Optional[ZeroDataParallel],
                  meta: Mapping[str, Any]) -> None:
    name_of = param_names(module)  # a tied weight under its one-process name
    groups = [[name_of[id(p)] for p in group] for group in _groups(optimizer, engine)]
    saved = [g["params"] for g in meta["param_groups"]]
    if len(groups) != len(saved) or any(not set(mine) <= set(theirs) for mine, theirs in zip(groups, saved)):
        raise ValueError(
            f"optimizer param groups differ: the checkpoint has {len(saved)} groups of sizes "
            f"{[len(g) for g in saved]}, the model {len(groups)} (here: {[len(g) for g in groups]})"
        )


def read_tensors(path: Any, prefix: str = MODEL) -> dict[str, Tensor]:
    """Every tensor under ``prefix`` at full size, in this process alone (no process group):
    for export and inspection."""
    metadata = read_metadata(path)
    entries = tensor_entries(metadata, prefix)
    targets = {prefix + name: torch.empty(md.size, dtype=md.properties.dtype) for name, md in entries.items()}
    load(targets, path, metadata, no_dist=True)
    return {fqn[len(prefix):]: t for fqn, t in targets.items()}


def read_consolidated(path: Any) -> dict[str, Any]:
    """The sharded checkpoint as the consolidated format (what one process would have saved):
    full tensors, optimizer state keyed by parameter index. Read in this process alone."""
    meta = read_meta(path)
    tensors = read_tensors(path, prefix="")
    checkpoint = {k: v for k, v in meta.items() if k not in ("format", "optimizer_states")}
    checkpoint["state_dict"] = {n[len(MODEL):]: t for n, t in tensors.items() if n.startswith(MODEL)}
    if "optimizer_states" not in meta:
        return checkpoint
    checkpoint["optimizer_states"] = []
    for index, saved in enumerate(meta["optimizer_states"]):
        prefix = optimizer_prefix(index)
        per_name: dict[str, dict[str, Any]] = {}
        entries = [(fqn[len(prefix):], v) for fqn, v in tensors.items() if fqn.startswith(prefix)]
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
