"""Offloaded Adam(W): parity with torch, checkpoints, bounded memory, private files, bad input."""

from __future__ import annotations

import functools
import gc
import io
import os
import stat
import threading
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_3d.offload import FileChunkStore, OffloadedAdam, check_offload_path
from lightning_3d.offload import paths as offload_paths

SHAPES = [(37, 19), (101,), (5, 7, 3), (1,), (64,)]
TINY_CHUNK = 192  # bytes: 16-element chunks (the aligned minimum), so most parameters span many


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _build(
    kind: type, params: list[nn.Parameter], fused: bool | None = None
) -> torch.optim.Optimizer:
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.05}]
    return kind(groups, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, fused=fused)


def _grads(step: int, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    if step % 2 == 1:
        grads[3] = None  # skipped like torch skips it: no update, no step count
    return grads


def _set_grads(params: list[nn.Parameter], grads: list) -> None:
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.to(p.dtype)


def _offloaded(kind: type, params: list, device: str, tmp_path, inner=None) -> OffloadedAdam:
    inner = inner or _build(kind, params)
    path = tmp_path if device == "nvme" else None
    return OffloadedAdam.from_optimizer(inner, device=device, path=path, chunk_bytes=TINY_CHUNK)


_close = functools.partial(torch.testing.assert_close, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------ parity
# A scheduler on the wrapped optimizer never sees that optimizer's step() called: torch warns.
@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize("scheduler_on", ["wrapped", "offloaded"])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
def test_matches_torch_with_groups_weight_decay_and_scheduler(kind, device, scheduler_on, tmp_path):
    ref_params, params = _params(), _params()
    ref, inner = _build(kind, ref_params), _build(kind, params)
    schedule = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s)  # noqa: E731
    # On the wrapped optimizer: the group dicts are shared, so the offloaded one sees its LRs.
    schedules = [schedule(ref)] + ([schedule(inner)] if scheduler_on == "wrapped" else [])
    opt = _offloaded(kind, params, device, tmp_path, inner)
    schedules += [schedule(opt)] if scheduler_on == "offloaded" else []
    assert len(opt._chunks) == 63  # 16 elements each, the last of a parameter shorter
    for step in range(6):
        _set_grads(ref_params, _grads(step, params)), _set_grads(params, _grads(step, params))
        ref.step(), opt.step()
        for s in schedules:
            s.step()
    assert opt.param_groups[1]["lr"] == ref.param_groups[1]["lr"] == pytest.approx(3e-3 * 0.5**6)
    assert not torch.equal(params[0], _params()[0])  # the weights did move
    for a, b in zip(ref_params, params):
        _close(b, a)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            _close(opt.state[b][key], ref.state[a][key])
    opt.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_bf16_params_keep_an_fp32_master(device, tmp_path):
    params = _params(dtype=torch.bfloat16)
    # Bit-exact.
    ref = _build(torch.optim.AdamW, [nn.Parameter(p.detach().float()) for p in params], fused=True)
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    opt = _offloaded(torch.optim.AdamW, params, device, tmp_path)
    for step in range(4):
        grads = [None if g is None else g.bfloat16() for g in _grads(step, params)]
        _set_grads(params, grads)
        _set_grads(ref_params, [None if g is None else g.float() for g in grads])
        ref.step(), opt.step()
    for a, b in zip(ref_params, params):
        _close(opt.state[b]["master"], a.detach())  # the fp32 trajectory, not a bf16 one
        assert b.dtype == torch.bfloat16 and torch.equal(b, a.detach().bfloat16())
    opt.close()


def test_dtensor_params(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        ref_params, params = (
            _params(),
            [nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])) for p in _params()],
        )
        ref, opt = (
            _build(torch.optim.AdamW, ref_params),
            _offloaded(torch.optim.AdamW, params, "nvme", tmp_path),
        )
        for step in range(3):
            _set_grads(ref_params, _grads(step, params))
            for p, g in zip(params, _grads(step, params)):
                p.grad = None if g is None else distribute_tensor(g, mesh, [Shard(0)])
            ref.step(), opt.step()
        for a, b in zip(ref_params, params):
            _close(b.to_local(), a.detach())
        assert isinstance(opt.state_dict()["state"][0]["exp_avg"], DTensor)
        opt.close()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ step semantics
def test_grad_none_is_skipped_and_zero_grad_works(tmp_path):
    params = _params()
    opt = _offloaded(torch.optim.AdamW, params, "nvme", tmp_path)
    before = params[1].detach().clone()
    params[0].grad = torch.ones_like(params[0])
    assert opt.step(closure=lambda: 7.0) == 7.0
    assert torch.equal(params[1], before) and params[1] not in opt.state and len(opt.state) == 1
    assert opt.state[params[0]]["step"].item() == 1.0
    opt.zero_grad()
    assert params[0].grad is None
    # e.g. ZeRO attached after wrapping.
    opt.param_groups[0]["params"] = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="param_groups changed"):
        opt.step()
    opt.close()


