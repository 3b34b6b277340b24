"""Checksums of what a checkpoint holds, recorded when it is written and verified when it is read.

Neither format catches flipped bytes on its own: ``torch.load`` does not check the CRC-32 of the
zip records ``torch.save`` writes, and DCP reads a ``.distcp`` byte range without any check. So
a damaged weight would load silently, and training would go on from it.

- A consolidated ``.ckpt`` gets a ``"checksums"`` entry: the CRC-32 of every tensor's bytes
  under its dotted path in the checkpoint dict (``state_dict.model.tok_emb.weight``,
  ``optimizer_states.0.state.3.exp_avg``). Per tensor, so a mismatch names the tensor, and
  computed from the tensors in memory (no second pass over the file).
- A sharded directory records, in ``meta.pt``, the CRC-32 of every DCP storage item (a tensor, or
  one chunk of it, as a byte range of a ``.distcp`` file) after the files were written: each
  rank checksums the files it wrote, rank 0 stores them all. Per item rather than per file, so
  a mismatch names the tensor and a reader checks only the items it reads (an export reads the
  model's, not the optimizer's). ``meta.pt``'s own tensors get the consolidated kind, and it
  records the CRC-32 of DCP's ``.metadata`` (the index of the items) too.
- The records of a ``torch.save`` file that are not tensor data (the pickle: loop counters,
  hyperparameters, these records) are verified through the zip's own CRC-32 on every read
  (``files.check_records``): ``torch.load`` ignores those CRCs.

A checkpoint without checksums (written before them, or by plain Lightning) is read with one
warning. CRC-32 (``zlib``, ~2 GB/s) detects accidental damage, not deliberate tampering.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

KEY = "checksums"
ALGORITHM = "crc32"


def tensor_crc(tensor: Tensor) -> int:
    """CRC-32 of a tensor's bytes in row-major order (its dtype and shape are checked apart)."""
    if is_traceable_wrapper_subclass(tensor):
        # A quantized optimizer state (low-bit AdamW): the bytes of its codes, scales and map.
        names, _ = tensor.__tensor_flatten__()
        crc = 0
        for name in names:
            inner = getattr(tensor, name).detach().cpu().contiguous().reshape(-1)
            crc = zlib.crc32(inner.view(torch.uint8).numpy(), crc)
        return crc
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else zlib.crc32(b"")


def tensors_in(tree: Any, path: str = "") -> Iterator[tuple[str, Tensor]]:
    """``(dotted path, tensor)`` of every strided tensor inside nested dicts, lists and tuples."""
    if isinstance(tree, Tensor):
        if tree.layout == torch.strided:  # sparse tensors are rare here: not checksummed
            yield path, tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            if not (path == "" and key == KEY):
                yield from tensors_in(value, f"{path}.{key}" if path else str(key))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from tensors_in(value, f"{path}.{index}" if path else str(index))


