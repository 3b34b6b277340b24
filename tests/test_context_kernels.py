"""Context-parallel attention kernels against full causal attention on one process, forward and
gradients, in gloo worlds of 2 and 4 ranks; and the load-balanced split of a sequence."""

import pytest
import torch

from lightning_3d.parallel.context.chunks import (
    local_positions,
    shard_sequence,
    unshard_sequence,
)
from tools.harness.world import run_world


def test_each_rank_holds_a_chunk_from_both_ends():
    assert local_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert local_positions(16, 3, 4).tolist() == [6, 7, 8, 9]
    x = torch.arange(24).view(1, 24)
    shards = [shard_sequence(x, r, 3) for r in range(3)]
    assert shards[0].tolist() == [[0, 1, 2, 3, 20, 21, 22, 23]]
    assert torch.equal(unshard_sequence(shards), x)
    for r in range(3):
        assert torch.equal(shards[r][0], local_positions(24, r, 3))


def test_a_sequence_not_divisible_by_twice_context_is_refused():
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2 \* context"):
        shard_sequence(torch.zeros(1, 12), 0, 4)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_kernel_matches_full_causal_attention(scheme, world):
    """Catches: a wrong causal mask between chunks (a later chunk seen, an earlier one missed),
    a merge without the log-sum-exp rescale, k/v gradients left on the rank that computed them
    instead of sent home, all-to-all slices put back in the wrong order. Only the 4-rank ring
    case catches the ring's index bugs that 2 ranks cannot tell apart (each seen failing there
    and passing at 2): the k/v block held at a step taken as the next rank's instead of the
    previous one's (``rank + step``), key chunk ids of the 2-rank split (``3 - source``)."""
    from support.context_worlds import kernel_against_full_attention

    results = run_world(kernel_against_full_attention, world, scheme, (2, 4, 8 * world, 8), 2)
    for rank, errors in enumerate(results):
        assert max(errors.values()) < 1e-5, (rank, errors)


@pytest.mark.parametrize(
    "scheme, heads, kv_heads, world",
    [
        ("alltoall", 8, 4, 2),
        ("alltoall", 8, 2, 2),
        ("alltoall", 16, 8, 4),
        ("alltoall", 8, 2, 4),
        ("ring", 8, 4, 2),
    ],
)
def test_grouped_query_heads_read_their_own_kv_heads(scheme, heads, kv_heads, world):
    """Grouped-query attention as Llama-3-8B lays it out (8 query heads to 4 k/v heads at cp 2;
    16 to 8 at cp 4: two k/v heads on a rank after the all-to-all) against full attention,
    query head ``h`` reading k/v head ``h // (H / Hkv)``, outputs and q/k/v gradients.
    Catches the k/v heads a rank holds after the exchange grouped to its query heads in the
    wrong order (``repeat`` for ``repeat_interleave``: seen failing at 8 / 4 heads, cp 2, and
    16 / 8, cp 4, with output errors of 3.3 and 3.7), invisible where a rank holds one k/v head,
    as in every other kernel test; and k/v repeated before the exchange in the wrong order
    (8 / 2 heads at cp 4: an output error of 2.9)."""
    from support.context_worlds import kernel_against_full_attention

    shape = (1, heads, 8 * world, 8)
    results = run_world(kernel_against_full_attention, world, scheme, shape, kv_heads)
    for rank, errors in enumerate(results):
        assert max(errors.values()) < 1e-5, (rank, errors)


# Packed rows: documents that end inside a chunk and on a chunk's edge, of one token, spanning
# chunks; the second row one document (32 tokens: chunks of 8 at world 2, of 4 at world 4).
PACKED = {
    2: [[3, 6, 5, 2, 8, 8], [32]],
    4: [[3, 6, 5, 2, 8, 1, 7], [32]],
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_kernel_matches_dense_block_causal_attention(scheme, world):
    """Packed rows (several documents each) against one process's dense attention under the
    block-causal mask, outputs and q/k/v gradients. Catches: no document mask (a query sees the
    previous document: errors of order 1), a mask on the wrong chunks' ids, a merge that turns
    a query with no key in a block into NaN, a pair skipped that has a key to see."""
    from support.context_worlds import kernel_against_full_attention

    lengths = PACKED[world]
    results = run_world(kernel_against_full_attention, world, scheme, (2, 4, 32, 8), 2, lengths)
    for rank, errors in enumerate(results):
        assert max(errors.values()) < 1e-5, (rank, errors)


def test_a_batch_keeps_this_ranks_tokens_of_its_sequence_tensors():
    from lightning_3d.parallel.context.batch import shard_batch

    ids, lengths = torch.arange(16).view(2, 8), torch.tensor([8, 8])
    x, y, n = shard_batch((ids, ids + 1, lengths), 1, 2)
    assert x.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]] and y[0, 0] == 3
    assert n is lengths  # no sequence dim: as it was