# ------------------------------------------------------------------------------ checkpoints
def _run(opt: torch.optim.Optimizer, params: list, steps: range) -> None:
    for step in steps:
        _set_grads(params, _grads(step, params))
        opt.step()


def _roundtrip(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()))


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_state_dict_round_trip_is_exact(device, tmp_path):
    whole = _params()
    opt = _offloaded(torch.optim.AdamW, whole, device, tmp_path)
    _run(opt, whole, range(5))
    opt_a = _offloaded(torch.optim.AdamW, first := _params(), device, tmp_path)
    _run(opt_a, first, range(3))
    saved = _roundtrip(opt_a.state_dict())
    opt_a.close()
    plain = _build(torch.optim.AdamW, [nn.Parameter(p.detach()) for p in first]).state_dict()
    assert [g.keys() for g in saved["param_groups"]] == [g.keys() for g in plain["param_groups"]]
    assert [g["params"] for g in saved["param_groups"]] == [[0, 1], [2, 3, 4]]
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert saved["state"][0]["step"].dtype == torch.float32
    assert saved["state"][3]["step"].item() == 2.0  # its grad was None in step 1: skipped
    resumed = [nn.Parameter(p.detach().clone()) for p in first]
    opt_b = _offloaded(torch.optim.AdamW, resumed, device, tmp_path)
    opt_b.load_state_dict(saved)
    _run(opt_b, resumed, range(3, 5))
    for a, b in zip(whole, resumed):
        assert torch.equal(a, b)
    saved["param_groups"] = saved["param_groups"][:1]
    with pytest.raises(ValueError, match=r"param groups differ: the state dict's have sizes \[2\]"):
        opt_b.load_state_dict(saved)
    opt.close(), opt_b.close()


def test_plain_adamw_checkpoints_load_both_ways(tmp_path):
    # Fused plain AdamW: the same kernel as the offloaded step, so every trajectory is bit-exact.
    plain_params, params = _params(), _params()
    plain = _build(torch.optim.AdamW, plain_params, fused=True)
    _run(plain, plain_params, range(3))
    loaded = _offloaded(torch.optim.AdamW, params, "nvme", tmp_path)
    for p, q in zip(params, plain_params):
        p.data.copy_(q.detach())
    loaded.load_state_dict(_roundtrip(plain.state_dict()))
    back_params = [nn.Parameter(p.detach().clone()) for p in plain_params]
    back = _build(torch.optim.AdamW, back_params, fused=True)
    back.load_state_dict(_roundtrip(loaded.state_dict()))  # and back into a plain AdamW
    for group in back.param_groups:  # loading took the offloaded groups' fused=None
        group["fused"] = True
    for opt, ps in [(plain, plain_params), (loaded, params), (back, back_params)]:
        _run(opt, ps, range(3, 5))
    assert all(
        torch.equal(a, b) and torch.equal(a, c)
        for a, b, c in zip(plain_params, params, back_params)
    )
    # Imports existing state.
    wrapped = _offloaded(torch.optim.AdamW, plain_params, "cpu", tmp_path, plain)
    assert all(
        torch.equal(wrapped.state[p]["exp_avg_sq"], plain.state[p]["exp_avg_sq"])
        for p in plain_params
    )
    loaded.close(), wrapped.close()


# ------------------------------------------------------------------------------ memory and I/O
def test_nvme_keeps_only_a_window_of_chunks_in_ram(tmp_path):
    params = [nn.Parameter(torch.randn(100_000)), nn.Parameter(torch.randn(30_000))]
    opt = OffloadedAdam(params, device="nvme", path=tmp_path, chunk_bytes=4096, window=3)
    for _ in range(2):
        _set_grads(params, [torch.randn_like(p) for p in params])
        opt.step()
    assert opt.offloaded_state_bytes == 130_000 * 8
    assert 0 < opt.resident_state_bytes_peak <= 3 * 4096
    assert (
        os.path.getsize(opt._store.file_path) == opt._store.file_bytes >= opt.offloaded_state_bytes
    )  # direct I/O pads segments to 4 KiB
    opt.close()


