"""Sharded checkpoints (``checkpoint_format="sharded"``): every rank writes only its own shards, and
the result is the single-process checkpoint, loadable in any other layout.

Like ``test_checkpoint.py``: a run saves through ``ModelCheckpoint`` at the end of its first epoch
(2 steps). Read back in one process, the directory must hold the same full tensors (model, Adam
moments, step, param groups, scheduler) as the single-process run's own ``.ckpt``; resuming it for
2 more steps in another layout must reproduce plain Lightning resuming that ``.ckpt``.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lightning_3d.checkpoint import sharded_files
from lightning_3d.checkpoint.checks import inspect_checkpoint, load_lightning_checkpoint
from lightning_3d.checkpoint.export import export_safetensors
from lightning_3d.checkpoint.files import publish, remove_stale_temps
from tools.harness.parity import assert_same_run, checkpoint_tensors, weight_mismatches
from tools.harness.runs import Run, fit_gpt, fit_layout
from tools.harness.world import run_world

SEED = 1234
DATA = {"max_bytes": 1000, "val_fraction": 0.3}  # 21 training windows: 2 steps of 8 per epoch
TRAINER = {"gradient_clip_val": 0.05}
SHARDED = {"checkpoint_format": "sharded"}

LAYOUTS = {
    "single": (None, 1),  # plain Lightning: the reference .ckpt
    "one_process": ({**SHARDED}, 1),
    "zero1_dp2": ({**SHARDED, "zero_stage": 1}, 2),
    "zero2_dp2": ({**SHARDED, "zero_stage": 2}, 2),
    "zero3_dp2": ({**SHARDED, "zero_stage": 3}, 2),
    "tp2": ({**SHARDED, "tensor": 2}, 2),
    "tp2_sp_zero2": (
        {**SHARDED, "tensor": 2, "sequence_parallel": True, "zero_stage": 2, "data": 1},
        2,
    ),
    "pp2": ({**SHARDED, "pipeline": 2, "micro_batches": 2}, 2),
    "nvme_zero1_dp2": (
        {
            **SHARDED,
            "zero_stage": 1,
            "offload": "nvme",
            "offload_path": "/tmp",
            "offload_chunk_mb": 0.01,
        },
        2,
    ),
    "3d_2x2x2": (
        {**SHARDED, "data": 2, "tensor": 2, "pipeline": 2, "micro_batches": 2, "zero_stage": 1},
        8,
    ),
    "tp4": ({**SHARDED, "tensor": 4}, 4),
    # beyond dp2 in CI: 4 ranks, each writing the ZeRO-2 slices of its own pipeline stage
    "pp2_dp2_zero2": (
        {**SHARDED, "pipeline": 2, "data": 2, "micro_batches": 2, "zero_stage": 2},
        4,
    ),
}
FAST = ("zero2_dp2", "zero3_dp2", "tp2", "pp2", "pp2_dp2_zero2")


def _run(layout, resume_from=None, save_to=None, arch="gpt", model=None):
    strategy, world = LAYOUTS[layout]
    steps, trainer = (4, TRAINER) if resume_from else (-1, {**TRAINER, "max_epochs": 1})
    run = Run(
        strategy=strategy,
        steps=steps,
        seed=SEED,
        model=model,
        data=DATA,
        trainer=trainer,
        arch=arch,
        resume_from=resume_from,
        save_to=save_to,
    )
    return fit_layout(run, world)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(layout, arch="gpt"):
        if (layout, arch) not in cache:
            path = tmp_path_factory.mktemp(f"{layout}_{arch}") / "epoch0.ckpt"
            run = _run(layout, save_to=str(path), arch=arch)
            assert len(run["losses"]) == 2 and path.exists()
            cache[layout, arch] = path
        return cache[layout, arch]

    return get


def _assert_equals_reference(path: Path, reference_path: Path) -> None:
    reference = torch.load(reference_path, map_location="cpu", weights_only=True)
    ckpt = load_lightning_checkpoint(path)  # the sharded directory, read in this process
    assert ckpt["global_step"] == reference["global_step"] == 2
    assert ckpt["lr_schedulers"] == reference["lr_schedulers"]
    assert (
        ckpt["optimizer_states"][0]["param_groups"]
        == reference["optimizer_states"][0]["param_groups"]
    )
    # rtol 3e-5: a small tensor (a bias whose largest difference is 3e-7) reaches a relative
    # error of 1.6e-5 on some CPUs' kernels after two steps under tensor parallelism.
    assert (
        weight_mismatches(
            checkpoint_tensors(ckpt), checkpoint_tensors(reference), rtol=3e-5, atol=3e-5
        )
        == []
    )


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(name, marks=() if name in FAST else pytest.mark.slow)
        for name in LAYOUTS
        if name != "single"
    ],
)
def test_sharded_checkpoint_equals_the_single_process_one(saved, layout):
    path = saved(layout)
    assert (
        sharded_files.is_sharded_checkpoint(path)
        and inspect_checkpoint(path)["format"] == "sharded"
    )
    _assert_equals_reference(path, saved("single"))


@pytest.mark.parametrize("layout", ["zero2_dp2", "zero3_dp2"])
def test_each_rank_writes_its_own_shards(saved, layout):
    """Data-parallel ranks split the bytes: no rank writes (nearly) everything, as rank 0 of a
    consolidated save would."""
    path = saved(layout)
    files = sorted(path.glob("*.distcp"))
    sizes = [f.stat().st_size for f in files]
    assert len(files) == 2, files
    assert max(sizes) < 0.7 * sum(sizes), sizes


@pytest.mark.parametrize("layout", ["tp2", pytest.param("tp2_sp_zero2", marks=pytest.mark.slow)])
def test_fused_qkv_under_tensor_parallel(saved, layout):
    """GPT-2-style fused q/k/v regrouped per tensor rank (inside ZeRO-2 slices too): saved in the
    plain model's row order."""
    _assert_equals_reference(saved(layout, arch="gpt2"), saved("single", arch="gpt2"))


