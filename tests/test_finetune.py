"""``examples/finetune.py`` end to end: pretrain with examples/train.py, fine-tune from its
final.ckpt (NVMe offload) and from a safetensors export (CPU offload), and bad inputs.

Every process pays ~10 s of imports, so only four subprocesses run, two at a time; the
preset's composition and the pretrained-file checks are tested in this process.
"""

import json
import os
import time
from pathlib import Path

import pytest
import torch

from lightning_3d.app.finetune import resolve_pretrained
from lightning_3d.checkpoint.__main__ import main as checkpoint_cli
from tools.harness.apps import start_app, wait_all

REPO = Path(__file__).resolve().parents[1]
TRAIN, FINETUNE = str(REPO / "examples/train.py"), str(REPO / "examples/finetune.py")
# Tiny model and corpus, one process; the preset's offload, checkpointing and bf16 stay on.
SMALL = [
    "model=gpt_tiny",
    "trainer.devices=1",
    "data.batch_size=8",
    "data.max_bytes=300000",
    "trainer.limit_val_batches=2",
]
PRETRAIN_STEPS = 30  # enough for the byte statistics: the loss falls from ln(256) = 5.55 to ~3.6


def _describe(proc):
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All subprocess runs, in two waves of two; returns (results, paths)."""
    root = tmp_path_factory.mktemp("finetune")
    project, nvme = root / "project", root / "nvme"
    project.mkdir()
    nvme.mkdir()
    paths = {
        "root": root,
        "project": project,
        "nvme": nvme,
        "pretrain": project / "outputs/day/pretrain",
        "run_missing": root / "run_missing",
        "run_nvme": root / "run_nvme",
        "run_cpu": root / "run_cpu",
        "safetensors": root / "gpt.safetensors",
    }
    # Wave 1: the pretraining run, and a bad input.
    results = wait_all(
        timeout=240,
        procs={
            "pretrain": start_app(
                TRAIN,
                [
                    *SMALL,
                    f"trainer.max_steps={PRETRAIN_STEPS}",
                    f"hydra.run.dir={paths['pretrain']}",
                ],
                project,
            ),
            "missing": start_app(
                FINETUNE,
                [
                    *SMALL,
                    f"finetune.pretrained={root / 'nope.ckpt'}",
                    f"hydra.run.dir={paths['run_missing']}",
                ],
                project,
            ),
        },
    )
    assert results["pretrain"].returncode == 0, _describe(results["pretrain"])
    assert (
        checkpoint_cli(
            ["consolidate", str(paths["pretrain"] / "final.ckpt"), str(paths["safetensors"])]
        )
        == 0
    )
    fine = [*SMALL, "trainer.max_steps=3"]
    # Wave 2: from the pretraining run's final.ckpt (finetune.pretrained=latest, the preset's
    # default: cwd is the project) to NVMe, and from the safetensors export to CPU.
    results.update(
        wait_all(
            timeout=240,
            procs={
                "nvme": start_app(
                    FINETUNE,
                    [
                        *fine,
                        "offload=nvme",
                        f"offload.path={nvme}",
                        f"hydra.run.dir={paths['run_nvme']}",
                    ],
                    project,
                ),
                "cpu": start_app(
                    FINETUNE,
                    [
                        *fine,
                        f"finetune.pretrained={paths['safetensors']}",
                        "offload=cpu",
                        f"hydra.run.dir={paths['run_cpu']}",
                    ],
                    project,
                ),
            },
        )
    )
    return results, paths


@pytest.mark.parametrize("offload", ["nvme", "cpu"])
def test_finetune_loads_pretrained_weights(runs, offload):
    results, paths = runs
    assert results[offload].returncode == 0, _describe(results[offload])
    run_dir = paths[f"run_{offload}"]
    summary, scratch = _summary(run_dir), _summary(paths["pretrain"])
    assert summary["steps"] == 3 and len(summary["losses"]) == 3
    assert summary["offload"]["device"] == offload
    assert summary["layout"]["precision"] == "bf16-mixed" and summary["layout"]["world_size"] == 1
    expected = paths["safetensors"] if offload == "cpu" else paths["pretrain"] / "final.ckpt"
    assert summary["pretrained"] == str(expected.resolve())
    # Step 1's loss is measured before any fine-tuning update: far below a fresh model's
    # (the pretraining run's first loss, ~ln 256).
    assert summary["losses"][0] < scratch["losses"][0] - 1.0, (summary["losses"], scratch["losses"])
    assert (run_dir / "final.ckpt").is_file()


def test_finetune_same_start_from_ckpt_and_safetensors(runs):
    _, paths = runs
    nvme, cpu = _summary(paths["run_nvme"]), _summary(paths["run_cpu"])
    # Same weights (one file exported from the other), data and seed: the same first loss.
    assert cpu["losses"][0] == pytest.approx(nvme["losses"][0], abs=1e-5)


def test_nvme_private_directory_removed(runs):
    results, paths = runs
    assert results["nvme"].returncode == 0, _describe(results["nvme"])
    assert list(paths["nvme"].iterdir()) == []


def test_missing_pretrained_is_one_error_line(runs):
    results, paths = runs
    proc = results["missing"]
    assert proc.returncode == 2, _describe(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, _describe(proc)
    assert "checkpoint not found" in errors[0] and "nope.ckpt" in errors[0]
    assert not paths["run_missing"].exists(), "a refused run left its run directory behind"


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from lightning_3d.app.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("finetune", overrides=overrides)


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_preset_and_offload_overrides(offload):
    from lightning_3d.app.config import build_strategy

    cfg = _compose([f"offload={offload}"])
    assert (
        cfg.trainer.devices == 1
        and cfg.trainer.precision == "bf16-mixed"
        and cfg.data.corpus == "docs"
    )
    assert cfg.finetune.pretrained == "latest"
    strategy = build_strategy(cfg.parallelism, cfg.offload)
    assert strategy.plan.offload.device == offload and strategy.plan.ac.policy == "full"


@pytest.mark.parametrize("case", ["not_a_checkpoint", "other_model", "damaged"])
def test_bad_pretrained_refused_before_work(runs, case, tmp_path):
    """``damaged``: one flipped mantissa bit in a weight of the pretraining run's final.ckpt is
    refused by the launcher's check (``inspect_checkpoint`` verifies the checksums); safetensors
    files carry no checksums of their own, so only their header is checked."""
    from lightning_3d.app.finetune import prepare
    from support.damage import copy_checkpoint, flip_in_tensor

    _, paths = runs
    text = paths["root"] / "not_a_checkpoint.txt"
    text.write_text("hello\n")
    if case == "not_a_checkpoint":
        cfg, match = (
            _compose(["model=gpt_tiny", f"finetune.pretrained={text}"]),
            "neither a Lightning checkpoint",
        )
    else:  # the tiny model's checkpoint against a wider model, built on meta
        cfg = _compose(
            [
                "model=gpt_tiny",
                "model.n_embd=64",
                f"finetune.pretrained={paths['pretrain']}/final.ckpt",
            ]
        )
        match = "does not match the model.*shape mismatch"
    if case == "damaged":
        final = paths["pretrain"] / "final.ckpt"
        copy = copy_checkpoint(final, tmp_path / "final.ckpt")
        weight = torch.load(final, map_location="cpu", weights_only=True)["state_dict"][
            "model.blocks.0.mlp.fc1.weight"
        ]
        flip_in_tensor(copy, weight, one_bit=True)
        cfg, match = (
            _compose(["model=gpt_tiny", f"finetune.pretrained={copy}"]),
            "checksum mismatch in tensor",
        )
    with pytest.raises(ValueError, match=match):
        prepare(cfg, paths["root"])


def test_latest_is_newest_pretraining_run(tmp_path):
    def ckpt(rel, age):
        path = tmp_path / "outputs" / rel / "final.ckpt"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
        os.utime(path, (time.time() - age,) * 2)
        return path

    ckpt("2024-01-01/10-00-00", age=300)
    newest = ckpt("2024-01-02/09-00-00", age=100)
    ckpt("finetune/2024-01-03/08-00-00", age=10)  # a fine-tune's output: never "latest"
    assert resolve_pretrained("latest", tmp_path) == newest
    assert resolve_pretrained("rel/w.safetensors", tmp_path) == tmp_path / "rel/w.safetensors"
    with pytest.raises(ValueError, match=r"run the training app \(lightning3d-train\) first"):
        resolve_pretrained("latest", tmp_path / "elsewhere")