def test_stream_reads_ahead_and_writes_behind(tmp_path):
    store = FileChunkStore(tmp_path, [16, 16, 16, 16], window=3)
    loaded, stored = ([threading.Event() for _ in range(4)] for _ in range(2))
    load, save = store._load, store._store
    store._load = lambda i, into: (load(i, into), loaded[i].set())[0]
    store._store = lambda i, data: (save(i, data), stored[i].set())[0]
    for index, segment in store.stream(range(4)):
        segment.fill_(index + 1)
        if index + 1 < 4:  # chunk index + 1 arrives while this one is still being computed
            assert loaded[index + 1].wait(5)
        if index >= 1:  # and the previous one is written while this one is computed
            assert stored[index - 1].wait(5)
    assert [store.read(i)[0].item() for i in range(4)] == [1.0, 2.0, 3.0, 4.0]
    store.close()


def test_files_are_private_and_removed_on_close_and_gc(tmp_path):
    opt = _offloaded(torch.optim.AdamW, _params(), "nvme", tmp_path)
    (directory,) = os.listdir(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(opt._store.file_path).st_mode) == 0o600
    opt.close()
    assert os.listdir(tmp_path) == [] and len(opt.state) == 0  # Lightning's teardown iterates it
    with pytest.raises(ValueError, match="closed"):
        opt.step()
    opt = _offloaded(torch.optim.AdamW, _params(), "nvme", tmp_path)
    assert len(os.listdir(tmp_path)) == 1
    del opt  # no close(): garbage collection removes the files
    gc.collect()
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "make, kwargs, match",
    [
        *[
            (
                (lambda f=f: torch.optim.Adam(_params(), **{f: True})),
                {"device": "nvme", "path": "tmp"},
                f"{f}=True",
            )
            for f in ("amsgrad", "maximize", "capturable", "differentiable")
        ],
        (
            lambda: torch.optim.SGD(_params(), lr=0.1),
            {"device": "nvme", "path": "tmp"},
            r"torch.optim.Adam and torch.optim.AdamW, got torch.optim.sgd.SGD",
        ),
        (lambda: torch.optim.AdamW(_params()), {"device": "gpu", "path": "tmp"}, "one of"),
        (lambda: torch.optim.AdamW(_params()), {"device": "nvme"}, "path=None"),
        (
            lambda: torch.optim.AdamW(_params()),
            {"device": "nvme", "path": "tmp", "chunk_bytes": 8},
            "chunk_bytes",
        ),
        (
            lambda: torch.optim.AdamW(_params()),
            {"device": "nvme", "path": "tmp", "window": 1},
            "window",
        ),
    ],
)
def test_bad_options(make, kwargs, match, tmp_path):
    if "path" in kwargs:
        kwargs = {**kwargs, "path": tmp_path}
    with pytest.raises(ValueError, match=match):
        OffloadedAdam.from_optimizer(make(), **kwargs)
    assert os.listdir(tmp_path) == []


def test_bad_paths(tmp_path, monkeypatch):
    missing, a_file = tmp_path / "missing", tmp_path / "file"
    a_file.write_text("x")
    for path, match in [(missing, "does not exist"), (a_file, "not a directory")]:
        with pytest.raises(ValueError, match=match) as info:
            OffloadedAdam.from_optimizer(torch.optim.AdamW(_params()), device="nvme", path=path)
        assert str(path) in str(info.value)
    (locked := tmp_path / "locked").mkdir(mode=0o500)
    if os.geteuid() == 0:  # root may write anywhere: make the check itself say no
        monkeypatch.setattr(offload_paths.os, "access", lambda p, mode: False)
    with pytest.raises(ValueError, match="not writable"):
        OffloadedAdam.from_optimizer(torch.optim.AdamW(_params()), device="nvme", path=locked)
    assert sorted(os.listdir(tmp_path)) == ["file", "locked"] and os.listdir(locked) == []


def test_not_enough_space_names_both_numbers(tmp_path, monkeypatch):
    needed = sum(torch.Size(s).numel() for s in SHAPES) * 8  # exp_avg + exp_avg_sq, fp32
    usage = offload_paths.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        offload_paths.shutil, "disk_usage", lambda p: usage._replace(free=needed - 1)
    )
    with pytest.raises(ValueError, match=f"{needed - 1} bytes free.*needs {needed} bytes") as info:
        OffloadedAdam.from_optimizer(torch.optim.AdamW(_params()), device="nvme", path=tmp_path)
    assert str(tmp_path) in str(info.value)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match=str(10**18)):
        check_offload_path(tmp_path, 10**18)


def test_failure_halfway_leaves_nothing(tmp_path, monkeypatch):
    broken = mock.Mock(side_effect=OSError("disk fell off"))  # after the private directory exists
    monkeypatch.setattr(offload_paths.PrivateDirectory, "create_file", broken)
    with pytest.raises(OSError, match="disk fell off"):
        OffloadedAdam(_params(), device="nvme", path=tmp_path)
    assert os.listdir(tmp_path) == []
