"""Every failure reaches the user as one ``error:`` line from the launching process, with the exit
code of its kind (``lightning_3d/runtime/exit_codes.py``), no traceback on the terminal (the ranks'
tracebacks go to ``<run dir>/ranks.log``, named in that line).

A full disk and a read-only one are real: small tmpfs mounts (root only; skipped elsewhere).
Before: a sharded save on a full disk printed some 250 lines of per-rank ``CheckpointException``
and no ``error:`` line (rc 1); a consolidated one ``OSError: No space left on device`` without the
file; a run directory where Hydra cannot write its files said ``error: bad command line`` (rc 2).
Seen failing with the launcher's report (``launch._reported``), the rank's record
(``app._reporting``) and the OSError lookup in ``cli.hydra_app`` each edited out.
"""

from __future__ import annotations

import errno
import re
import signal
import subprocess
import sys
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_3d.runtime.exit_codes import IO_ERROR, PEER_LOST
from tools.harness.apps import start_app, wait_all

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train.py"
TINY = [
    "model=gpt_tiny",
    "data.batch_size=4",
    "data.max_bytes=100000",
    "trainer.limit_val_batches=0",
    "trainer.max_steps=2",
]


def _tmpfs(tmp_path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted with ``options`` for the test, unmounted after it (skipped unless root)."""
    path = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}): needs root")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB file system: room for Hydra's files and the lock, not for a checkpoint."""
    yield from _tmpfs(tmp_path, "size=256k")


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path, "ro,size=64k")


def _one_error(done: subprocess.CompletedProcess) -> str:
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-4000:]
    return errors[0]


