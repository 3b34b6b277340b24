"""Arbitrary parts of a global tensor, as ``torch.distributed.checkpoint`` (DCP) reads and writes them.

DCP understands a tensor held whole, a ``DTensor`` (one box per rank) and legacy sharded tensors.
A ZeRO 1/2 rank owns a contiguous *flat* range of a bucket, which cuts parameters at arbitrary
elements: its part of a parameter is a run of the parameter's elements in memory order, which is
not one box of the parameter's shape. :func:`flat_boxes` cuts such a run into boxes (a partial
row, whole rows, a partial row; recursively), and :class:`Pieces` hands each box to DCP under the
parameter's name and global coordinates. What is written is therefore independent of the bucket
layout, the data-parallel size and the padding: any other layout reads the boxes it needs.

Example::

    state = {"w.exp_avg": Pieces((4, 6), [((0, 3), view_a), ((1, 0), view_b)])}
    dcp.save(state, checkpoint_id=path, planner=PiecesSavePlanner())
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Boxes covering elements ``[start, stop)`` (memory order) of a contiguous tensor of ``shape``.

    Each box is itself a contiguous run of elements, listed in memory order: at most two boxes
    per dimension (a partial run at each end) plus one block of whole rows.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    shape = tuple(shape)
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_boxes(shape[1:], lo, hi)]

    if first == last:
        return in_row(first, start - first * inner, stop - first * inner)
    boxes = []
    if start % inner:
        boxes += in_row(first, start % inner, inner)
        first += 1
    whole_end = stop // inner
    if whole_end > first:
        boxes.append(((first, *(0,) * (len(shape) - 1)), (whole_end - first, *shape[1:])))
    if stop % inner:
        boxes += in_row(whole_end, 0, stop % inner)
    return boxes


def flat_index(shape: Sequence[int], offsets: Sequence[int]) -> int:
    """Memory-order position of the element at ``offsets`` in a contiguous tensor of ``shape``."""
    index = 0
    for size, offset in zip(shape, offsets):
        index = index * size + offset
    return index


class Pieces:
    """This rank's boxes of one global tensor: ``[(global offsets, local view), ...]``.

    Views may be empty (a rank that holds none of it writes nothing and reads nothing). Loading
    copies into the views, so they must alias the storage that should receive the values.
    """

    def __init__(self, shape: Sequence[int], parts: list[tuple[Sequence[int], Tensor]]) -> None:
        self.shape = torch.Size(shape)
        self.parts = [(torch.Size(offsets), view) for offsets, view in parts]
        for offsets, view in self.parts:
            if len(offsets) != len(self.shape) or any(
                o < 0 or o + s > n for o, s, n in zip(offsets, view.shape, self.shape)
            ):
                raise ValueError(
                    f"box at {tuple(offsets)} of size {tuple(view.shape)} is outside {tuple(self.shape)}"
                )

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.shape),
                    properties=TensorProperties.create_from_tensor(view),
                    size=self.shape,
                ),
            )
            for offsets, view in self.parts
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=offsets, sizes=view.shape) for offsets, view in self.parts
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        for offsets, view in self.parts:
            if offsets == index.offset:
                return view
        raise ValueError(f"{index.fqn}: no box at {index.offset}")


def _lookup(state_dict: dict[str, Any], index: MetadataIndex) -> Any:
    obj = state_dict.get(index.fqn)
    return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else None


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, also resolving :class:`Pieces` (takes a flat state dict)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)


class PiecesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, also resolving :class:`Pieces`; refuses pickled entries."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        # The default set-up rebuilds every value it does not know as None: keep ours aside.
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(
            {k: v for k, v in state_dict.items() if k not in pieces}, metadata, is_coordinator
        )
        self.state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        # DCP would torch.load (unrestricted unpickling) these; the callers only ask for tensors.
        raise ValueError(f"{read_item.dest_index.fqn}: refusing to unpickle a non-tensor entry")
