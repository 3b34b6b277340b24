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
import re
from pathlib import Path

import pytest
import torch

from lightning_3d.checkpoint import integrity, sharded_files
from lightning_3d.checkpoint.__main__ import main as cli
from lightning_3d.checkpoint.checks import inspect_checkpoint, load_lightning_checkpoint
from lightning_3d.checkpoint.io import AtomicCheckpointIO
from lightning_3d.checkpoint.pretrained import load_pretrained
from lightning_3d.models import LitGPT
from support.damage import bump_pickled_int, copy_checkpoint, flip_byte, flip_in_tensor
from tools.harness.runs import TINY_MODEL, Run, fit_layout

SEED = 1234
DATA = {"max_bytes": 1000, "val_fraction": 0.3}  # 2 steps of 8 per epoch
WEIGHT = "model.blocks.0.mlp.fc1.weight"  # a weight whose bytes are unique in the file
LAYOUTS = {
    "consolidated": {"zero_stage": 2},
    "sharded": {"zero_stage": 2, "checkpoint_format": "sharded"},
}


def _run(strategy, save_to=None, resume_from=None, world=2):
    steps, trainer = (4, {}) if resume_from else (-1, {"max_epochs": 1})
    run = Run(
        strategy=strategy,
        steps=steps,
        seed=SEED,
        data=DATA,
        trainer=trainer,
        save_to=save_to,
        resume_from=resume_from,
    )
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


@pytest.fixture(scope="module")
def flipped(saved, tmp_path_factory):
    """Format → (damaged copy, the file whose bytes were flipped)."""
    out = {}
    for name in LAYOUTS:
        weight = load_lightning_checkpoint(saved[name])["state_dict"][WEIGHT]
        copy = copy_checkpoint(
            saved[name], tmp_path_factory.mktemp(f"flipped_{name}") / "epoch0.ckpt"
        )
        out[name] = copy, flip_in_tensor(copy, weight)
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
    assert f"state_dict.{WEIGHT}" in recorded and any(
        n.startswith("optimizer_states.0.state.") for n in recorded
    )
    directory = saved["sharded"]
    items = torch.load(directory / sharded_files.META_FILE, weights_only=True)[integrity.KEY][
        "items"
    ]
    assert len(items) == len(sharded_files.read_metadata(directory).storage_data)
    # Each rank checksummed its own.
    assert {item[2] for item in items} == {"__0_0.distcp", "__1_0.distcp"}


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
    # What loaded before.
    damaged = load_lightning_checkpoint(copy, verify=None)["state_dict"][WEIGHT]
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
    with pytest.raises(
        RuntimeError, match=f"checksum mismatch in tensor (state_dict.)?{WEIGHT}"
    ) as error:
        _run(LAYOUTS[name], resume_from=str(copy))
    assert str(file) in str(error.value)


def _refused_everywhere(copy: Path, match: str, tmp_path: Path, capsys) -> None:
    """Every one-process reader refuses ``copy`` with ``match``: load, inspect, load_pretrained,
    and the CLI's consolidate / export (one error line, nothing written); export-hf, for
    Hugging Face checkpoints: tests/test_export_hf.py."""
    for read in (
        load_lightning_checkpoint,
        inspect_checkpoint,
        lambda p: load_pretrained(LitGPT(**TINY_MODEL), p),
    ):
        with pytest.raises(ValueError, match=match):
            read(copy)
    for command, out in (
        ("consolidate", tmp_path / "a.safetensors"),
        ("export", tmp_path / "b.safetensors"),
    ):
        assert re.search(match, _cli_error(capsys, command, copy, out)), command
        assert not out.exists(), command


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_flipped_mantissa_bit_is_refused_by_every_reader(saved, name, tmp_path, capsys):
    """The smallest damage: one unit in the last place of one float. Broken variant caught (seen
    failing): ``integrity.tensor_crc`` over the values cast to bytes (``.to(torch.uint8)``)
    instead of their bytes (``.view``): the cast drops the low bits, the damage loads."""
    weight = load_lightning_checkpoint(saved[name])["state_dict"][WEIGHT]
    copy = copy_checkpoint(saved[name], tmp_path / "bit.ckpt")
    file = flip_in_tensor(copy, weight, one_bit=True)
    damaged = load_lightning_checkpoint(copy, verify=None)["state_dict"][WEIGHT]
    assert (damaged != weight).sum() == 1 and torch.allclose(damaged, weight, rtol=1e-6, atol=0)
    _refused_everywhere(
        copy,
        f"{re.escape(str(file))}: checksum mismatch in tensor (state_dict.)?{WEIGHT}",
        tmp_path,
        capsys,
    )


def _optimizer_tensor(path: Path) -> torch.Tensor:
    state = load_lightning_checkpoint(path)["optimizer_states"][0]["state"]
    return max((v["exp_avg"] for v in state.values()), key=lambda t: t.numel())


