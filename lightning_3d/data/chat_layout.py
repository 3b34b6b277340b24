"""Rows of rendered conversations: packed (several per row) or padded (one per row).

Both give rows of exactly ``block_size`` tokens (one shape for every batch, which pipeline
stages and compiled graphs want), as dicts in Hugging Face's convention: ``input_ids`` and
unshifted ``labels`` (``-100``: no loss), plus

* packing: ``position_ids`` restarting at 0 at each conversation. With no ``attention_mask``
  and no cache, ``transformers`` (``masking_utils.find_packed_sequence_indices``) reads a restart
  as the start of another sequence and builds a block-diagonal causal mask, for ``sdpa``,
  ``eager`` and ``flex_attention`` alike: no token attends to another conversation. The tail of
  a row is padding, its own "sequence" of positions from 0, labelled ``-100``.
* padding: ``attention_mask`` (1 on the conversation, 0 on the right padding).

Each conversation's first label is ``-100``: the model shifts labels by one, so that label
would be the target of the previous conversation's last token.

Example::

    rows = pack([Conversation("a.jsonl:1", [5, 6, 7], [-100, 6, 7])], block_size=4, pad_id=0)
    rows[0]["position_ids"]  # tensor([0, 1, 2, 0])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_3d.data.labels import IGNORE_INDEX


@dataclass
class Conversation:
    """One rendered conversation: where it was read (``FILE:LINE``), its ids and labels."""

    where: str
    ids: list[int]
    labels: list[int]

    def truncated(self, length: int) -> "Conversation":
        return Conversation(self.where, self.ids[:length], self.labels[:length])

    def trained_tokens(self) -> int:
        """Tokens with a target once the labels are shifted (the first label never is one)."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


def _row(ids: list[int], labels: list[int], **extra: list[int]) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.tensor(ids),
        "labels": torch.tensor(labels),
        **{k: torch.tensor(v) for k, v in extra.items()},
    }


def pack(
    conversations: list[Conversation], block_size: int, pad_id: int
) -> list[dict[str, torch.Tensor]]:
    """Conversations in order, each row filled until the next one does not fit (a conversation
    is never split); positions restart at 0 at each conversation and at the padding."""
    rows, ids, labels, positions = [], [], [], []

    def close() -> None:
        pad = block_size - len(ids)
        rows.append(
            _row(
                ids + [pad_id] * pad,
                labels + [IGNORE_INDEX] * pad,
                position_ids=positions + list(range(pad)),
            )
        )
        ids.clear(), labels.clear(), positions.clear()

    for conversation in conversations:
        n = len(conversation.ids)
        if n > block_size:
            raise ValueError(f"{conversation.where}: {n} tokens do not fit block_size={block_size}")
        if len(ids) + n > block_size:
            close()
        ids.extend(conversation.ids)
        labels.extend([IGNORE_INDEX, *conversation.labels[1:]])
        positions.extend(range(n))
    if ids:
        close()
    return rows


def pad_rows(
    conversations: list[Conversation], block_size: int, pad_id: int
) -> list[dict[str, torch.Tensor]]:
    """One conversation per row, right-padded to ``block_size`` (padding masked and unlabelled)."""
    rows = []
    for conversation in conversations:
        n = len(conversation.ids)
        if n > block_size:
            raise ValueError(f"{conversation.where}: {n} tokens do not fit block_size={block_size}")
        pad = block_size - n
        rows.append(
            _row(
                conversation.ids + [pad_id] * pad,
                [IGNORE_INDEX, *conversation.labels[1:]] + [IGNORE_INDEX] * pad,
                attention_mask=[1] * n + [0] * pad,
            )
        )
    return rows
