"""This rank's part of a batch under context parallelism: pairs, and Hugging Face-style dicts.

A pair ``(inputs, targets)`` has its targets already shifted: each tensor with a sequence dim
is cut as the tokens are (:func:`~lightning_3d.parallel.context.chunks.shard_sequence`).

A dict (``input_ids``, and optionally ``labels``, ``attention_mask``, ``position_ids``: what
``data=chat`` gives and :class:`~lightning_3d.models.HFCausalLM` reads) is turned, on the whole
sequence and before the cut, into what a cut cannot break:

* ``targets``: the labels shifted by one (``targets[t] = labels[t + 1]``, the last ``-100``),
  padding (``attention_mask == 0``) unlabelled. The model shifts ``labels`` itself; after a cut
  it would pair a chunk's last token with the first token of a chunk that does not follow it.
* ``position_ids``: cut like the tokens, so each rank has its tokens' true positions (packed
  rows restart at 0 for each document).
* ``document_ids``: (B, T) over the *whole* sequence, not cut: each token's document, by
  transformers' own rule (``masking_utils.find_packed_sequence_indices``: a new document where
  a position is not the previous one plus 1), read only without an ``attention_mask``, as
  transformers reads it. The attention kernels need the documents of the keys other ranks hold;
  absent where every row is one document.
* ``attention_mask``: dropped after it has unlabelled the padding. Right padding needs no mask
  under causal attention: a real token never sees a later one, and a padding token's output
  has no target. Any other mask (left padding, holes) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

from lightning_3d.data.labels import shifted_targets
from lightning_3d.parallel.context.chunks import gather_sequence, shard_sequence

DICT_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def shard_batch(batch: Any, rank: int, size: int) -> Any:
    """This rank's part of ``batch`` (see the module docstring). A pair or other collection:
    every tensor with a sequence dim (dim 1 of each tensor of two or more dims, the same length
    as the first such tensor's) cut, the rest as it is. A dict: :func:`shard_dict_batch`."""
    if isinstance(batch, Mapping):
        return shard_dict_batch(batch, rank, size)
    lengths = []
    apply_to_collection(batch, Tensor, lambda t: lengths.append(t.shape[1]) if t.dim() > 1 else 0)
    if not lengths:
        return batch

    def shard(t: Tensor) -> Tensor:
        return shard_sequence(t, rank, size) if t.dim() > 1 and t.shape[1] == lengths[0] else t

    return apply_to_collection(batch, Tensor, shard)


def shard_dict_batch(batch: Mapping[str, Tensor], rank: int, size: int) -> dict[str, Tensor]:
    """``input_ids``, ``targets`` (shifted), ``position_ids`` (where given) of this rank's tokens
    and ``document_ids`` of the whole sequence (packed rows); ``ValueError`` for keys it does not
    know, or an ``attention_mask`` that is not right padding."""
    unknown = sorted(set(batch) - set(DICT_KEYS))
    if "input_ids" not in batch or unknown:
        raise ValueError(
            f"context parallelism splits dict batches of {list(DICT_KEYS)} (input_ids needed), "
            f"got keys {sorted(batch)}"
        )
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    positions = batch.get("position_ids")
    if mask is not None:
        check_right_padding(mask)
    whole = {"input_ids": ids, "targets": shifted_targets(batch.get("labels", ids), mask)}
    if positions is not None:
        whole["position_ids"] = positions.expand_as(ids)
    out = {key: shard_sequence(value, rank, size) for key, value in whole.items()}
    if positions is not None and mask is None:  # transformers reads packing only without a mask
        documents = document_ids(positions.expand_as(ids))
        if bool(documents[:, -1].any()):  # some row holds more than one document
            out["document_ids"] = documents
    return out


def document_ids(positions: Tensor) -> Tensor:
    """(B, T) document of each token, counting from 0 in each row: a new one wherever a
    position is not the previous one plus 1 (transformers' rule for packed rows)."""
    first = positions[:, :1] - 1  # the first token continues an imaginary one: document 0
    return (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)


def check_right_padding(mask: Tensor) -> None:
    """``ValueError`` unless each row of ``mask`` (B, T) is ones then zeros (right padding)."""
    if mask.dim() != 2:
        raise ValueError(
            f"context parallelism takes a (B, T) attention_mask of right padding, got shape "
            f"{tuple(mask.shape)}"
        )
    rows = ((mask[:, 1:] != 0) & (mask[:, :-1] == 0)).any(-1).nonzero().flatten().tolist()
    if rows:
        raise ValueError(
            f"context parallelism takes an attention_mask of right padding only (ones, then "
            f"zeros); rows {rows} mask a token before a real one (left padding or holes), "
            f"which the attention across ranks does not apply"
        )


def gather_outputs(output: Any, group: Any) -> Any:
    """The dual of :func:`shard_batch` for what a step returns (``predict``): in a tensor, or a
    dict, tuple or list of them, each tensor with a sequence dim (dim 1 of each tensor of two or
    more dims, the same length as the first such tensor's) gathered back into whole sequences
    from every rank of ``group``; the rest (one value per sample) as it is. A collective."""
    lengths: list[int] = []
    apply_to_collection(output, Tensor, lambda t: lengths.append(t.shape[1]) if t.dim() > 1 else 0)
    if not lengths:
        return output

    def gather(t: Tensor) -> Tensor:
        return gather_sequence(t, group) if t.dim() > 1 and t.shape[1] == lengths[0] else t

    return apply_to_collection(output, Tensor, gather)
