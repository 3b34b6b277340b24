"""Checkpoint integrity: checksums recorded at save, verified at every read, and exports that
never write onto their input.

Two small checkpoints are written by 2-process ZeRO-2 runs (one epoch, 2 steps): a consolidated
``.ckpt`` and a sharded directory. Bytes are then flipped in the middle of a weight's data (found
by searching the file for the tensor's own bytes, so the test does not trust the checksum
records it checks), and every reader must refuse the copy naming the file and the tensor:
``load_lightning_checkpoint``, ``load_pretrained``, the CLI and ``trainer.fit(ckpt_path=...)``
on 2 ranks. Without checksums each of these loads the damaged weight silently.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from lightning_3d.checkpoint import integrity, sharded
from lightning_3d.checkpoint.__main__ import main as cli
from lightning_3d.checkpoint.checks import inspect_checkpoint, load_lightning_checkpoint
from lightning_3d.checkpoint.io import AtomicCheckpointIO
from lightning_3d.checkpoint.pretrained import load_pretrained
from lightning_3d.models import LitGPT
from lightning_3d.testing.runs import TINY_MODEL, Run, fit_layout

SEED = 1234
DATA = {"max_bytes": 1000, "val_fraction": 0.3}  # 2 steps of 8 per epoch
WEIGHT = "model.blocks.0.mlp.fc1.weight"  # a weight whose bytes are unique in the file
LAYOUTS = {"consolidated": {"zero_stage": 2}, "sharded": {"zero_stage": 2, "checkpoint_format": "sharded"}}


def _run(strategy, save_to=None, resume_from=None, world=2):
    steps, trainer = (4, {}) if resume_from else (-1, {"max_epochs": 1})
    run = Run(strategy=strategy, steps=steps, seed=SEED, data=DATA, trainer=trainer, save_to=save_to,
              resume_from=resume_from)
    return fit_layout(run, world)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Format ("consolidated", "sharded", "plain": Lightning's own TorchCheckpointIO) → path."""
    paths = {}
    for name, strategy in [*LAYOUTS.items(), ("plain", None)]:
        path = tmp_path_factory.mktemp(name) / "epoch0.ckpt"
        assert len(_run(strategy, save_to=str(path))["losses"]) == 2 and path.exists()
        paths[name] = path
    return paths


