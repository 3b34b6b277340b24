"""``resume=last|PATH`` through the Hydra app, as a user runs it: a run cut after K steps and
resumed to N equals the run that went through N steps in one go (per-step losses, final weights),
in one process and (``-m slow``) resumed on two ranks; a resumed run resumed again (M) equals it
too; ``resume=last`` with nothing to resume is one ``error:`` line, exit code 2 and no run
directory.

The uninterrupted run ``A`` saves no checkpoint; ``B1`` stops at K (its ``trainer.max_steps``)
and leaves ``last.ckpt`` at step K (a periodic save, every K steps); ``B2`` is started in the
same working directory with ``resume=last`` and stops at M; ``B3`` resumes B2's ``last.ckpt``
(its last-step save) to N. A saved data position that forgets the offset its run resumed from
(``data/resumable.py`` counting from the resumed batch, not from the epoch's start) is caught
here: B3 would see B2's batches again. ``model.max_steps`` pins the LR schedule's horizon
to N in every part, as one run's schedule would be. Each part runs in its own working directory
so that ``resume=last`` (the newest checkpoint under ``./outputs``) sees only its own history.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tools.harness.apps import compose_config, start_app, wait_all

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train.py"
N, M, K = 6, 4, 2
TINY = [
    "model=gpt_tiny",
    "data.batch_size=4",
    "data.max_bytes=100000",
    "trainer.limit_val_batches=0",
    f"model.max_steps={N}",
]
TIMEOUT = 400


def _describe(proc):
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def _run_dirs(cwd: Path) -> list[Path]:
    """The app's run directories under ``cwd/outputs`` (``outputs/<date>/<time>[-n]``), oldest first."""
    return sorted((cwd / "outputs").glob("*/*"))


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def _step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A (N steps in one go), B1 (K steps) and resume=last with no earlier run at once; then B2
    (resume=last to M) and B3 (resume=last to N) in B1's working directory. Returns the working directories and the
    finished processes."""
    cwd = {name: tmp_path_factory.mktemp(name) for name in ("a", "b", "no_run")}
    first = {
        "a": start_app(
            SCRIPT,
            [*TINY, "trainer.devices=1", f"trainer.max_steps={N}", "checkpoint.every_n_steps=null"],
            cwd["a"],
        ),
        "b1": start_app(
            SCRIPT,
            [*TINY, "trainer.devices=1", f"trainer.max_steps={K}", f"checkpoint.every_n_steps={K}"],
            cwd["b"],
        ),
        "no_run": start_app(SCRIPT, [*TINY, "trainer.devices=1", "resume=last"], cwd["no_run"]),
    }
    done = wait_all(first, timeout=TIMEOUT)
    assert done["b1"].returncode == 0, _describe(done["b1"])
    for name, steps in (("b2", M), ("b3", N)):
        done.update(
            wait_all(
                {
                    name: start_app(
                        SCRIPT,
                        [*TINY, "trainer.devices=1", f"trainer.max_steps={steps}", "resume=last"],
                        cwd["b"],
                    )
                },
                timeout=TIMEOUT,
            )
        )
        assert done[name].returncode == 0, _describe(done[name])
    return cwd, done


def test_resume_last_continues_exactly_as_the_uninterrupted_run(runs):
    cwd, done = runs
    assert done["a"].returncode == 0, _describe(done["a"])
    (a_dir,) = _run_dirs(cwd["a"])
    b1_dir, b2_dir, b3_dir = _run_dirs(cwd["b"])
    assert not (a_dir / "last.ckpt").exists()  # checkpoint.every_n_steps=null: none
    for name, previous in (("b2", b1_dir), ("b3", b2_dir)):  # resume=last found the newest
        output = done[name].stdout + done[name].stderr
        assert f"Restoring states from the checkpoint path at {previous / 'last.ckpt'}" in output
    full = _summary(a_dir)["losses"]
    parts = [_summary(d)["losses"] for d in (b1_dir, b2_dir, b3_dir)]
    assert [len(p) for p in parts] == [
        K,
        M - K,
        N - M,
    ]  # each part trained only its remaining steps
    assert parts[0] + parts[1] + parts[2] == pytest.approx(full, rel=1e-6, abs=0)
    a, b = _weights(a_dir / "final.ckpt"), _weights(b3_dir / "final.ckpt")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)
    # each resumed run checkpoints into its own directory (at its last step), the earlier files untouched
    assert [_step(d / "last.ckpt") for d in (b1_dir, b2_dir, b3_dir)] == [K, M, N]


@pytest.mark.slow
def test_resume_last_on_two_ranks_continues_the_one_process_run(runs, tmp_path):
    """B1's run directory alone under a fresh ``./outputs``, resumed on dp2 (global batch
    unchanged): the launcher resolves ``last`` once and hands both ranks that file; the same
    losses and weights as A up to the reduction order."""
    cwd, done = runs
    (a_dir,) = _run_dirs(cwd["a"])
    b1_dir = _run_dirs(cwd["b"])[0]
    b1_copy = tmp_path / "outputs" / b1_dir.parent.name / b1_dir.name
    shutil.copytree(b1_dir, b1_copy)
    proc = wait_all(
        {
            "b2": start_app(
                SCRIPT,
                [*TINY, "trainer.devices=2", f"trainer.max_steps={N}", "resume=last"],
                tmp_path,
            )
        },
        timeout=TIMEOUT,
    )["b2"]
    assert proc.returncode == 0, _describe(proc)
    assert (
        f"Restoring states from the checkpoint path at {b1_copy / 'last.ckpt'}"
        in proc.stdout + proc.stderr
    )
    b2_dir = _run_dirs(tmp_path)[-1]
    resumed = _summary(b2_dir)
    assert resumed["layout"]["world_size"] == 2 and len(resumed["losses"]) == N - K
    assert resumed["losses"] == pytest.approx(_summary(a_dir)["losses"][K:], rel=1e-5)
    a, b = _weights(a_dir / "final.ckpt"), _weights(b2_dir / "final.ckpt")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


def test_resume_last_without_an_earlier_run_is_refused_before_any_rank_starts(runs):
    """(A missing resume=PATH and +ckpt_path: the bad-value table of tests/test_cli_errors.py.)"""
    cwd, done = runs
    proc = done["no_run"]
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, _describe(proc)
    assert "Traceback" not in output and "Initializing distributed" not in output, _describe(proc)
    error_lines = [line for line in output.splitlines() if "error:" in line.lower()]
    assert len(error_lines) == 1, _describe(proc)
    assert error_lines[0].startswith("error: resume=last: no last.ckpt or preempted.ckpt under"), (
        _describe(proc)
    )
    assert _run_dirs(cwd["no_run"]) == []  # no run directory left behind


def test_a_checkpoint_of_another_model_is_refused_before_any_rank_starts(runs):
    """validate() compares the checkpoint's names and shapes with the model built on meta (no
    tensor data read): B1's gpt_tiny checkpoint does not fit n_embd=64."""
    from lightning_3d.app.run import validate

    cwd, _ = runs
    checkpoint = _run_dirs(cwd["b"])[0] / "last.ckpt"
    validate(compose_config("train", *TINY, "trainer.devices=1", f"resume={checkpoint}"))  # fits
    with pytest.raises(
        ValueError,
        match=r"the checkpoint does not match the model: shape mismatch .*"
        r"checkpoint \(32, 32\) vs model \(64, 64\)",
    ):
        validate(
            compose_config(
                "train", *TINY, "model.n_embd=64", "trainer.devices=1", f"resume={checkpoint}"
            )
        )


