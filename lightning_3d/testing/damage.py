"""Damage done to checkpoints on purpose, for the integrity tests: the bytes are found in the
files themselves (never through the checksum records the tests check), and each kind of damage
is the smallest that changes a value.
"""

from __future__ import annotations

import shutil
import struct
import zipfile
from pathlib import Path

import torch


def copy_checkpoint(source: Path, target: Path) -> Path:
    """A copy of a checkpoint file or sharded directory at ``target``."""
    (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
    return target


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.distcp")) if path.is_dir() else [path]


def flip_in_tensor(path: Path, tensor: torch.Tensor, one_bit: bool = False) -> Path:
    """Damage ``tensor``'s data where it is stored inside ``path`` (a file, or the data files of a
    sharded directory): invert 4 bytes in its middle, or (``one_bit``) flip the lowest mantissa
    bit of its middle element, a change of one unit in the last place. Returns the file changed."""
    needle = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    for file in _files(path):
        data = bytearray(file.read_bytes())
        at = data.find(needle)
        if at < 0:
            continue
        size = tensor.element_size()
        middle = at + (len(needle) // 2) // size * size
        if one_bit:
            data[middle] ^= 0x01  # little-endian: the element's first byte holds its lowest bits
        else:
            data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
        file.write_bytes(bytes(data))
        return file
    raise AssertionError(f"the bytes of the tensor were not found in {path}")


def pickle_span(file: Path) -> tuple[int, int]:
    """``(offset, length)`` in ``file`` (a ``torch.save`` zip) of its pickle record's bytes."""
    with zipfile.ZipFile(file) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    raw = file.read_bytes()
    name_len, extra_len = struct.unpack(
        "<HH", raw[info.header_offset + 26 : info.header_offset + 30]
    )
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


def bump_pickled_int(file: Path, key: str) -> int:
    """Add 1 to the small integer stored under ``key`` in ``file``'s pickle (``global_step``):
    damage that still unpickles, into another value. Returns the value now stored."""
    start, length = pickle_span(file)
    data = bytearray(file.read_bytes())
    at = data.find(key.encode(), start, start + length)
    opcode = data.find(b"K", at, at + len(key) + 4)  # BININT1 after the key (and its memo opcode)
    assert at >= 0 and opcode >= 0, f"no small integer under {key!r} in {file}'s pickle"
    data[opcode + 1] += 1
    file.write_bytes(bytes(data))
    return data[opcode + 1]


def flip_byte(file: Path, offset: int) -> Path:
    """Invert one byte of ``file`` at ``offset`` (negative: from the end)."""
    data = bytearray(file.read_bytes())
    data[offset] ^= 0xFF
    file.write_bytes(bytes(data))
    return file