def test_a_dict_batch_is_shifted_before_it_is_cut():
    """A Hugging Face-style dict: targets shifted on the whole sequence (rank 0's first chunk
    ends with the target of position 1, not its own label), positions cut like the tokens,
    document ids of the whole row; the padding's labels dropped with its mask."""
    from lightning_3d.parallel.context.batch import shard_batch

    ids = torch.arange(8).view(1, 8)
    labels = torch.tensor([[-100, 11, 12, -100, -100, 15, 16, 17]])
    packed = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]]),
    }
    mine = shard_batch(packed, 0, 2)  # positions 0 1 6 7
    assert sorted(mine) == ["document_ids", "input_ids", "position_ids", "targets"]
    assert mine["input_ids"].tolist() == [[0, 1, 6, 7]]
    assert mine["targets"].tolist() == [[11, 12, 17, -100]]
    assert mine["position_ids"].tolist() == [[0, 1, 3, 0]]
    assert mine["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]  # the whole row
    one = shard_batch({"input_ids": ids, "position_ids": torch.arange(8).view(1, 8)}, 1, 2)
    assert "document_ids" not in one and one["targets"].tolist() == [[3, 4, 5, 6]]
    padded = {"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[1] * 5 + [0] * 3])}
    theirs = shard_batch(padded, 1, 2)  # positions 2 3 4 5
    assert sorted(theirs) == ["input_ids", "targets"]
    assert theirs["targets"].tolist() == [[3, 4, -100, -100]]


# One row a single conversation, the others several (16 tokens: chunks of 4 at context 2).
MIXED_ROWS = [[16], [5, 7, 4], [3, 13]]


@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_a_batch_with_one_single_conversation_row_keeps_its_documents(scheme):
    """Packed rows beside a row of one conversation: the cut batch keeps ``document_ids`` and
    the packed rows' attention outputs equal their conversations' attended alone. Catches
    document ids kept only when every row, not any row, holds several documents (the packed
    rows' conversations then see each other: seen failing with output errors of 2.5, both
    schemes)."""
    from lightning_3d.parallel.context.batch import shard_batch
    from support.context_worlds import packed_rows_against_their_conversations

    positions = torch.tensor([[p for n in row for p in range(n)] for row in MIXED_ROWS])
    batch = {"input_ids": torch.zeros_like(positions), "position_ids": positions}
    errors = run_world(packed_rows_against_their_conversations, 2, scheme, MIXED_ROWS)
    assert max(errors) < 1e-5, errors
    assert "document_ids" in shard_batch(batch, 0, 2)


def test_a_dict_batch_context_parallelism_cannot_split_is_named():
    from lightning_3d.parallel.context.batch import shard_batch

    ids = torch.arange(16).view(2, 8)
    with pytest.raises(ValueError, match=r"got keys \['input_ids', 'pixel_values'\]"):
        shard_batch({"input_ids": ids, "pixel_values": ids}, 0, 2)
    left = torch.tensor([[1] * 8, [0, 0, 1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"right padding only .*; rows \[1\] mask a token"):
        shard_batch({"input_ids": ids, "attention_mask": left}, 0, 2)


@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_kernels_keep_bf16_inputs_in_bf16(scheme):
    from support.context_worlds import bf16_kernel_runs

    assert max(run_world(bf16_kernel_runs, 2, scheme)) < 0.05  # bf16 rounding of the inputs


@pytest.mark.parametrize(
    "scheme, kv_heads, world",
    [("ring", 1, 2), ("ring", 2, 4), ("alltoall", 2, 2), ("alltoall", 1, 2), ("alltoall", 2, 4)],
)
def test_grouped_query_kv_travel_with_their_own_heads(scheme, kv_heads, world):
    """Grouped-query k/v are exchanged unrepeated (all-to-all: with the fewest heads the ranks
    split evenly), so a rank sends what the formulas of docs/context-parallelism.md say for
    ``Hkv`` k/v heads, forward and backward. Catches k/v repeated to the query heads before the
    exchange (seen failing at 4x the ring's bytes, 4/3x the all-to-all's at Hkv = 2 of 4)."""
    from support.context_worlds import kernel_elements_sent

    B, H, T, D = 2, 4, 8 * world, 8
    n = B * H * (T // world) * D  # elements of this rank's queries
    if scheme == "ring":
        kv = n * kv_heads // H
        expected = 2 * (2 * kv * (world - 1)) + 2 * kv * world
    else:
        # the fewest heads the ranks split evenly: 2 of 4 at world 2 and 4; 1 repeated to 2
        travelling = max(kv_heads, 2) if world == 2 else 4
        kv = n * travelling // H
        expected = 2 * (2 * n + 2 * kv) * (world - 1) // world
    sent = run_world(kernel_elements_sent, world, scheme, (B, H, T, D), kv_heads)
    assert sent == [expected] * world, (sent, expected)