# ------------------------------------------------------------------ in process: what "last" is
def _touch(path: Path, mtime: float, sharded: bool = False) -> Path:
    if sharded:
        path.mkdir(parents=True)
        (path / ".metadata").write_bytes(b"x")
        for entry in (path / ".metadata", path):
            os.utime(entry, (mtime, mtime))
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        os.utime(path, (mtime, mtime))
    return path


def test_last_is_the_newest_checkpoint_of_the_apps_own_runs(tmp_path):
    from lightning_3d.checkpoint.resume import newest_checkpoint

    runs = tmp_path / "outputs"
    _touch(runs / "2026-11-30" / "10-00-00" / "last.ckpt", 1000)
    preempted = _touch(runs / "2026-11-30" / "11-00-00" / "preempted.ckpt", 3000)
    _touch(runs / "2026-11-30" / "11-00-00" / "last.ckpt", 2000)
    _touch(runs / "2026-11-30" / "11-00-00" / "final.ckpt", 9000)  # not a resume point
    _touch(
        runs / "2026-11-30" / "12-00-00" / "last.ckpt" / "stray.txt", 8000
    )  # a directory, not a checkpoint
    tuned = _touch(runs / "finetune" / "2026-11-30" / "12-00-00" / "last.ckpt", 5000)
    assert newest_checkpoint(runs, skip="finetune") == preempted
    assert newest_checkpoint(runs / "finetune") == tuned
    sharded = _touch(runs / "2026-12-01" / "09-00-00" / "last.ckpt", 4000, sharded=True)
    assert newest_checkpoint(runs, skip="finetune") == sharded
    assert newest_checkpoint(tmp_path / "nothing") is None