def _damage_optimizer_state(path: Path) -> str:
    flip_in_tensor(path, _optimizer_tensor(path))
    return "checksum mismatch in tensor"


def _damage_pickle(path: Path) -> str:
    """``global_step`` 2 -> 3 in the pickle of the ``.ckpt`` (of ``meta.pt`` when sharded): it
    still unpickles, so only the zip record's CRC tells."""
    assert (
        bump_pickled_int(path / sharded_files.META_FILE if path.is_dir() else path, "global_step")
        == 3
    )
    return "corrupted or truncated checkpoint file .*Bad CRC-32"


def _damage_index(path: Path) -> str:
    """A byte of DCP's ``.metadata`` (the index of where each tensor's bytes are)."""
    flip_byte(path / ".metadata", -40)
    return r"\.metadata"


def _drop_a_record(path: Path) -> str:
    """One tensor's checksum record deleted (the rest of the checkpoint intact)."""
    file = path / sharded_files.META_FILE if path.is_dir() else path
    checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    record = checkpoint[integrity.KEY]
    if path.is_dir():
        record["items"] = [item for item in record["items"] if item[0] != f"state_dict.{WEIGHT}"]
    else:
        del record["tensors"][f"state_dict.{WEIGHT}"]
    torch.save(checkpoint, file)
    return rf"tensors without a checksum: \['(state_dict.)?{re.escape(WEIGHT)}'"


DAMAGE = {  # what is damaged -> (formats it applies to, how)
    "optimizer_state": (("consolidated", "sharded"), _damage_optimizer_state),
    "pickled_metadata": (("consolidated", "sharded"), _damage_pickle),
    "tensor_index": (("sharded",), _damage_index),
    "missing_record": (("consolidated", "sharded"), _drop_a_record),
}
CASES = [(kind, name) for kind, (names, _) in DAMAGE.items() for name in names]


@pytest.mark.parametrize("kind, name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_damage_to_each_kind_of_file_is_refused(saved, kind, name, tmp_path):
    """Each file a checkpoint holds (tensor data with weights and optimizer state, the pickled
    metadata, DCP's index) and a deleted checksum record: the full read refuses, naming what.
    Broken variants caught (seen failing): ``files.check_records`` not called (global_step 3
    loads), ``check_tensors`` / ``verify_items`` not reporting unrecorded tensors."""
    copy = copy_checkpoint(saved[name], tmp_path / "damaged.ckpt")
    match = DAMAGE[kind][1](copy)
    with pytest.raises(ValueError, match=match):
        load_lightning_checkpoint(copy)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_from_damaged_optimizer_state_is_refused(saved, name, tmp_path):
    """The optimizer state is read by a resume only: it must be verified there too."""
    copy = copy_checkpoint(saved[name], tmp_path / "damaged.ckpt")
    _damage_optimizer_state(copy)
    with pytest.raises(RuntimeError, match="checksum mismatch in tensor optimizer_states"):
        _run(LAYOUTS[name], resume_from=str(copy))


# ------------------------------------------------------------------------------ old files
def _without_checksums(source: Path, target: Path) -> Path:
    copy = copy_checkpoint(source, target)
    file = copy / sharded_files.META_FILE if copy.is_dir() else copy
    checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    del checkpoint[integrity.KEY]
    torch.save(checkpoint, file)
    return copy


@pytest.mark.parametrize("name", [*LAYOUTS, "plain"])
def test_checkpoint_without_checksums_loads_with_a_warning(saved, name, tmp_path, capsys):
    path = (
        saved[name] if name == "plain" else _without_checksums(saved[name], tmp_path / "old.ckpt")
    )
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
        {"state_dict": weights, "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(4)}}}]},
        tmp_path / "a.ckpt",
    )
    checkpoint = torch.load(tmp_path / "a.ckpt", weights_only=True)
    del checkpoint["optimizer_states"]
    torch.save(checkpoint, tmp_path / "slim.ckpt")
    assert torch.equal(
        load_lightning_checkpoint(tmp_path / "slim.ckpt")["state_dict"]["w"], weights["w"]
    )
    checkpoint["state_dict"]["w"] += 1
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    with pytest.raises(
        ValueError,
        match=r"edited.ckpt: checksum mismatch in tensor state_dict.w .*delete its "
        r"'checksums' entry",
    ):
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
    assert "contains the checkpoint" in _cli_error(
        capsys, "export-hf", path, path.parent, "--force"
    )
    if path.is_dir():
        err = _cli_error(capsys, "consolidate", path, path / "gpt.safetensors", "--force")
        assert "is inside the checkpoint" in err
    else:
        alias = tmp_path / "alias.ckpt"
        os.link(path, alias)  # the same file under another name
        assert "is the checkpoint" in _cli_error(capsys, "export", path, alias, "--force")
    assert _digest(path) == before