@pytest.mark.parametrize(
    "devices, layout",
    [  # dp2 ~35 s: the fast suite digs without processes
        pytest.param(2, "sharded", marks=pytest.mark.slow),
        (1, "consolidated"),
    ],
)
def test_a_save_on_a_full_disk_is_one_line_naming_the_file(disk, tmp_path, devices, layout):
    run_dir = disk / "run"
    app = start_app(
        SCRIPT,
        [
            *TINY,
            f"trainer.devices={devices}",
            f"parallelism.checkpoint_format={layout}",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    done = wait_all({"app": app}, timeout=300)["app"]
    assert done.returncode == IO_ERROR, done.stderr[-4000:]
    line = _one_error(done)
    assert "no space left on device" in line and str(run_dir / "last.ckpt") in line, line
    assert "rank 0" in line, line
    assert str(run_dir / "ranks.log") in line and "Errno 28" in (run_dir / "ranks.log").read_text()
    assert len(done.stderr.splitlines()) < 40, done.stderr  # the ranks' tracebacks are in the log
    assert "lightning_3d: rank" not in done.stderr, done.stderr  # said once, in the error: line


def test_a_run_directory_where_hydra_cannot_write_is_named_as_such(read_only, tmp_path):
    run_dir = read_only / "run"
    app = start_app(SCRIPT, [*TINY, "trainer.devices=1", f"hydra.run.dir={run_dir}"], tmp_path)
    done = wait_all({"app": app}, timeout=120)["app"]
    assert done.returncode == IO_ERROR, done.stderr[-4000:]
    line = _one_error(done)
    assert "read-only file system" in line and str(run_dir) in line, line


@pytest.mark.parametrize("mount", ["disk", "read_only"])
def test_consolidate_onto_a_full_or_read_only_disk_is_one_line_and_no_file(
    request, tmp_path, mount
):
    """Before: a ``SafetensorError`` traceback and rc 1 on a full disk; on a read-only one the
    temporary file named, rc 2."""
    import torch

    target = request.getfixturevalue(mount)
    if mount == "disk":  # full to the last block: the export's header is refused at once
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={target / 'filler'}", "bs=4k"], capture_output=True
        )
    source = tmp_path / "in.ckpt"
    torch.save({"state_dict": {"model.w": torch.randn(128, 128)}, "global_step": 1}, source)
    before = sorted(p.name for p in target.iterdir())
    output = target / "w.safetensors"
    command = [
        sys.executable,
        "-m",
        "lightning_3d.checkpoint",
        "consolidate",
        str(source),
        str(output),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == IO_ERROR, done.stderr
    line = _one_error(done)
    cause = "no space left on device" if mount == "disk" else "read-only file system"
    assert line.startswith(f"error: {cause}: {output}; "), line
    assert sorted(p.name for p in target.iterdir()) == before  # no partial file, no temporary


def _hf_checkpoint(path: Path) -> Path:
    """A consolidated checkpoint of a tiny ``HFCausalLM`` (what ``export-hf`` takes)."""
    import torch

    from lightning_3d.models.hf import HF_CONFIG_KEY, HFCausalLM
    from tools.harness.hf_configs import tiny_hf_config

    module = HFCausalLM(config=tiny_hf_config("llama"))
    torch.save(
        {
            "state_dict": module.state_dict(),
            "hyper_parameters": dict(module.hparams),
            HF_CONFIG_KEY: module.model.config.to_dict(),
            "global_step": 1,
        },
        path,
    )
    return path


def _export_hf(source: Path, output: Path, *before: str) -> subprocess.CompletedProcess:
    command = [
        *before,
        sys.executable,
        "-m",
        "lightning_3d.checkpoint",
        "export-hf",
        str(source),
        str(output),
    ]
    return subprocess.run(
        command, capture_output=True, text=True, cwd=REPO, timeout=300, check=False
    )


@pytest.mark.parametrize("mount", ["disk", "read_only"])
def test_export_hf_onto_a_full_or_read_only_disk_is_one_line_and_no_file(request, tmp_path, mount):
    """Before: exit 3 already, but the line named no path on a full disk, and the temporary
    directory instead of the output on a read-only one."""
    pytest.importorskip("transformers")
    target = request.getfixturevalue(mount)
    if mount == "disk":  # full to the last block
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={target / 'filler'}", "bs=4k"], capture_output=True
        )
    source = _hf_checkpoint(tmp_path / "in.ckpt")
    before = sorted(p.name for p in target.iterdir())
    output = target / "hf"
    done = _export_hf(source, output)
    assert done.returncode == IO_ERROR, done.stderr
    line = _one_error(done)
    cause = "no space left on device" if mount == "disk" else "read-only file system"
    assert line.startswith(f"error: {cause}: {output}; "), line
    assert sorted(p.name for p in target.iterdir()) == before  # no partial file, no temporary


def test_export_hf_into_a_directory_this_user_may_not_write_is_one_line_and_no_file(tmp_path):
    """Not root, or root without the capability to ignore file modes (``setpriv``): the
    permission a user meets. Before: the temporary directory named instead of the output."""
    import os
    import shutil

    pytest.importorskip("transformers")
    before: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root ignores file modes, and setpriv is not here to drop that")
        before = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    source = _hf_checkpoint(tmp_path / "in.ckpt")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    output = locked / "hf"
    try:
        done = _export_hf(source, output, *before)
    finally:
        locked.chmod(0o755)  # so that pytest can remove it
    assert done.returncode == IO_ERROR, done.stderr
    line = _one_error(done)
    assert line.startswith(f"error: permission denied: {output}; "), line
    assert list(locked.iterdir()) == []  # no partial file, no temporary


# Put in a rank's path as sitecustomize: rank 1 does ACTION once, at its second step.
_RANK_ONE_AT_STEP_TWO = """
import os, signal
if os.environ.get("RANK") == "1" and os.environ.get("LIGHTNING3D_LAUNCHER_PID"):
    from lightning.pytorch.loops import training_epoch_loop as loop
    advance = loop._TrainingEpochLoop.advance
    done = []
    def _advance(self, *args, **kwargs):
        if self.global_step >= 1 and not done:
            done.append(1)
            ACTION
        return advance(self, *args, **kwargs)
    loop._TrainingEpochLoop.advance = _advance
"""


def _dp2_where_rank_one(
    tmp_path: Path, action: str, *overrides: str
) -> tuple[Path, subprocess.CompletedProcess]:
    """The app on two ranks, rank 1 doing ``action`` (a Python statement) at its second step:
    the run directory and the launcher's finished process."""
    import os

    from tools.harness.apps import app_env

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_RANK_ONE_AT_STEP_TWO.replace("ACTION", action))
    env = app_env()
    env["PYTHONPATH"] = os.pathsep.join([str(hook), str(REPO), env.get("PYTHONPATH", "")])
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        str(SCRIPT),
        *TINY,
        "trainer.devices=2",
        "trainer.max_steps=5",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    return run_dir, subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_a_rank_that_exits_without_a_word_is_named_not_the_peer_that_lost_it(tmp_path):
    """Rank 0 fails its collective (a lost peer, exit 4) because rank 1 exited with code 7 and
    no report (``os._exit``: as a rank whose process the OS or a library ended): the line names
    rank 1 and the launcher exits 7. Before: rank 0's traceback and 'a collective failed' on
    the terminal. Seen failing without the launcher's silent-rank record (the line named rank
    0's lost peer, exit 4)."""
    run_dir, proc = _dp2_where_rank_one(tmp_path, "os._exit(7)")
    assert proc.returncode == 7, proc.stderr[-4000:]
    line = _one_error(proc)
    assert line.startswith("error: rank 1 exited with code 7 without saying why"), line
    assert "rank(s) 0 failed too" in line and str(run_dir / "ranks.log") in line, line
    assert "a collective failed" in (run_dir / "ranks.log").read_text()


