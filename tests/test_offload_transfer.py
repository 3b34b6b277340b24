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
from lightning_3d.offload.transfer import (
    GradientPrefetcher,
    GradientSnapshot,
    WeightUploader,
    _groups,
)


def test_groups_are_consecutive_runs_that_fit():
    assert _groups([3, 3, 3, 5, 1], 6) == [range(0, 2), range(2, 3), range(3, 5)]
    assert _groups([9, 1], 4) == [range(0, 1), range(1, 2)]  # a larger slice goes alone
    assert _groups([], 4) == []


def test_prefetched_gradients_are_the_gradients_in_every_turn_of_the_buffers():
    g = torch.Generator().manual_seed(0)
    slices = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (5, 7, 3, 8, 2, 6, 4)]
    fetch = GradientPrefetcher(slices, stage_bytes=2 * 10)  # 10 bf16 elements a buffer: 5 groups
    assert len(fetch.groups[0]) >= 4  # one lane (one dtype); both of its buffers are reused
    for i, s in enumerate(slices):
        host = fetch.get(i)
        assert host.dtype == torch.bfloat16 and torch.equal(host, s)
        assert torch.equal(fetch.get(i), s)  # the current group can be read again
    with pytest.raises(ValueError, match=r"slice 0 belongs to group 0, already released"):
        fetch.get(0)
    fetch.close()


def test_mixed_slices_get_a_lane_each_and_come_back_whole():
    """A bf16 model's fp32 norms next to its bf16 matrices: one lane per dtype, each read in order."""
    g = torch.Generator().manual_seed(1)
    slices = [
        torch.randn(n, generator=g).to(dtype)
        for n, dtype in (
            (5, torch.bfloat16),
            (3, torch.float32),
            (7, torch.bfloat16),
            (4, torch.float32),
            (6, torch.bfloat16),
        )
    ]
    fetch = GradientPrefetcher(slices, stage_bytes=16)
    assert [len(groups) for groups in fetch.groups] == [3, 2]  # bf16: 8 a buffer; fp32: 4
    for i, s in enumerate(slices):
        host = fetch.get(i)
        assert host.dtype == s.dtype and torch.equal(host, s)
    fetch.close()
    with pytest.raises(ValueError, match=r"at least one"):
        GradientPrefetcher([])


def test_a_buffer_is_refilled_only_after_the_reader_is_told():
    """``before_reuse`` runs before a staging buffer that held an earlier group is overwritten,
    never before the first two groups (both buffers still fresh)."""
    slices = [torch.full((4,), float(i)) for i in range(5)]  # fp32, a group each (16-byte buffers)
    calls = []
    fetch = GradientPrefetcher(
        slices, stage_bytes=16, before_reuse=lambda: calls.append(len(calls))
    )
    held = []
    for i in range(5):
        held.append(fetch.get(i))
        # group i + 1 is issued now: it overwrites group i - 1's buffer, after the reader was told
        assert len(calls) == max(0, min(i, 3)), (i, calls)
    assert torch.equal(held[-1], slices[-1])
    fetch.close()


def test_a_snapshot_is_an_owned_copy_in_the_gradients_dtype_in_buffers_kept_between_steps():
    snapshot = GradientSnapshot()
    grads = {0: torch.randn(7, 3).to(torch.bfloat16), 2: torch.randn(5)}
    first, ready = snapshot.take(grads)
    ready()
    assert {k: (v.dtype, v.shape) for k, v in first.items()} == {
        0: (torch.bfloat16, (21,)),
        2: (torch.float32, (5,)),
    }
    assert all(torch.equal(first[k], g.reshape(-1)) for k, g in grads.items())
    kept = {k: v.data_ptr() for k, v in first.items()}
    for g in grads.values():
        g.fill_(float("nan"))  # the caller reuses its gradients: the copy does not change
    assert all(not v.isnan().any() for v in first.values())
    second, _ = snapshot.take({0: torch.ones(21, dtype=torch.bfloat16), 2: torch.ones(6)})
    assert second[0].data_ptr() == kept[0] and torch.equal(
        second[0], torch.ones(21, dtype=torch.bfloat16)
    )
    # A new size: a new buffer.
    assert second[2].numel() == 6 and torch.equal(second[2], torch.ones(6))


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
            p.grad = torch.randn(
                300, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(step)
            )
            opt.step()
        results.append(p.detach().clone())
        opt.close()
    assert torch.equal(*results)


@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32,) * 3, (torch.bfloat16, torch.float32, torch.bfloat16)],
    ids=["fp32", "bf16+fp32"],
)
def test_prefetched_steps_equal_fused_adamw(monkeypatch, dtypes):
    """The prefetching path of ``OffloadedAdam`` driven on the CPU (its synchronous lane), with
    staging buffers so small that they turn many times in one step: the weights equal
    ``torch.optim.AdamW(fused=True)`` on fp32 masters cast to each dtype, bit for bit. fp32
    gradients reach the batch as views of a staging buffer; stepped after the buffer was
    refilled, they would be another group's."""
    monkeypatch.setattr(OffloadedAdam, "prefetch_devices", ("cuda", "cpu"))
    monkeypatch.setattr(OffloadedAdam, "stage_bytes", 256)
    sizes = (700, 333, 1200)
    start = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in sizes]
    params = [torch.nn.Parameter(t.to(dtype, copy=True)) for t, dtype in zip(start, dtypes)]
    opt = OffloadedAdam(params, lr=1e-2, chunk_bytes=12 * 64)
    # No alias.
    masters = [torch.nn.Parameter(t.to(dtype).float().clone()) for t, dtype in zip(start, dtypes)]
    reference = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    for step in range(3):
        grads = [
            torch.randn(n, generator=torch.Generator().manual_seed(10 * step + n)) for n in sizes
        ]
        for p, m, g in zip(params, masters, grads):
            p.grad, m.grad = g.to(p.dtype, copy=True), g.to(p.dtype).float().clone()
        opt.step()
        reference.step()
    for p, m in zip(params, masters):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))
    opt.close()
