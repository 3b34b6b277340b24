"""The CPU offload store pins its state in bounded blocks, and the planner counts what is pinned.

CUDA's caching host allocator rounds each pinned allocation up to a power of two; the whole
state as one tensor would pin up to twice its size (the 6.7 B offload row's ~80 GB of state
asked for 128 GiB on a 128 GiB host). Pinning needs a GPU, so these count the blocks the store
allocates and what the allocator would round them to; tests/test_planner.py holds the planner's
host term to :func:`pinned_bytes`."""

import pytest
import torch

from lightning_3d.offload import storage
from lightning_3d.offload.storage import CpuChunkStore, pinned_bytes


def test_segments_pack_into_blocks_no_larger_than_the_bound(monkeypatch):
    """Catches: the store allocated as one tensor again (one block of the whole state), a
    segment split across blocks or written to another's place."""
    monkeypatch.setattr(storage, "_pinned", lambda: True)  # as with a GPU: count the pinning
    monkeypatch.setattr(torch, "empty", _unpinned(torch.empty))
    block = 1024  # bytes: 256 fp32 values
    numels = [100, 100, 100, 30, 256, 7]  # the third starts a new block; 256 fills one alone
    store = CpuChunkStore(numels, block_bytes=block)
    assert [b.numel() for b in store._blocks] == [200, 130, 256, 7]
    for i, n in enumerate(numels):
        store.write(i, torch.full((n,), float(i)))
    for i, n in enumerate(numels):
        assert torch.equal(store.read(i), torch.full((n,), float(i)))
    # 200 values = 800 B -> 1024; 130 -> 520 B -> 1024; 256 -> 1024; 7 -> 28 B -> 32
    assert store.pinned_bytes == 1024 + 1024 + 1024 + 32
    assert store.nbytes == sum(numels) * 4


def _unpinned(empty):
    def make(*args, pin_memory=False, **kwargs):  # no accelerator here to pin with
        return empty(*args, **kwargs)

    return make


@pytest.mark.parametrize("gb", [0.3, 1.0, 80.0])
def test_pinned_bytes_stay_within_one_block_of_the_state(gb):
    """Catches: the planner counting the state where the allocator pins a power of two (the
    whole state at 80 GB: 128 GiB), or the blocks growing past their bound."""
    state = gb * 1e9
    pinned = pinned_bytes(state)
    assert state <= pinned <= state + storage.PINNED_BLOCK_BYTES
    whole = 1 << (int(state) - 1).bit_length()
    assert whole > 1.3 * state or gb == 1.0  # one tensor would pin this much more (not at 1 GB)