RESUMES = [
    ("zero2_dp2", "pp2"),
    ("zero3_dp2", "one_process"),
    ("tp2", "zero1_dp2"),
    ("one_process", "zero3_dp2"),
    ("pp2", "tp2_sp_zero2"),
    ("nvme_zero1_dp2", "nvme_zero1_dp2"),
    ("zero1_dp2", "tp2"),
    ("3d_2x2x2", "one_process"),
    ("3d_2x2x2", "tp4"),  # 8 processes -> 1, and -> 1 x 4 x 1
]
SLOW_RESUMES = set(RESUMES[4:])


@pytest.fixture(scope="module")
def reference_resume(saved):
    return _run("single", resume_from=str(saved("single")))


@pytest.mark.parametrize(
    "source,target",
    [
        pytest.param(a, b, marks=pytest.mark.slow if (a, b) in SLOW_RESUMES else (), id=f"{a}->{b}")
        for a, b in RESUMES
    ],
)
def test_resume_in_another_layout_matches_a_single_process_resume(
    saved, reference_resume, source, target
):
    resumed = _run(target, resume_from=str(saved(source)))
    assert len(resumed["losses"]) == 2
    # atol as for the checkpoints above: Adam divides by sqrt(v), so where a gradient is tiny a
    # rounding-level difference (another summation order, NVMe offload's fused CPU step against
    # torch's default one) moves a weight by up to ~1e-5 (nvme_zero1_dp2: 1.15e-5, 2026-12-02)
    assert_same_run(resumed, reference_resume, atol=3e-5)


