"""Context-parallel attention kernels against full causal attention on one process, forward and
gradients, in gloo worlds of 2 and 4 ranks; and the load-balanced split of a sequence."""

import pytest
import torch

from lightning_3d.harness.world import run_world
from lightning_3d.parallel.context.chunks import (
    local_positions,
    shard_sequence,
    unshard_sequence,
)


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
    instead of sent home, all-to-all slices put back in the wrong order."""
    from support.context_worlds import kernel_against_full_attention

    results = run_world(kernel_against_full_attention, world, scheme, (2, 4, 8 * world, 8), 2)
    for rank, errors in enumerate(results):
        assert max(errors.values()) < 1e-5, (rank, errors)


def test_a_batch_keeps_this_ranks_tokens_of_its_sequence_tensors():
    from lightning_3d.parallel.context.apply import shard_batch

    ids, lengths = torch.arange(16).view(2, 8), torch.tensor([8, 8])
    x, y, n = shard_batch((ids, ids + 1, lengths), 1, 2)
    assert x.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]] and y[0, 0] == 3
    assert n is lengths  # no sequence dim: as it was
    with pytest.raises(ValueError, match=r"got a dict batch with keys \['input_ids', 'labels'\]"):
        shard_batch({"input_ids": ids, "labels": ids}, 0, 2)


@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_kernels_keep_bf16_inputs_in_bf16(scheme):
    from support.context_worlds import bf16_kernel_runs

    assert max(run_world(bf16_kernel_runs, 2, scheme)) < 0.05  # bf16 rounding of the inputs
