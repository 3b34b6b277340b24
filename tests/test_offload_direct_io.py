"""NVMe offload with direct I/O (``O_DIRECT``): the same bytes and the same Adam steps as buffered
I/O, every file offset, length and buffer aligned, a clean fallback where the file system refuses,
and read-ahead as deep as the window allows."""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import threading
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

from lightning_3d.offload import FileChunkStore, OffloadedAdam, storage
from lightning_3d.offload import optimizer as offload_optimizer
from lightning_3d.offload import paths as offload_paths
from lightning_3d.offload.storage import DIRECT_IO_ALIGNMENT

ODD = [1, 1023, 1024, 1025, 3001, 7]  # elements: none but 1024 fill whole 4 KiB blocks


def _accepts_direct(path) -> bool:
    try:
        FileChunkStore(path, [1], direct_io=True).close()
    except ValueError:
        return False
    return True


@pytest.fixture
def direct_dir(tmp_path):
    """A directory whose file system accepts O_DIRECT: pytest's, else one under /var/tmp."""
    if _accepts_direct(tmp_path):
        yield tmp_path
        return
    if os.path.isdir("/var/tmp") and _accepts_direct("/var/tmp"):
        with tempfile.TemporaryDirectory(dir="/var/tmp") as path:
            yield path
        return
    pytest.skip(
        f"neither {tmp_path} nor /var/tmp accepts O_DIRECT (tmpfs before Linux 6.6, or not Linux)"
    )


def _fill_and_step(store: FileChunkStore) -> list[torch.Tensor]:
    """Write seeded data, change it through stream(), and read every segment back."""
    gen = torch.Generator().manual_seed(0)
    for i, n in enumerate(store.segment_numels):
        store.write(i, torch.randn(n, generator=gen))
    for index, segment in store.stream(range(len(store.segment_numels))):
        segment.mul_(1.5).add_(index)
    for _index, segment in store.stream(reversed(range(len(store.segment_numels)))):
        segment.sub_(0.25)
    return [store.read(i) for i in range(len(store.segment_numels))]


def _file_segments(store: FileChunkStore) -> list[torch.Tensor]:
    """Each segment as the file holds it, read through an ordinary (buffered) descriptor."""
    with open(store.file_path, "rb") as f:
        raw = f.read()
    return [
        torch.frombuffer(bytearray(raw[o : o + 4 * n]), dtype=torch.float32)
        for o, n in zip(store.file_offsets, store.segment_numels)
    ]


def test_direct_and_buffered_store_the_same_bits(direct_dir, tmp_path):
    direct = FileChunkStore(direct_dir, ODD, direct_io=True)
    buffered = FileChunkStore(tmp_path, ODD, direct_io=False)
    assert direct.direct_io and not buffered.direct_io
    # The buffered descriptor it was created with is closed.
    assert direct.directory._fds == [direct._fd]
    got_direct, got_buffered = _fill_and_step(direct), _fill_and_step(buffered)
    assert [t.numel() for t in got_direct] == ODD
    assert all(torch.equal(a, b) for a, b in zip(got_direct, got_buffered))
    # what the file holds at the recorded offsets is what read() returns, in both layouts
    assert all(torch.equal(a, b) for a, b in zip(_file_segments(direct), got_direct))
    assert all(torch.equal(a, b) for a, b in zip(_file_segments(buffered), got_buffered))
    # Buffered: packed.
    assert os.path.getsize(buffered.file_path) == buffered.nbytes == 4 * sum(ODD)
    # 1025: 2 blocks, 3001: 3.
    assert os.path.getsize(direct.file_path) == direct.file_bytes == DIRECT_IO_ALIGNMENT * 9
    direct.close(), buffered.close()