def with_checksums(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` (a shallow copy) with the CRC-32 of each of its tensors under ``"checksums"``."""
    crcs = {path: tensor_crc(tensor) for path, tensor in tensors_in(checkpoint)}
    return {**checkpoint, KEY: {"algorithm": ALGORITHM, "tensors": crcs}}


def warn_unchecked(path: Any) -> None:
    rank_zero_warn(
        f"{path}: checkpoint has no checksums (written by plain Lightning or before lightning_3d "
        "recorded them); loading it unverified"
    )


def mismatch(
    file: Any, tensor: str, stored: int, found: int, where: str = "", edited: str = ""
) -> ValueError:
    """``edited``: how to drop the record after editing the checkpoint on purpose."""
    return ValueError(
        f"{file}: checksum mismatch in tensor {tensor}{where} (crc32 recorded 0x{stored:08x}, read 0x{found:08x}): "
        f"the checkpoint is corrupted; refusing to load it{edited}"
    )


EDITED = f" (if you changed it in Python on purpose, delete its {KEY!r} entry before saving it)"


def verify_tensors(checkpoint: dict[str, Any], path: Any, prefix: str = "") -> int:
    """Check a checkpoint dict's tensors whose dotted path starts with ``prefix`` and remove its
    ``"checksums"`` entry; returns how many were checked (-1: none recorded, after a warning)."""
    record = checkpoint.pop(KEY, None)
    if record is None:
        warn_unchecked(path)
        return -1
    return check_tensors(checkpoint, record, path, prefix)


def check_tensors(tree: Any, record: Any, path: Any, prefix: str = "") -> int:
    """Check the tensors of ``tree`` under ``prefix`` against ``record`` (a ``"checksums"``
    entry); returns how many were checked. ``ValueError`` naming ``path`` and the tensor at the
    first mismatch, or naming the tensors that have no checksum (a damaged name, or one added in
    Python). Tensors gone are not errors: a checkpoint slimmed of its optimizer state has nothing
    to misread."""
    if not isinstance(record, Mapping) or record.get("algorithm") != ALGORITHM:
        raise ValueError(
            f"{path}: unknown checksum record {str(record)[:100]!r} (expected {ALGORITHM})"
        )
    found = dict(tensors_in(tree))
    unrecorded = sorted(
        name for name in found if name.startswith(prefix) and name not in record["tensors"]
    )
    if unrecorded:
        raise ValueError(
            f"{path}: tensors without a checksum: {unrecorded[:10]}: the checkpoint is corrupted; "
            f"refusing to load it{EDITED}"
        )
    checked = 0
    for name, crc in record["tensors"].items():
        if not name.startswith(prefix) or name not in found:
            continue
        actual = tensor_crc(found[name])
        if actual != crc:
            raise mismatch(path, name, crc, actual, edited=EDITED)
        checked += 1
    return checked


# ------------------------------------------------------------------------------ sharded items
def storage_items(metadata: Any) -> dict[tuple[str, tuple[int, ...]], tuple[str, int, int]]:
    """``(tensor, chunk offsets) -> (file, byte offset, length)`` of every DCP storage item."""
    return {
        (index.fqn, tuple(index.offset or ())): (info.relative_path, info.offset, info.length)
        for index, info in (metadata.storage_data or {}).items()
    }


def file_crc(file: Path) -> int:
    """CRC-32 of a whole (small) file: a sharded checkpoint's DCP ``.metadata``."""
    return zlib.crc32(file.read_bytes())


def _crc_range(file: Path, offset: int, length: int) -> int:
    with open(file, "rb") as f:
        f.seek(offset)
        return zlib.crc32(f.read(length))


def item_checksums(directory: Path, metadata: Any, rank: int, world: int) -> list[tuple]:
    """Records ``(tensor, chunk offsets, file, byte offset, length, crc32)`` of the storage items
    in this rank's share of the data files: the one it wrote (``__<rank>_*``, still in its page
    cache), and every ``world``-th of any others."""
    items = storage_items(metadata)
    files = sorted({file for file, _, _ in items.values()})
    others = [file for file in files if not re.match(r"__\d+_", file)]
    mine = {file for file in files if file.startswith(f"__{rank}_")} | set(others[rank::world])
    return [
        (fqn, chunk, file, offset, length, _crc_range(directory / file, offset, length))
        for (fqn, chunk), (file, offset, length) in sorted(items.items(), key=lambda kv: kv[1])
        if file in mine
    ]


def verify_items(
    directory: Path,
    metadata: Any,
    records: Sequence[tuple],
    prefix: str = "",
    rank: int = 0,
    world: int = 1,
) -> list[str]:
    """Problems found in this rank's share (every ``world``-th record) of the items under
    ``prefix``: a byte range whose CRC-32 differs, or ``.metadata`` placing an item elsewhere than
    when it was checksummed. Each names the file and the tensor."""
    items = storage_items(metadata)
    problems = []
    wanted = [r for r in records if r[0].startswith(prefix)]
    for fqn, chunk, file, offset, length, crc in wanted[rank::world]:
        where = f" (chunk at {list(chunk)})" if any(chunk) else ""
        if items.get((fqn, tuple(chunk))) != (file, offset, length):
            problems.append(
                f"{directory / '.metadata'}: tensor {fqn}{where} is not where it was written "
                f"({file} bytes {offset}+{length}): the checkpoint is corrupted"
            )
            continue
        found = _crc_range(directory / file, offset, length)
        if found != crc:
            problems.append(str(mismatch(directory / file, fqn, crc, found, where)))
    unrecorded = sorted(
        {fqn for fqn, _ in items if fqn.startswith(prefix)} - {r[0] for r in wanted}
    )
    if unrecorded and rank == 0:
        problems.append(
            f"{directory}: tensors without a checksum: {unrecorded[:10]}: the checkpoint is corrupted"
        )
    return problems