def test_resume_last_of_each_app_is_its_own_newest_run(tmp_path, monkeypatch):
    """Catches: ``examples/finetune.py resume=last`` looking in the training app's runs
    (``outputs/<date>/<time>``) instead of its own (``outputs/finetune/...``), so a fine-tune
    resumed the newer pretraining run; and the reverse for ``examples/train.py``. Through
    ``read_spec``, where the apps resolve ``resume=`` (fake checkpoints: only found, not read)."""
    from lightning_3d.app.spec import read_spec

    monkeypatch.chdir(tmp_path)
    outputs = tmp_path / "outputs"
    trained = _touch(outputs / "2026-11-30" / "12-00-00" / "last.ckpt", 3000)
    tuned = _touch(outputs / "finetune" / "2026-11-30" / "10-00-00" / "last.ckpt", 1000)

    def last_of(app: str) -> Path:
        return read_spec(compose_config(app, "model=gpt_tiny", "resume=last")).resume

    assert last_of("finetune") == tuned.resolve()  # older than the pretraining run: still its own
    assert last_of("train") == trained.resolve()
    newer_tuned = _touch(outputs / "finetune" / "2026-12-01" / "09-00-00" / "preempted.ckpt", 5000)
    assert last_of("train") == trained.resolve()  # a newer fine-tune run is not the train app's
    assert last_of("finetune") == newer_tuned.resolve()


def test_resume_values_are_checked_in_the_launching_process(tmp_path, monkeypatch):
    """validate() names the value: last with no earlier run, a safetensors export (weights only),
    a directory that is not a checkpoint, the file ``last`` found when it is not a checkpoint.
    (A missing path and +ckpt_path: tests/test_cli_errors.py.)"""
    from lightning_3d.app.run import validate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(len(b"{}").to_bytes(8, "little") + b"{}")
    (tmp_path / "plain_dir").mkdir()
    for value, named in (
        ("last", "resume=last: no last.ckpt or preempted.ckpt under"),
        ("model.safetensors", "holds weights only (safetensors)"),
        ("plain_dir", "is a directory but not a checkpoint"),
    ):
        with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
            validate(compose_config("train", "model=gpt_tiny", f"resume={value}"))
    found = _touch(
        tmp_path / "outputs" / "2026-11-30" / "10-00-00" / "last.ckpt", 1000
    )  # not a real checkpoint
    with pytest.raises(ValueError, match=f"resume={found}: .* is neither a Lightning checkpoint"):
        validate(compose_config("train", "model=gpt_tiny", "trainer.devices=1", "resume=last"))


def test_a_stopped_run_names_the_checkpoint_to_resume_from(tmp_path):
    """What the fault messages (a lost peer, a non-finite stop) offer: the newest checkpoint the
    run wrote, else the one it resumed from itself; outside the apps, the Lightning call."""
    from types import SimpleNamespace

    from lightning_3d.runtime.resume_hint import resume_hint, written_checkpoint

    trainer = SimpleNamespace(
        checkpoint_callback=SimpleNamespace(dirpath=str(tmp_path)),
        default_root_dir="/elsewhere",
        ckpt_path=None,
    )
    assert written_checkpoint(trainer) is None and written_checkpoint(None) is None
    trainer.ckpt_path = (
        "/runs/a/last.ckpt"  # resumed, nothing saved yet: that file is still the newest state
    )
    assert written_checkpoint(trainer) == Path("/runs/a/last.ckpt")
    _touch(tmp_path / "last.ckpt", 1000)
    preempted = _touch(tmp_path / "preempted.ckpt", 2000)
    assert written_checkpoint(trainer) == preempted
    assert resume_hint(preempted) == f"resume with trainer.fit(..., ckpt_path={str(preempted)!r})"
    assert resume_hint(None) == "resume with trainer.fit(..., ckpt_path='last')"


def test_inside_an_app_the_resume_hint_is_its_command_line():
    """What the app hands the stop messages (``resume_command``, around a rank's run): its command
    line with ``resume=<checkpoint>``; outside the block, the Lightning call again."""
    from lightning_3d.runtime.resume_hint import resume_command, resume_hint

    checkpoint = Path("/runs/a b/preempted.ckpt")
    with resume_command(["python", "examples/train.py", "trainer.max_steps=5"]):
        assert resume_hint(checkpoint) == (
            "resume with: python examples/train.py trainer.max_steps=5 "
            "'resume=/runs/a b/preempted.ckpt'"
        )
        assert resume_hint(None).startswith("this run wrote no checkpoint to resume from")
    assert resume_hint(None) == "resume with trainer.fit(..., ckpt_path='last')"


def test_the_resume_hint_names_the_app_as_it_was_typed(tmp_path, monkeypatch):
    """``python -m lightning_3d.app.train``, a console script ``PATH`` finds, ``python
    examples/train.py``: the three ways to start the training app, each named as typed (a rank
    started with ``-m`` once named ``python lightning_3d/app/train.py``, a file in the package)."""
    import sys
    from types import ModuleType, SimpleNamespace

    from lightning_3d.app.launch import typed_command

    main = ModuleType("__main__")
    main.__spec__ = SimpleNamespace(name="lightning_3d.app.train")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "lightning_3d/app/train.py")])
    assert typed_command() == ["python", "-m", "lightning_3d.app.train"]
    main.__spec__ = None
    script = tmp_path / "bin" / "lightning3d-train"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(script.parent))
    monkeypatch.setattr(sys, "argv", [str(script)])
    assert typed_command() == ["lightning3d-train"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "examples" / "train.py")])
    assert typed_command() == ["python", "examples/train.py"]