def test_direct_io_aligns_every_offset_length_and_buffer(direct_dir, monkeypatch):
    calls = []

    def recorder(real):
        def io(fd, view, offset):
            calls.append((np.frombuffer(view, dtype=np.uint8).ctypes.data, len(view), offset))
            return real(fd, view, offset)

        return io

    monkeypatch.setattr(storage, "_read_exact", recorder(storage._read_exact))
    monkeypatch.setattr(storage, "_write_exact", recorder(storage._write_exact))
    store = FileChunkStore(direct_dir, ODD, window=3, direct_io=True)
    got = _fill_and_step(store)
    assert len(calls) == 2 + len(ODD) * (1 + 2 * 2 + 1)  # probe; write(), two streams, read()
    assert all(
        a % DIRECT_IO_ALIGNMENT == 0
        and n % DIRECT_IO_ALIGNMENT == 0
        and o % DIRECT_IO_ALIGNMENT == 0
        for a, n, o in calls
    ), [c for c in calls if any(x % DIRECT_IO_ALIGNMENT for x in c)]
    assert sorted({o for _, _, o in calls}) == store.file_offsets
    # 3 buffers of 3001 padded.
    assert store.resident_state_bytes_peak == 3 * 3 * DIRECT_IO_ALIGNMENT
    assert [t.numel() for t in got] == ODD
    store.close()


def test_refused_open_falls_back_to_buffered_io(tmp_path, monkeypatch, caplog):
    def refuse(self, name, flags):
        raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs answers to O_DIRECT

    monkeypatch.setattr(offload_paths.PrivateDirectory, "reopen", refuse)
    reference = FileChunkStore(tmp_path, ODD, direct_io=False)
    with caplog.at_level(logging.INFO, logger=storage.__name__):
        store = FileChunkStore(tmp_path, ODD)  # auto
    assert not store.direct_io and store.alignment == 4
    assert [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()] == [
        f"offload path {str(tmp_path)!r} refuses O_DIRECT ([Errno 22] Invalid argument): "
        "optimizer state goes through the page cache"
    ]
    assert os.path.getsize(store.file_path) == store.nbytes  # the packed layout, no padding
    assert all(torch.equal(a, b) for a, b in zip(_fill_and_step(store), _fill_and_step(reference)))
    store.close(), reference.close()
    with pytest.raises(
        ValueError,
        match=rf"direct_io=True, but the file system of offload path '{tmp_path}' "
        r"refuses O_DIRECT: \[Errno 22\]",
    ):
        FileChunkStore(tmp_path, ODD, direct_io=True)
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_refused_first_io_closes_the_direct_descriptor_and_falls_back(direct_dir, monkeypatch):
    real, refused = storage._read_exact, []

    def read(fd, view, offset):
        if not refused:  # the probe: some file systems open with O_DIRECT, then refuse the I/O
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, view, offset)

    monkeypatch.setattr(storage, "_read_exact", read)
    store = FileChunkStore(direct_dir, ODD)
    assert not store.direct_io and refused and refused[0] != store._fd
    assert store.directory._fds == [store._fd]  # the probed descriptor is closed, not leaked
    monkeypatch.setattr(storage, "_read_exact", real)
    reference = FileChunkStore(direct_dir, ODD, direct_io=False)
    assert all(torch.equal(a, b) for a, b in zip(_fill_and_step(store), _fill_and_step(reference)))
    store.close(), reference.close()


def _adam_run(path, direct_io, monkeypatch) -> tuple[list[torch.Tensor], dict]:
    forced = lambda *args, **kwargs: FileChunkStore(*args, **{**kwargs, "direct_io": direct_io})  # noqa: E731
    monkeypatch.setattr(offload_optimizer, "FileChunkStore", forced)
    gen = torch.Generator().manual_seed(1)
    params = [nn.Parameter(torch.randn(n, generator=gen)) for n in (1000, 333, 77, 4099)]
    # 120-element chunks.
    opt = OffloadedAdam(params, lr=1e-2, device="nvme", path=path, chunk_bytes=1000)
    assert opt._store.direct_io is direct_io
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    state = opt.state_dict()
    opt.close()
    return [p.detach().clone() for p in params], state


