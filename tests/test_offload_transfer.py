"""The device side of an offloaded step (lightning_3d.offload.transfer): gradients fetched a group
ahead into staging buffers used in turn, weights returned through staging buffers.

On this CPU-only machine the classes run with synchronous copies, which is enough to hold their
grouping, buffer turns and values; ``tests/test_cuda.py`` runs the side streams (overlapped
against blocking, bit for bit) on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from lightning_3d.offload import OffloadedAdam
from lightning_3d.offload.transfer import GradientPrefetcher, WeightUploader, _groups


def test_groups_are_consecutive_runs_that_fit():
    assert _groups([3, 3, 3, 5, 1], 6) == [range(0, 2), range(2, 3), range(3, 5)]
    assert _groups([9, 1], 4) == [range(0, 1), range(1, 2)]  # a larger slice goes alone
    assert _groups([], 4) == []


def test_prefetched_gradients_are_the_gradients_in_every_turn_of_the_buffers():
    g = torch.Generator().manual_seed(0)
    slices = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (5, 7, 3, 8, 2, 6, 4)]
    fetch = GradientPrefetcher(slices, stage_bytes=2 * 10)  # 10 bf16 elements a buffer: 5 groups
    assert len(fetch.groups) >= 4  # so both buffers are reused
    for i, s in enumerate(slices):
        host = fetch.get(i)
        assert host.dtype == torch.bfloat16 and torch.equal(host, s)
        assert torch.equal(fetch.get(i), s)  # the current group can be read again
    with pytest.raises(ValueError, match=r"slice 0 belongs to group 0, already released"):
        fetch.get(0)
    fetch.close()


def test_prefetcher_refuses_mixed_slices():
    with pytest.raises(ValueError, match=r"one dtype and device"):
        GradientPrefetcher([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match=r"at least one"):
        GradientPrefetcher([])


def test_uploader_on_a_cpu_copies_and_casts():
    weights = torch.zeros(4, dtype=torch.bfloat16)
    up = WeightUploader()
    up.put(weights, torch.tensor([1.0, 2.5, -3.0, 1 / 3]))
    up.finish()
    assert torch.equal(weights, torch.tensor([1.0, 2.5, -3.0, 1 / 3]).to(torch.bfloat16))


def test_overlap_is_checked_and_off_gives_the_same_step():
    with pytest.raises(ValueError, match=r"overlap='yes' must be True or False"):
        OffloadedAdam([torch.nn.Parameter(torch.zeros(2))], overlap="yes")
    results = []
    for overlap in (True, False):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
        opt = OffloadedAdam([p], lr=1e-2, chunk_bytes=12 * 64, overlap=overlap)
        for step in range(3):
            p.grad = torch.randn(300, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(step))
            opt.step()
        results.append(p.detach().clone())
        opt.close()
    assert torch.equal(*results)