def _copy(source: Path, target: Path) -> Path:
    (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
    return target


def _flip(path: Path, tensor: torch.Tensor) -> Path:
    """Invert 4 bytes in the middle of ``tensor``'s data inside ``path`` (a file, or the data
    files of a sharded directory); returns the file changed."""
    needle = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    for file in sorted(path.glob("*.distcp")) if path.is_dir() else [path]:
        data = bytearray(file.read_bytes())
        at = data.find(needle)
        if at >= 0:
            middle = at + len(needle) // 2
            data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
            file.write_bytes(bytes(data))
            return file
    raise AssertionError(f"the bytes of the tensor were not found in {path}")


@pytest.fixture(scope="module")
def flipped(saved, tmp_path_factory):
    """Format → (damaged copy, the file whose bytes were flipped)."""
    out = {}
    for name in LAYOUTS:
        weight = load_lightning_checkpoint(saved[name])["state_dict"][WEIGHT]
        copy = _copy(saved[name], tmp_path_factory.mktemp(f"flipped_{name}") / "epoch0.ckpt")
        out[name] = copy, _flip(copy, weight)
    return out


def _digest(path: Path) -> str:
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    return hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()


def _cli_error(capsys, *args) -> str:
    assert cli(list(map(str, args))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


# ------------------------------------------------------------------------------ recorded
def test_every_tensor_and_shard_item_has_a_checksum(saved):
    ckpt = torch.load(saved["consolidated"], map_location="cpu", weights_only=True)
    recorded = ckpt[integrity.KEY]["tensors"]
    assert {name for name, _ in integrity.tensors_in(ckpt)} == set(recorded)
    assert f"state_dict.{WEIGHT}" in recorded and any(n.startswith("optimizer_states.0.state.") for n in recorded)
    directory = saved["sharded"]
    items = torch.load(directory / sharded.META_FILE, weights_only=True)[integrity.KEY]["items"]
    assert len(items) == len(sharded.read_metadata(directory).storage_data)
    assert {item[2] for item in items} == {"__0_0.distcp", "__1_0.distcp"}  # each rank checksummed its own


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_intact_checkpoint_loads_verified(saved, name, capsys):
    checkpoint = load_lightning_checkpoint(saved[name])
    assert integrity.KEY not in checkpoint and checkpoint["global_step"] == 2
    assert inspect_checkpoint(saved[name])["verified"] > 0
    assert cli(["inspect", str(saved[name])]) == 0 and " verified" in capsys.readouterr().out


# ------------------------------------------------------------------------------ refused
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flipped_bytes_are_refused_naming_file_and_tensor(saved, flipped, name, tmp_path, capsys):
    copy, file = flipped[name]
    intact = load_lightning_checkpoint(saved[name])["state_dict"][WEIGHT]
    damaged = load_lightning_checkpoint(copy, verify=None)["state_dict"][WEIGHT]  # what loaded before
    assert not torch.equal(damaged, intact)
    message = f"{file}: checksum mismatch in tensor (state_dict.)?{WEIGHT}"
    with pytest.raises(ValueError, match=message):
        load_lightning_checkpoint(copy)
    with pytest.raises(ValueError, match=message):
        inspect_checkpoint(copy)
    with pytest.raises(ValueError, match=message):
        load_pretrained(LitGPT(**TINY_MODEL), copy)
    out = tmp_path / "gpt.safetensors"
    for command in ("consolidate", "export"):
        err = _cli_error(capsys, command, copy, out)
        assert str(file) in err and WEIGHT in err and "checksum mismatch" in err
    assert not out.exists()
    assert WEIGHT in _cli_error(capsys, "inspect", copy)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_from_flipped_bytes_is_refused(flipped, name):
    copy, file = flipped[name]
    with pytest.raises(RuntimeError, match=f"checksum mismatch in tensor (state_dict.)?{WEIGHT}") as error:
        _run(LAYOUTS[name], resume_from=str(copy))
    assert str(file) in str(error.value)


# ------------------------------------------------------------------------------ old files
def _without_checksums(source: Path, target: Path) -> Path:
    copy = _copy(source, target)
    file = copy / sharded.META_FILE if copy.is_dir() else copy
    checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    del checkpoint[integrity.KEY]
    torch.save(checkpoint, file)
    return copy


@pytest.mark.parametrize("name", [*LAYOUTS, "plain"])
def test_checkpoint_without_checksums_loads_with_a_warning(saved, name, tmp_path, capsys):
    path = saved[name] if name == "plain" else _without_checksums(saved[name], tmp_path / "old.ckpt")
    with pytest.warns(UserWarning, match="has no checksums"):
        checkpoint = load_lightning_checkpoint(path)
    assert checkpoint["global_step"] == 2
    with pytest.warns(UserWarning, match="has no checksums"):
        assert inspect_checkpoint(path)["verified"] == -1
    capsys.readouterr()
    assert cli(["consolidate", str(path), str(tmp_path / "gpt.safetensors")]) == 0
    err = capsys.readouterr().err  # said once, on one line
    assert err.count("\n") == 1 and err.startswith("warning: ") and "has no checksums" in err, err


def test_slimmed_checkpoint_loads_and_edited_values_are_refused(tmp_path):
    """Removing tensors (the optimizer state) is no damage; changing one without dropping the
    record is refused, saying how to keep a deliberate edit."""
    weights = {"w": torch.arange(4.0)}
    AtomicCheckpointIO().save_checkpoint(
        {"state_dict": weights, "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(4)}}}]}, tmp_path / "a.ckpt")
    checkpoint = torch.load(tmp_path / "a.ckpt", weights_only=True)
    del checkpoint["optimizer_states"]
    torch.save(checkpoint, tmp_path / "slim.ckpt")
    assert torch.equal(load_lightning_checkpoint(tmp_path / "slim.ckpt")["state_dict"]["w"], weights["w"])
    checkpoint["state_dict"]["w"] += 1
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    with pytest.raises(ValueError, match=r"edited.ckpt: checksum mismatch in tensor state_dict.w .*delete its "
                                         r"'checksums' entry"):
        load_lightning_checkpoint(tmp_path / "edited.ckpt")


def test_resume_from_a_sharded_checkpoint_without_checksums(saved, tmp_path):
    old = _without_checksums(saved["sharded"], tmp_path / "old.ckpt")
    assert len(_run(LAYOUTS["sharded"], resume_from=str(old))["losses"]) == 2


# ------------------------------------------------------------------------------ no overwrite
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_exports_never_write_onto_their_input(saved, name, tmp_path, capsys):
    path = saved[name]
    before = _digest(path)
    for command in ("consolidate", "export"):
        assert "is the checkpoint" in _cli_error(capsys, command, path, path, "--force")
    assert "contains the checkpoint" in _cli_error(capsys, "export-hf", path, path.parent, "--force")
    if path.is_dir():
        err = _cli_error(capsys, "consolidate", path, path / "gpt.safetensors", "--force")
        assert "is inside the checkpoint" in err
    else:
        alias = tmp_path / "alias.ckpt"
        os.link(path, alias)  # the same file under another name
        assert "is the checkpoint" in _cli_error(capsys, "export", path, alias, "--force")
    assert _digest(path) == before
