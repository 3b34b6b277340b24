"""ZeRO-Offload's one-step delayed parameter update: off is exact, on lags exactly one update."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_3d.offload import OffloadedAdam

SHAPES = [(37, 19), (101,), (64,)]
CHUNK = 192  # bytes: 16-element chunks, many per parameter


def _params(dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _reference(dtype: torch.dtype) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
    params = [nn.Parameter(p.detach().float()) for p in _params(dtype)]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True), params


def _offloaded(delay: bool, device: str, tmp_path, dtype: torch.dtype = torch.float32):
    params = _params(dtype)
    opt = OffloadedAdam(
        params,
        lr=1e-2,
        weight_decay=0.1,
        device=device,
        chunk_bytes=CHUNK,
        path=tmp_path if device == "nvme" else None,
        delay_update=delay,
    )
    return opt, params


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_off_is_exact(device, tmp_path):
    ref, ref_params = _reference(torch.float32)
    opt, params = _offloaded(False, device, tmp_path)
    for step in range(4):
        for p, r, g in zip(params, ref_params, _grads(step)):
            p.grad, r.grad = g.clone(), g.clone()
        if step == 0:
            assert opt.last_update_cpu_s is None  # no update has run yet
        opt.step(), ref.step()
        assert all(torch.equal(p, r) for p, r in zip(params, ref_params))  # at every step, no lag
        assert opt.last_update_cpu_s > 0  # the fused CPU step's own time in this step
    opt.close()


@pytest.mark.parametrize(
    "device, dtype", [("cpu", torch.float32), ("nvme", torch.float32), ("cpu", torch.bfloat16)]
)
def test_on_lags_one_update_and_synchronize_catches_up(device, dtype, tmp_path):
    ref, ref_params = _reference(dtype)
    opt, params = _offloaded(True, device, tmp_path, dtype)
    history = [[r.detach().clone() for r in ref_params]]
    for step in range(4):
        for p, r, g in zip(params, ref_params, _grads(step)):
            p.grad, r.grad = g.to(dtype), g.to(dtype).float()
        opt.step(), ref.step()
        history.append([r.detach().clone() for r in ref_params])
        for p in params:
            # The update in flight works on its own copy of the gradients.
            p.grad.fill_(float("nan"))
        # The parameters hold the update before last: the one this step() waited for.
        assert all(torch.equal(p, h.to(dtype)) for p, h in zip(params, history[-2]))
    assert not torch.equal(params[0], history[-1][0].to(dtype))
    for p, r in zip(params, ref_params):  # the state is a full update ahead of the parameters
        # fp32 CPU parameters get a master too.
        assert torch.equal(opt.state[p]["master"], r.detach())
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[r]["exp_avg_sq"])
    opt.synchronize()
    assert all(torch.equal(p, r.detach().to(dtype)) for p, r in zip(params, ref_params))
    assert opt.last_update_cpu_s > 0  # the CPU step alone of the update that ran in the background
    opt.close()


def test_state_dict_round_trip_keeps_the_trajectory(tmp_path):
    whole, whole_params = _offloaded(True, "cpu", tmp_path)
    first, first_params = _offloaded(True, "cpu", tmp_path)
    for step in range(5):
        for opt, params in [(whole, whole_params)] + ([(first, first_params)] if step < 3 else []):
            for p, g in zip(params, _grads(step)):
                p.grad = g.clone()
            opt.step()
        if step == 3:
            whole_at_3 = [p.detach().clone() for p in whole_params]
        if step == 2:  # a checkpoint as Lightning takes it: the lagging weights and the state
            saved = first.state_dict()
            resumed_params = [nn.Parameter(p.detach().clone()) for p in first_params]
            first.close()
            resumed = OffloadedAdam(
                resumed_params, lr=1e-2, weight_decay=0.1, chunk_bytes=CHUNK, delay_update=True
            )
            resumed.load_state_dict(saved)
    for step in range(3, 5):
        for p, g in zip(resumed_params, _grads(step)):
            p.grad = g.clone()
        resumed.step()
        if step == 3:  # the weights the next forward sees: as if never interrupted
            assert all(torch.equal(a, b) for a, b in zip(whole_at_3, resumed_params))
    assert all(torch.equal(a, b) for a, b in zip(whole_params, resumed_params))
    whole.synchronize(), resumed.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(whole_params, resumed_params))
    whole.close(), resumed.close()


def test_bad_value_is_refused():
    with pytest.raises(ValueError, match="delay_update='yes' must be True or False"):
        OffloadedAdam(_params(), delay_update="yes")


def test_offload_options_check_delay_update():
    from lightning_3d.offload import offload_options

    assert offload_options("cpu", None, 16, delay_update=True)["delay_update"] is True
    assert offload_options("cpu", None, 16)["delay_update"] is False
    with pytest.raises(ValueError, match="offload_delay_update=1 must be True or False"):
        offload_options("cpu", None, 16, delay_update=1)
    with pytest.raises(ValueError, match="needs offload='cpu' or 'nvme', got offload='none'"):
        offload_options("none", None, 16, delay_update=True)


@pytest.mark.parametrize("delay", [False, True], ids=["immediate", "delayed"])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_state_without_masters_starts_them_from_the_bf16_weights(delay, device, tmp_path):
    """A plain torch AdamW checkpoint (or a run without offload) has moments but no fp32 masters:
    loaded into offload over bf16 parameters, each master starts from its parameter's weights, and
    the next steps follow AdamW on those weights in fp32. Broken variant caught (seen failing):
    ``optimizer._add`` copying the weights into the master only at a parameter's first step (the
    loaded state's step is 3): the master starts from zeros (masters off by up to 4.1)."""
    plain, plain_params = _reference(torch.bfloat16)
    for step in range(3):
        for r, g in zip(plain_params, _grads(step)):
            r.grad = g.clone()
        plain.step()
    saved = plain.state_dict()
    assert all("master" not in state for state in saved["state"].values())
    opt, params = _offloaded(delay, device, tmp_path, torch.bfloat16)
    with torch.no_grad():
        for p, r in zip(params, plain_params):
            p.copy_(r)  # the checkpoint's weights, rounded to the parameters' bf16
    ref_params = [nn.Parameter(p.detach().float()) for p in params]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=True)
    ref.load_state_dict(saved)
    opt.load_state_dict(saved)
    for step in range(3, 5):
        for p, r, g in zip(params, ref_params, _grads(step)):
            p.grad, r.grad = g.bfloat16(), g.bfloat16().float()
        opt.step(), ref.step()
    opt.synchronize()
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(opt.state[p]["master"], r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p, r.detach().bfloat16())
    opt.close()
