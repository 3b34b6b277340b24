"""The fused CPU step of offloaded Adam(W): torch's kernel, batched, bit-exact with fused torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_3d.offload import OffloadedAdam
from lightning_3d.offload.fused import AdamHyper, FusedBatch
from lightning_3d.offload.storage import plan_chunks

SHAPES = [(37, 19), (101,), (5, 7, 3), (1,), (64,)]
TINY_CHUNK = 192  # bytes: chunks of 16 elements (the aligned minimum), many per parameter


def _params(dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _build(kind: type, params: list, fused: bool | None = None) -> torch.optim.Optimizer:
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.05}]
    return kind(groups, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, fused=fused)


def _grads(step: int, params: list) -> list:
    gen = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    if step % 2 == 1:
        grads[3] = None  # that parameter falls a step behind: two step counts in one group
    return grads


def _run(
    opt: torch.optim.Optimizer, params: list, steps: int, dtype: torch.dtype, scheduler: bool
) -> None:
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7**s) if scheduler else None
    for step in range(steps):
        for p, g in zip(params, _grads(step, params)):
            p.grad = None if g is None else g.to(dtype)
        opt.step()
        if schedule is not None:
            schedule.step()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])  # Adam: L2 weight decay
def test_bit_exact_with_fused_torch_and_close_to_unfused(kind, device, tmp_path):
    fused_params, plain_params, params = _params(), _params(), _params()
    fused, plain = _build(kind, fused_params, fused=True), _build(kind, plain_params)
    opt = OffloadedAdam.from_optimizer(
        _build(kind, params),
        device=device,
        path=tmp_path if device == "nvme" else None,
        chunk_bytes=TINY_CHUNK,
    )
    for o, ps in [(fused, fused_params), (plain, plain_params), (opt, params)]:
        _run(o, ps, 5, torch.float32, scheduler=True)
    assert not torch.equal(params[0], _params()[0])
    for f, u, p in zip(fused_params, plain_params, params):
        assert torch.equal(p, f)  # element-wise kernel: chunking and batching change no bit
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], fused.state[f][key])
        # torch's default path: rounding only.
        torch.testing.assert_close(p, u, rtol=1e-6, atol=1e-7)
    opt.close()


def test_bf16_params_step_fp32_masters_exactly(tmp_path):
    params = _params(torch.bfloat16)
    ref_params = [nn.Parameter(p.detach().float()) for p in params]
    ref = _build(torch.optim.AdamW, ref_params, fused=True)
    opt = OffloadedAdam.from_optimizer(_build(torch.optim.AdamW, params), chunk_bytes=TINY_CHUNK)
    for step in range(4):
        grads = [None if g is None else g.bfloat16() for g in _grads(step, params)]
        for p, r, g in zip(params, ref_params, grads):
            p.grad, r.grad = (None, None) if g is None else (g, g.float())
        opt.step(), ref.step()
    for p, r in zip(params, ref_params):
        assert torch.equal(opt.state[p]["master"], r.detach())
        assert p.dtype == torch.bfloat16 and torch.equal(p, r.detach().bfloat16())
    opt.close()


def test_cpu_store_steps_each_group_and_step_count_in_one_call(monkeypatch):
    calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(
        torch,
        "_fused_adamw_",
        lambda params, *a, **k: (calls.append(len(params)), kernel(params, *a, **k)),
    )
    params = _params()
    opt = OffloadedAdam.from_optimizer(_build(torch.optim.AdamW, params), chunk_bytes=TINY_CHUNK)
    chunks = [len(slot.chunks) for slot in opt._slots]
    _run(opt, params, 1, torch.float32, scheduler=False)  # every grad present, all at step 1
    assert calls == [sum(chunks[:2]), sum(chunks[2:])]  # one call per param group
    calls.clear()
    _run(opt, params, 2, torch.float32, scheduler=False)  # grads[3] is None in the second step
    assert calls == [sum(chunks[:2]), sum(chunks[2:]), sum(chunks[:2]), sum(chunks[2:]) - chunks[3]]
    calls.clear()
    _run(opt, params, 1, torch.float32, scheduler=False)  # parameter 3 is now one step behind
    assert calls == [sum(chunks[:2]), chunks[2] + chunks[4], chunks[3]]
    opt.close()


def test_grad_buffer_overflow_flushes_and_changes_nothing():
    gen = torch.Generator().manual_seed(3)
    n, hyper = 1000, AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, True)
    masters = [torch.randn(n, generator=gen) for _ in range(2)]
    grads = [torch.randn(n, generator=gen).bfloat16() for _ in range(4)]
    results = []
    for buffer_bytes in (4 * 300, 4 * 4000):  # three flushes per step vs one
        batch = FusedBatch(grad_buffer_bytes=buffer_bytes)
        state = [(m.clone(), torch.zeros(n), torch.zeros(n)) for m in masters]
        for step in (1, 2):
            for k, (master, exp_avg, exp_avg_sq) in enumerate(state):
                for part in range(0, n, 250):  # 250-element chunks of the 1000-element tensors
                    cut = slice(part, part + 250)
                    batch.add(
                        hyper,
                        step,
                        master[cut],
                        grads[2 * (step - 1) + k][cut],
                        exp_avg[cut],
                        exp_avg_sq[cut],
                    )
            batch.flush()
        results.append(state)
    for small, large in zip(*results):
        assert all(torch.equal(a, b) for a, b in zip(small, large))
    assert not torch.equal(results[0][0][0], masters[0])
    with pytest.raises(ValueError, match="grad_buffer_bytes must hold one fp32 value, got 2"):
        FusedBatch(grad_buffer_bytes=2)


def test_chunks_are_cut_at_cache_line_multiples():
    params = [
        nn.Parameter(torch.zeros(1000)),
        nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16)),
    ]
    _, chunks = plan_chunks([{"params": params}], chunk_bytes=1000)
    # 1000 // 8 = 125 -> 112 elements of 2 fp32 fields; 1000 // 12 = 83 -> 80 of 3 (bf16: own master)
    assert [c.numel for c in chunks if c.slot == 0] == [112] * 8 + [104]
    assert [c.numel for c in chunks if c.slot == 1] == [80] * 12 + [40]
    _, tiny = plan_chunks([{"params": params[:1]}], chunk_bytes=40)  # under 16 elements: as asked
    assert {c.numel for c in tiny} == {5}