@pytest.mark.slow  # ~30 s (dp2); the fast suite checks the launcher's report without processes
def test_a_killed_rank_is_named_and_the_peers_that_lost_it_are_logged(tmp_path):
    """Rank 1 SIGKILLed: one line naming it, exit 137, and rank 0's failed collective (its
    gloo traceback) in ranks.log. Seen failing without the killed rank's record in
    ``launch._reported``: no ranks.log (the launcher returned 137 without collecting the
    survivors' reports)."""
    run_dir, proc = _dp2_where_rank_one(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-4000:]
    line = _one_error(proc)
    assert re.match(r"error: rank 1 \(pid \d+\) was killed by SIGKILL", line), line
    assert "rank(s) 0 failed too" in line and str(run_dir / "ranks.log") in line, line
    log = (run_dir / "ranks.log").read_text()
    assert "=== rank 0 (exit code 4)" in log and "Traceback" in log, log[-4000:]
    assert "lightning_3d: rank" not in proc.stderr, proc.stderr[-4000:]  # said in the log


@pytest.mark.slow  # ~35 s (dp2, a 5 s timeout); the fast suite checks the report without processes
def test_a_lost_peer_is_exit_code_4_naming_the_rank_that_stalled(tmp_path):
    """Rank 1 stops (SIGSTOP: its sockets stay open, so rank 0's collective waits): within
    ``parallelism.timeout_s`` rank 0's collective times out and its watchdog names rank 1;
    the launcher exits 4 (a lost peer: relaunch and resume) with one line naming rank 1. Seen
    failing without the strategy putting the watchdog's verdict first: exit 4, but the line
    said only 'rank 0: a collective failed ... Another rank has probably stopped'."""
    run_dir, proc = _dp2_where_rank_one(
        tmp_path, "os.kill(os.getpid(), signal.SIGSTOP)", "parallelism.timeout_s=5"
    )
    assert proc.returncode == PEER_LOST, proc.stderr[-4000:]
    line = _one_error(proc)
    assert line.startswith("error: rank 0: rank 1 has not made progress for"), line
    assert str(run_dir / "ranks.log") in line, line
    assert "a collective failed" in (run_dir / "ranks.log").read_text()


def test_the_launcher_names_a_killed_rank_before_the_peers_that_lost_it(tmp_path, capsys):
    """No processes: the launcher's report once rank 1 was SIGKILLed and rank 0 lost it, the
    same whichever exit it saw first; a rank the launcher killed itself is not the cause."""
    import json

    from torch.distributed import HashStore

    from lightning_3d.app.launch import _reported
    from lightning_3d.app.rank_report import KEY, record_of

    store = HashStore()
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:9")
    store.set(KEY.format(rank=0), json.dumps(record_of(lost, 0)))
    for first in (PEER_LOST, 128 + signal.SIGKILL):
        assert (
            _reported(store, str(tmp_path), first, [PEER_LOST, -signal.SIGKILL], set(), [100, 101])
            == 128 + signal.SIGKILL
        )
        line = _one_error(subprocess.CompletedProcess([], 0, "", capsys.readouterr().err))
        assert line.startswith("error: rank 1 (pid 101) was killed by SIGKILL"), line
        assert f"rank(s) 0 failed too (tracebacks: {tmp_path / 'ranks.log'})" in line, line
    assert "Connection closed by peer" in (tmp_path / "ranks.log").read_text()
    assert (
        _reported(store, str(tmp_path), PEER_LOST, [PEER_LOST, -signal.SIGKILL], {1}, [100, 101])
        == PEER_LOST
    )  # killed past its grace, by the launcher
    assert capsys.readouterr().err.startswith("error: rank 0: RuntimeError: [gloo")


def test_the_os_error_inside_a_checkpoint_exception_is_found_and_named(tmp_path):
    """No processes: what a sharded save raises on a full disk (torch wraps each rank's error)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from lightning_3d.runtime.failures import exit_code_of, naming_path

    full = OSError(errno.ENOSPC, "No space left on device")  # raised at close: no file named
    wrapped = CheckpointException(
        "save failed",
        {
            1: (RuntimeError("unexpected pos 704 vs 598"), traceback.StackSummary()),
            0: (full, traceback.StackSummary()),
        },
    )
    assert exit_code_of(wrapped) == IO_ERROR
    with pytest.raises(OSError) as raised:
        with naming_path(tmp_path / "last.ckpt"):
            raise wrapped
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.filename == str(tmp_path / "last.ckpt")
