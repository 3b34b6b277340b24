"""NVMe offload directories of killed processes are removed by the next run in the same path;
those of live processes and of other hosts are left alone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from lightning_3d.offload.paths import DIR_PREFIX, PrivateDirectory, remove_stale


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_processs_offload_directory_is_removed_on_the_next_start(tmp_path):
    host = socket.gethostname()
    stale = tmp_path / f"{DIR_PREFIX}{host}-{_dead_pid()}-abc123"
    live = tmp_path / f"{DIR_PREFIX}{host}-{os.getpid()}-def456"
    elsewhere = tmp_path / f"{DIR_PREFIX}other-host-{_dead_pid()}-ghi789"
    unrelated = tmp_path / "my-data"
    for directory in (stale, live, elsewhere, unrelated):
        directory.mkdir()
        (directory / "optimizer_state.bin").write_bytes(b"x" * 64)
    scratch = PrivateDirectory(tmp_path)
    try:
        assert not stale.exists()
        assert live.exists() and elsewhere.exists() and unrelated.exists()
        assert os.path.basename(scratch.path).startswith(f"{DIR_PREFIX}{host}-{os.getpid()}-")
        assert remove_stale(tmp_path) == []  # its own directory is a live process's
    finally:
        scratch.close()
    assert not os.path.exists(scratch.path)


def test_a_sigkilled_run_leaves_a_directory_that_the_next_one_cleans(tmp_path):
    code = (
        "import os, signal, sys; from lightning_3d.offload.paths import PrivateDirectory; "
        "d = PrivateDirectory(sys.argv[1]); d.create_file('optimizer_state.bin', 1024); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False)
    left = [p for p in tmp_path.iterdir() if p.name.startswith(DIR_PREFIX)]
    assert len(left) == 1 and (left[0] / "optimizer_state.bin").exists()  # SIGKILL: no clean-up
    PrivateDirectory(tmp_path).close()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(DIR_PREFIX)] == []