def test_offloaded_adam_steps_identically_with_direct_io_on_and_off(
    direct_dir, tmp_path, monkeypatch
):
    on_params, on_state = _adam_run(direct_dir, True, monkeypatch)
    off_params, off_state = _adam_run(tmp_path, False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(on_params, off_params))
    assert on_state["state"].keys() == off_state["state"].keys()
    for i, s in off_state["state"].items():
        assert all(torch.equal(on_state["state"][i][k], v) for k, v in s.items())
    ref_gen = torch.Generator().manual_seed(1)  # and both equal torch's own fused AdamW
    ref = [nn.Parameter(torch.randn(n, generator=ref_gen)) for n in (1000, 333, 77, 4099)]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for _ in range(3):
        for p in ref:
            p.grad = torch.randn(p.shape, generator=ref_gen)
        ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(on_params, ref))


@pytest.mark.parametrize("direct_io", [False, "auto"])
@pytest.mark.parametrize("window", [3, 4])
def test_every_free_buffer_reads_ahead(tmp_path, direct_io, window):
    store = FileChunkStore(tmp_path, [16] * 6, window=window, direct_io=direct_io)
    loaded = [threading.Event() for _ in range(6)]
    load = store._load
    store._load = lambda i, buffer: (load(i, buffer), loaded[i].set())[0]
    for index, segment in store.stream(range(6)):
        segment.fill_(index + 1)
        for ahead in range(1, window):  # window - 1 reads land while this chunk is computed
            if index + ahead < 6:
                assert loaded[index + ahead].wait(5), (index, ahead)
        # No buffer is overwritten early.
        assert not any(e.is_set() for e in loaded[index + window :])
    assert [store.read(i)[0].item() for i in range(6)] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    store.close()


def test_window_of_two_still_streams_correctly(tmp_path):
    store = FileChunkStore(tmp_path, ODD, window=2)
    reference = FileChunkStore(tmp_path, ODD, window=3, direct_io=False)
    assert all(torch.equal(a, b) for a, b in zip(_fill_and_step(store), _fill_and_step(reference)))
    store.close(), reference.close()


def test_bad_direct_io_value_and_repeated_indices_are_refused(tmp_path):
    for bad in ("yes", 1, None):
        with pytest.raises(
            ValueError, match=rf"direct_io must be 'auto', True or False, got {bad!r}"
        ):
            FileChunkStore(tmp_path, ODD, direct_io=bad)
    assert os.listdir(tmp_path) == []  # refused before anything was created
    store = FileChunkStore(tmp_path, ODD)
    with pytest.raises(ValueError, match=r"visits each segment once, got indices \[0, 1, 0\]"):
        list(store.stream([0, 1, 0]))
    store.close()


@pytest.mark.parametrize("value, mode", [(None, "auto"), (False, False)])
def test_the_strategy_option_reaches_the_nvme_store(value, mode, tmp_path, monkeypatch):
    """``offload_direct_io`` (Hydra ``offload.direct_io``) through the plan and the recipe to the
    store of a one-process fit: ``None`` is the store's "auto"."""
    from tools.harness.runs import Run, fit_gpt

    seen = []
    real = storage.FileChunkStore.__init__

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("direct_io"))
        real(self, *args, **kwargs)

    monkeypatch.setattr(storage.FileChunkStore, "__init__", spy)
    options = {
        "offload": "nvme",
        "offload_path": str(tmp_path),
        "offload_chunk_mb": 0.01,
        "offload_direct_io": value,
    }
    # The in-process fit sets MASTER_PORT: later apps must not inherit it.
    with mock.patch.dict(os.environ):
        try:
            result = fit_gpt(0, Run(strategy=options, devices=1, steps=1))
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    assert seen == [mode]
    assert all(loss == loss for loss in result["losses"])