def test_export_of_a_sharded_checkpoint(saved, tmp_path):
    from safetensors.torch import load_file

    result = export_safetensors(saved("zero3_dp2"), tmp_path / "gpt.safetensors")
    reference = torch.load(saved("single"), map_location="cpu", weights_only=True)["state_dict"]
    exported = load_file(str(result.path))
    assert sorted(exported) == sorted(name.removeprefix("model.") for name in reference)
    assert all(
        torch.allclose(exported[n.removeprefix("model.")], t, atol=3e-5)
        for n, t in reference.items()
    )


def test_checkpoint_of_another_model_is_refused(saved):
    with pytest.raises(RuntimeError, match="does not match the model.*shape mismatch"):
        run_world(_resume_wider, 1, str(saved("zero2_dp2")))


def _resume_wider(rank, path):
    return fit_gpt(
        rank,
        Run(
            strategy=SHARDED,
            devices=1,
            steps=4,
            seed=SEED,
            model={"n_embd": 64},
            data=DATA,
            trainer=TRAINER,
            resume_from=path,
        ),
    )


def test_bad_sharded_directories(saved, tmp_path):
    source = saved("zero2_dp2")

    def copy(name):
        target = tmp_path / name
        target.mkdir()
        for f in source.iterdir():
            (target / f.name).write_bytes(f.read_bytes())
        return target

    truncated = copy("truncated.ckpt")
    shard = truncated / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(
        ValueError,
        match=r"__1_0.distcp: corrupted or truncated shard \(\d+ bytes, the metadata needs",
    ):
        load_lightning_checkpoint(truncated)
    missing = copy("missing.ckpt")
    (missing / "__0_0.distcp").unlink()
    with pytest.raises(ValueError, match="missing its file __0_0.distcp"):
        inspect_checkpoint(missing)
    no_meta = copy("no_meta.ckpt")
    (no_meta / sharded_files.META_FILE).unlink()
    with pytest.raises(ValueError, match="incomplete sharded checkpoint"):
        load_lightning_checkpoint(no_meta)
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    with pytest.raises(ValueError, match="is a directory but not a checkpoint"):
        inspect_checkpoint(plain_dir)


def test_publish_replaces_a_checkpoint_atomically(tmp_path):
    path = tmp_path / "last.ckpt"
    for generation in range(3):
        temp = tmp_path / f".last.ckpt.tmp-{generation}"
        temp.mkdir()
        (temp / "data").write_text(str(generation))
        publish(temp, path)
        assert (path / "data").read_text() == str(generation)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


_KILLED_SAVER = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    from lightning_3d.checkpoint import sharded
    from lightning_3d.checkpoint import sharded_files
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2] + ".pg", rank=0, world_size=1)
    def save(step):
        tensors = {"state_dict.w": torch.full((1 << 16,), float(step))}
        meta = {"global_step": step, "state_dict": {}, "format": sharded_files.FORMAT}
        sharded_files.save(tensors, meta, sys.argv[1])
    save(1)
    print("first saved", flush=True)
    real = torch.save
    def stalled(obj, f, *args, **kwargs):  # the shards are written; stall before meta.pt
        if isinstance(obj, dict) and obj.get("global_step") == 2:
            time.sleep(300)
        return real(obj, f, *args, **kwargs)
    torch.save = stalled
    save(2)
""")


def test_kill_during_sharded_save_keeps_the_previous_checkpoint(tmp_path):
    target = tmp_path / "ckpts" / "last.ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVER, str(target), str(tmp_path / "store")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "first saved", proc.stderr.read()
        temp, deadline = target.parent / f".last.ckpt.tmp-{proc.pid}", time.monotonic() + 60
        while not (temp / ".metadata").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        proc.kill()
        proc.communicate()
    # The new shards exist only under the temporary name, which "last" resolution never matches.
    assert sorted(p.name for p in target.parent.iterdir()) == sorted(["last.ckpt", temp.name])
    assert sharded_files.read_meta(target)["global_step"] == 1
    assert torch.equal(sharded_files.read_tensors(target)["w"], torch.full((1 << 16,), 1.0))
    remove_stale_temps(target.parent)  # what the next save does first
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]
