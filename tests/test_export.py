"""Safetensors export, pretrained loading, checkpoint checks and atomic saves (plain unit + one
single-process Trainer run; subprocesses for the CLI, a torch-only reader and a killed save)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from safetensors.torch import load_file

from lightning_3d.checkpoint.__main__ import main as cli
from lightning_3d.checkpoint.checks import check_against, inspect_checkpoint
from lightning_3d.checkpoint.files import remove_stale_temps
from lightning_3d.checkpoint.io import AtomicCheckpointIO
from lightning_3d.checkpoint.pretrained import load_pretrained
from lightning_3d.data import TextDataModule
from lightning_3d.models import LitGPT
from lightning_3d.models.gpt import GPT

TINY = {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32}


def _fit(root: Path, module: LitGPT, ckpt_path: str | None = None) -> L.Trainer:
    """Plain Lightning, 2 steps, checkpoints in root/ckpts (ModelCheckpoint(save_last=True))."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
        plugins=[AtomicCheckpointIO()],
        callbacks=[ModelCheckpoint(root / "ckpts", save_last=True)],
    )
    datamodule = TextDataModule(corpus="stdlib", block_size=32, batch_size=8, max_bytes=400_000)
    trainer.fit(module, datamodule, ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """LitGPT after 2 AdamW steps, its last.ckpt (written by AtomicCheckpointIO) and a batch."""
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    lit = LitGPT(**TINY)
    assert _fit(root, lit).global_step == 2
    batch = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = lit.eval()(batch)
    return {
        "root": root,
        "lit": lit,
        "ckpt": root / "ckpts" / "last.ckpt",
        "batch": batch,
        "logits": logits,
    }


def _same_outputs(module: torch.nn.Module, trained: dict) -> bool:
    with torch.no_grad():
        return torch.equal(module.eval()(trained["batch"]), trained["logits"])


_KILLED_SAVER = textwrap.dedent("""
    import os, sys, time, torch
    from lightning_3d.checkpoint.io import AtomicCheckpointIO
    class Stalling:  # a file that takes 2 MiB, then stalls: the save is caught in the middle
        def __init__(self, f): self.f, self.written = f, 0
        def flush(self): self.f.flush()
        def write(self, data):
            if self.written >= 2 << 20:
                self.f.flush(); os.fsync(self.f.fileno()); time.sleep(300); sys.exit(1)
            self.written += self.f.write(data)
            return len(data)
    class StallingIO(AtomicCheckpointIO):
        def write(self, checkpoint, file): torch.save(checkpoint, Stalling(file))
    source, target = sys.argv[1:3]
    AtomicCheckpointIO().save_checkpoint(torch.load(source, weights_only=True), target)
    print("first saved", flush=True)
    StallingIO().save_checkpoint({"state_dict": {f"w{i}": torch.randn(1 << 18) for i in range(16)}}, target)
""")


@pytest.fixture(scope="module")
def killed_save(trained: dict) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A subprocess that saves last.ckpt, then stalls in the middle of a second save; started
    before the CLI's subprocess so that the two interpreter starts overlap. Killed by the test."""
    target = trained["root"] / "killed" / "ckpts" / "last.ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVER, str(trained["ckpt"]), str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc, target
    proc.kill()
    proc.communicate()


@pytest.fixture(scope="module")
def exported(trained: dict, killed_save: tuple) -> Path:
    """The CLI run in a real subprocess (``python -m lightning_3d.checkpoint consolidate``)."""
    out = trained["root"] / "gpt.safetensors"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_3d.checkpoint",
            "consolidate",
            str(trained["ckpt"]),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    n_params = sum(p.numel() for p in trained["lit"].parameters())
    assert f"wrote 20 tensors ({n_params:,} parameters, {out.stat().st_size:,} bytes" in done.stdout
    assert str(out) in done.stdout and "'model.' stripped" in done.stdout
    return out


# ----------------------------------------------------------------------- export and loading
_TORCH_ONLY_READER = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import load_file
    weights = load_file(sys.argv[1])
    state = torch.load(sys.argv[2], map_location="cpu", weights_only=True)["state_dict"]
    assert sorted("model." + k for k in weights) == sorted(state), (sorted(weights), sorted(state))
    assert all(torch.equal(tensor, state["model." + name]) for name, tensor in weights.items())
    assert not any(m == "lightning" or m.startswith(("lightning.", "lightning_3d")) for m in sys.modules)
    print("equal", len(weights))
""")


def test_export_reads_with_torch_and_safetensors_only(trained: dict, exported: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _TORCH_ONLY_READER, str(exported), str(trained["ckpt"])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["equal", "20"]


def test_exported_weights_load_into_plain_gpt(trained: dict, exported: Path) -> None:
    gpt = GPT(trained["lit"].config)
    gpt.load_state_dict(load_file(exported), strict=True)
    assert _same_outputs(gpt, trained)
    info = inspect_checkpoint(exported)
    assert info["format"] == "safetensors" and info["metadata"]["stripped_prefix"] == "model."
    assert info["num_params"] == sum(p.numel() for p in gpt.parameters())
    assert exported.stat().st_mode & 0o777 != 0o600  # not safetensors' private temp-file mode
    info = inspect_checkpoint(trained["ckpt"])
    assert (info["format"], info["global_step"], info["has_optimizer_states"]) == (
        "lightning",
        2,
        True,
    )
    assert info["shapes"]["model.tok_emb.weight"] == (256, 32)
    # No temp file left by the Trainer's saves.
    assert not list((trained["root"] / "ckpts").glob(".*"))


def test_load_pretrained_round_trips(trained: dict, exported: Path) -> None:
    torch.manual_seed(5)
    fresh = LitGPT(**TINY)
    assert not _same_outputs(fresh, trained)
    # "tok_emb.weight" -> "model.tok_emb..."
    assert load_pretrained(fresh, exported) == list(fresh.state_dict())
    assert _same_outputs(fresh, trained)
    gpt = GPT(trained["lit"].config)  # .ckpt -> plain module: "model." dropped
    assert load_pretrained(gpt, trained["ckpt"])[0] == "tok_emb.weight" and _same_outputs(
        gpt, trained
    )
    explicit = LitGPT(**TINY)
    assert len(load_pretrained(explicit, trained["ckpt"], prefix="model.")) == 20 and _same_outputs(
        explicit, trained
    )


# ------------------------------------------------------------------------------ bad input
def _bad_files(trained: dict, tmp_path: Path, exported: Path) -> dict[Path, str]:
    """bad file → expected message."""
    data, st = trained["ckpt"].read_bytes(), exported.read_bytes()
    contents = {
        "truncated.ckpt": data[: len(data) // 2],
        "truncated.safetensors": st[:-100],
        "bad_header.safetensors": (5).to_bytes(8, "little") + b"{oops",
        "empty": b"",
        "text.txt": b"hello, this is not a checkpoint\n",
    }
    for name, content in contents.items():
        (tmp_path / name).write_bytes(content)
    torch.save({"weights": torch.ones(2)}, tmp_path / "plain.pt")
    torch.save({"state_dict": {}, "hook": print}, tmp_path / "pickled.pt")
    return {
        **{tmp_path / name: "corrupted or truncated" for name in contents if name != "text.txt"},
        tmp_path / "text.txt": "neither a Lightning checkpoint",
        tmp_path / "plain.pt": "no 'state_dict' entry",
        tmp_path / "pickled.pt": "refusing to unpickle",
        tmp_path: "is a directory",
    }


def test_bad_files_are_refused_before_loading(
    trained: dict, exported: Path, tmp_path: Path
) -> None:
    fresh = LitGPT(**TINY)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    for path, message in _bad_files(trained, tmp_path, exported).items():
        with pytest.raises(ValueError, match=message) as error:
            load_pretrained(fresh, path)
        assert str(path) in str(error.value)
        with pytest.raises(ValueError, match=message):
            inspect_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="checkpoint not found: .*missing.ckpt"):
        load_pretrained(fresh, tmp_path / "missing.ckpt")
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_checkpoint_of_another_model(trained: dict, exported: Path) -> None:
    other = LitGPT(**{**TINY, "n_layer": 3, "n_embd": 64})
    before = {k: v.clone() for k, v in other.state_dict().items()}
    for path in (exported, trained["ckpt"]):
        with pytest.raises(ValueError) as error:
            load_pretrained(other, path)
        text = str(error.value)
        assert text.startswith(
            f"{path} does not match the model: missing from the checkpoint (8): model.blocks.2."
        )
        assert "model.tok_emb.weight: checkpoint (256, 32) vs model (256, 64)" in text
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    with pytest.raises(ValueError, match="unexpected in the checkpoint \\(1\\): extra"):
        check_against({"a": (2,)}, {"a": (2,), "extra": (1,)})
    check_against({"a": (2,), "b": (3,)}, {"a": (2,)}, strict=False)  # partial load allowed
    with pytest.raises(ValueError, match="no names in common"):
        check_against({"a": (2,)}, {"b": (2,)}, strict=False)
    with torch.device("meta"):
        on_meta = LitGPT(**TINY)
    with pytest.raises(ValueError, match="meta device"):
        load_pretrained(on_meta, exported)


def test_cli_refuses_overwrite_and_reports_errors(
    trained: dict, exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ckpt, out, other = (
        str(trained["ckpt"]),
        tmp_path / "w.safetensors",
        str(tmp_path / "x.safetensors"),
    )
    assert cli(["consolidate", ckpt, str(out)]) == 0
    first = out.read_bytes()
    assert cli(["consolidate", ckpt, str(out)]) == 2 and out.read_bytes() == first
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("already exists; pass --force (force=True) to overwrite it")
    )
    assert cli(["consolidate", ckpt, str(out), "--force", "--prefix", ""]) == 0
    assert "model.tok_emb.weight" in load_file(out)
    for args, message in [
        ([str(tmp_path / "nope.ckpt"), other], "checkpoint not found"),
        ([str(exported), other], "is a safetensors file, not a Lightning checkpoint"),
        ([ckpt, other, "--prefix", "net."], "'net.' is not on every name"),
        ([ckpt, str(tmp_path)], "is a directory"),
    ]:
        assert cli(["consolidate", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not Path(other).exists()
    with pytest.raises(SystemExit) as exit_:
        cli(["consolidate", ckpt])  # argparse's own error, same one-line form and code
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith("error: ")


# --------------------------------------------------------------------------- atomic saves
def test_kill_during_save_keeps_last_checkpoint(trained: dict, killed_save: tuple) -> None:
    proc, target = killed_save
    assert proc.stdout.readline().strip() == "first saved", proc.stderr.read()
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    temp, deadline = target.parent / f".last.ckpt.tmp-{proc.pid}", time.monotonic() + 60
    while not (temp.exists() and temp.stat().st_size >= 2 << 20):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert temp.stat().st_size >= 2 << 20  # the half-written bytes are under the temp name only
    assert hashlib.sha256(target.read_bytes()).hexdigest() == digest
    original = torch.load(trained["ckpt"], weights_only=True)
    reloaded = AtomicCheckpointIO().load_checkpoint(target)
    assert reloaded["global_step"] == original["global_step"] == 2
    assert all(torch.equal(v, reloaded["state_dict"][k]) for k, v in original["state_dict"].items())

    # Lightning's own "last" resolution (ModelCheckpoint(save_last=True) layout) sees the first save only.
    resumed = LitGPT(**TINY)
    # Step 2 = max_steps: restore, no training.
    trainer = _fit(target.parent.parent, resumed, ckpt_path="last")
    resolved = trainer._checkpoint_connector._parse_ckpt_path(
        TrainerFn.FITTING, "last", model_provided=True, model_connected=True
    )
    assert Path(resolved) == target and trainer.global_step == 2 and _same_outputs(resumed, trained)

    AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, target.parent / "next.ckpt")
    assert not temp.exists()  # the killed save's temp file is cleaned up by the next save


def test_atomic_io_refusals_and_failed_save(trained: dict, tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    with pytest.raises(ValueError, match="weights only"):
        io.load_checkpoint(trained["ckpt"], weights_only=False)
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        io.load_checkpoint(tmp_path / "none.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, tmp_path / "a.ckpt", storage_options={"x": 1})

    class Failing(AtomicCheckpointIO):
        def write(self, checkpoint: dict, file: object) -> None:
            file.write(b"partial")
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        Failing().save_checkpoint({}, tmp_path / "a.ckpt")
    assert list(tmp_path.iterdir()) == []  # no final file, no temp file


def test_stale_temp_rules(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    # Writer gone; ours but older than us.
    stale = [f".a.ckpt.tmp-{dead.pid}", f".b.ckpt.tmp-{os.getpid()}"]
    # Ours in flight; live writer; not a temp.
    kept = [f".c.ckpt.tmp-{os.getpid()}", ".d.ckpt.tmp-1", "e.ckpt"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"x")
    os.utime(tmp_path / stale[1], (0, 0))
    assert sorted(p.name for p in remove_stale_temps(tmp_path)) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
