"""Exact resume: 2k steps in one go equal k steps, a checkpoint, and k more in a fresh run.

The first run saves through ``ModelCheckpoint(every_n_train_steps=1)`` and stops after k = 3
steps; a new run (a new ``Trainer``, generators reseeded; for dp=2 new processes) resumes from
the step-3 file for 3 more. Dropout is on, so the restored RNG states matter as much as the data
position (the resumable loader), the LR schedule and the optimizer state. fp32 on CPU is
deterministic: per-step losses and final weights must match to 1e-6 (they are in fact equal).

Unit tests of the loader's state come first; they need no Trainer.
"""

from pathlib import Path

import pytest
import torch

from lightning_3d.checkpoint.checks import load_lightning_checkpoint
from lightning_3d.data.resumable import ResumableDataLoader, ResumableDistributedSampler
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

SEED = 1234
K = 3
MODEL = {"dropout": 0.1}
# ~1.5k steps per epoch: all 6 steps inside epoch 0.
WITHIN_EPOCH = {}
# 1280 training bytes = 39 windows of 33 bytes: 4 steps of 8 per epoch, so the resumed steps
# are the last of epoch 0 and the first two of epoch 1.
ACROSS_EPOCHS = {"max_bytes": 1600, "val_fraction": 0.2}


# ------------------------------------------------------------------ the loader alone


def _loader(dataset, dp_size=1, dp_rank=0, batch_size=4, num_workers=0):
    sampler = ResumableDistributedSampler(
        dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=7, drop_last=True
    )
    return ResumableDataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=True, num_workers=num_workers
    )


def _epochs(loader, epochs):
    out = []
    for epoch in epochs:
        loader.sampler.set_epoch(epoch)  # what Lightning does at every epoch start
        out.extend(b.tolist() for b in loader)
    return out


@pytest.mark.parametrize("consumed", [0, 3, 5, 6])
def test_loader_resumes_where_it_stopped(consumed):
    dataset = list(range(50))  # 6 batches of 8 per epoch, 2 windows dropped
    full = _epochs(_loader(dataset, batch_size=8), [0, 1])
    first = _loader(dataset, batch_size=8)
    first.sampler.set_epoch(0)
    it = iter(first)
    taken = [next(it).tolist() for _ in range(consumed)]
    state = first.state_dict()
    assert state == {"epoch": 0, "samples": 8 * consumed, "dataset_size": 50, "seed": 7}

    resumed = _loader(dataset, batch_size=8)
    resumed.load_state_dict(state)
    # After the epoch's last batch the position rolls over to the start of the next epoch.
    epoch = 1 if consumed == 6 else 0
    assert resumed.state_dict()["epoch"] == epoch
    rest = _epochs(resumed, [epoch] if epoch == 1 else [0, 1])
    assert taken + rest == full


@pytest.mark.parametrize(
    "cuts", [(3, 2), (1, 1, 1), (4, 3)], ids=["3+2", "1+1+1", "4+3_into_epoch_1"]
)
def test_a_resumed_loader_saves_its_position_from_the_epochs_start(cuts):
    """Resumed, then saved and resumed again: each part's position counts from the epoch's start,
    not from where that part began. Broken variant caught: ``ResumableDataLoader`` counting
    ``(i + 1) * batch_size`` without the sampler's ``start`` (3 batches, resume, 2 batches saved 16
    samples instead of 40, so the next part repeated 3 batches)."""
    dataset = list(range(50))  # 6 batches of 8 per epoch
    full = _epochs(_loader(dataset, batch_size=8), [0, 1])
    state, taken = None, []
    for count in cuts:
        part = _loader(dataset, batch_size=8)
        if state is not None:
            part.load_state_dict(state)  # also sets the sampler's epoch
        it = iter(part)
        for _ in range(count):
            batch = next(it, None)
            if batch is None:  # the epoch ended inside this part: Lightning starts the next
                part.sampler.set_epoch(part.sampler.epoch + 1)
                it = iter(part)
                batch = next(it)
            taken.append(batch.tolist())
        state = part.state_dict()
    assert state["samples"] == 8 * (sum(cuts) % 6)
    assert taken == full[: sum(cuts)]


def test_loader_state_is_global_and_moves_between_dp_sizes():
    dataset = list(range(64))
    ranks = [_loader(dataset, dp_size=2, dp_rank=r) for r in range(2)]  # global batch 8
    iters = [iter(loader) for loader in ranks]
    for _ in range(3):
        for it in iters:
            next(it)
    states = [loader.state_dict() for loader in ranks]
    assert states[0] == states[1] and states[0]["samples"] == 24

    single = _loader(dataset, batch_size=8)
    single.load_state_dict(states[0])
    reference = _epochs(_loader(dataset, batch_size=8), [0])
    assert [b.tolist() for b in single] == reference[3:]  # steps 4.. of the global order

    with pytest.raises(
        ValueError, match="dataset of 64 samples shuffled with seed 7; this loader has 40 samples"
    ):
        _loader(list(range(40)), batch_size=8).load_state_dict(states[0])


def test_loader_counts_batches_handed_out_not_indices_prefetched_by_workers():
    dataset = list(range(64))
    loader = _loader(dataset, batch_size=4, num_workers=1)  # the worker runs ahead by 2 batches
    it = iter(loader)
    taken = [next(it).tolist() for _ in range(3)]
    assert loader.state_dict()["samples"] == 12
    resumed = _loader(dataset, batch_size=4, num_workers=1)
    resumed.load_state_dict(loader.state_dict())
    assert taken + [b.tolist() for b in resumed] == [
        b.tolist() for b in _loader(dataset, batch_size=4)
    ]


# ------------------------------------------------------------------ Trainer runs


def _fit(world, strategy, steps, data, save_to=None, resume_from=None, trainer=None):
    run = Run(
        strategy=strategy,
        devices=world,
        steps=steps,
        seed=SEED,
        model=MODEL,
        data=data,
        trainer=trainer,
        resume_from=resume_from,
        save_to=save_to,
        save_every_n_steps=1 if save_to else None,
    )
    if world == 1 and strategy is None:  # Lightning's own strategy: no process group is left behind
        return fit_gpt(0, run)
    return run_world(fit_gpt, world, run)[0]


def _save_first(tmp_path: Path, world, strategy, data, stop=K, trainer=None):
    first = _fit(world, strategy, stop, data, save_to=str(tmp_path / "run.ckpt"), trainer=trainer)
    ckpt = tmp_path / f"run-step={stop}.ckpt"
    # A file, or a sharded directory.
    assert ckpt.exists(), sorted(p.name for p in tmp_path.iterdir())
    return first, ckpt


def _stop_and_resume(tmp_path: Path, world, strategy, data, stop=K, trainer=None):
    first, ckpt = _save_first(tmp_path, world, strategy, data, stop, trainer)
    second = _fit(world, strategy, 2 * K, data, resume_from=str(ckpt), trainer=trainer)
    return first, second, load_lightning_checkpoint(ckpt)


def _assert_exact(straight, first, second):
    assert len(first["losses"]) + len(second["losses"]) == 2 * K
    torch.testing.assert_close(
        torch.tensor(first["losses"] + second["losses"]),
        torch.tensor(straight["losses"]),
        rtol=0,
        atol=1e-6,
    )
    assert straight["state"].keys() == second["state"].keys()
    for name, value in straight["state"].items():
        torch.testing.assert_close(second["state"][name], value, rtol=0, atol=1e-6, msg=name)


RESUMES = {  # name: (data, the step whose checkpoint the second run resumes from)
    "within_epoch": (WITHIN_EPOCH, K),
    "across_epochs": (ACROSS_EPOCHS, K),
    # The file written after the epoch's last batch: the resumed run starts a fresh epoch.
    "from_epoch_end": (ACROSS_EPOCHS, 4),
}


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_equals_uninterrupted_single_process(tmp_path, name):
    data, stop = RESUMES[name]
    straight = _fit(1, None, 2 * K, data)
    first, second, ckpt = _stop_and_resume(tmp_path, 1, None, data, stop)
    _assert_exact(straight, first, second)
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["samples"] == stop * 8
    assert ckpt["lr_schedulers"][0]["last_epoch"] == stop


def _fp16():
    from lightning.pytorch.plugins.precision import MixedPrecision

    # 2**17 grows after 4 clean steps (step 4) and then overflows (step 5): at step 3 the growth
    # tracker is 3, which a fresh scaler would not have.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**17, growth_interval=4)
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}  # a fresh scaler per run


def test_resume_equals_uninterrupted_16_mixed_loss_scale(tmp_path):
    straight = _fit(1, None, 2 * K, WITHIN_EPOCH, trainer=_fp16())
    first, ckpt = _save_first(tmp_path, 1, None, WITHIN_EPOCH, trainer=_fp16())
    second = _fit(1, None, 2 * K, WITHIN_EPOCH, resume_from=str(ckpt), trainer=_fp16())
    _assert_exact(straight, first, second)
    assert second["loss_scale"] == straight["loss_scale"]
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["MixedPrecision"]
    assert (saved["scale"], saved["_growth_tracker"]) != (2.0**17, 0)  # a fresh scaler would differ


def test_resume_equals_uninterrupted_dp2_zero3(tmp_path):
    strategy = {"zero_stage": 3}
    straight = _fit(2, strategy, 2 * K, ACROSS_EPOCHS)
    first, second, ckpt = _stop_and_resume(tmp_path, 2, strategy, ACROSS_EPOCHS)
    _assert_exact(straight, first, second)
    # Every rank's states, in rank 0's file.
    assert len(ckpt["callbacks"]["RNGStateCheckpoint"]["ranks"]) == 2


SHARDED = {"checkpoint_format": "sharded"}
LAYOUTS = {  # name: (strategy, world)
    "sharded_zero3_dp2": ({**SHARDED, "zero_stage": 3}, 2),
    "sharded_tp2_zero1": ({**SHARDED, "tensor": 2, "zero_stage": 1}, 2),
    "sharded_pp2": ({**SHARDED, "pipeline": 2, "micro_batches": 2}, 2),
    "sharded_nvme_zero2_dp2": (
        {
            **SHARDED,
            "zero_stage": 2,
            "offload": "nvme",
            "offload_path": "/tmp",
            "offload_chunk_mb": 0.01,
        },
        2,
    ),
    "consolidated_tp2_sp": ({"tensor": 2, "sequence_parallel": True}, 2),
    "consolidated_pp2_dp2": ({"pipeline": 2, "micro_batches": 2, "zero_stage": 1}, 4),
}


# In CI: a pipeline (sharded) and tensor + sequence parallelism (consolidated). ZeRO-3 resumes in
# CI already (test_resume_equals_uninterrupted_dp2_zero3); the rest runs with -m slow.
FAST_LAYOUTS = ("sharded_pp2", "consolidated_tp2_sp")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=() if name in FAST_LAYOUTS else pytest.mark.slow)
        for name in LAYOUTS
    ],
)
def test_resume_equals_uninterrupted_in_every_layout(tmp_path, name):
    strategy, world = LAYOUTS[name]
    straight = _fit(world, strategy, 2 * K, ACROSS_EPOCHS)
    first, second, ckpt = _stop_and_resume(tmp_path, world, strategy, ACROSS_EPOCHS)
    _assert_exact(straight, first, second)
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["samples"] == K * 8


BF16_OFFLOAD = {  # name: (strategy, world)
    "consolidated_cpu": ({"offload": "cpu"}, 1),
    "consolidated_nvme_zero2_dp2": (
        {"zero_stage": 2, "offload": "nvme", "offload_path": "/tmp", "offload_chunk_mb": 0.01},
        2,
    ),
    # Without engine masters they stay in the offload store (its state, saved as "master");
    # the engine's host masters in a sharded checkpoint: tests/test_sharded_masters.py.
    "sharded_cpu_zero1_dp2": (
        {**SHARDED, "zero_stage": 1, "offload": "cpu", "zero_master_weights": False},
        2,
    ),
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=() if name == "consolidated_cpu" else pytest.mark.slow)
        for name in BF16_OFFLOAD
    ],
)
def test_resume_keeps_the_fp32_master_weights_of_bf16_parameters(tmp_path, name):
    """bf16-true parameters with offload: the optimizer steps fp32 master weights that the bf16
    weights only round. Resuming must restore those masters (and the fp32 moments) as saved; cast
    to the parameters' bf16, the resumed run would step from rounded weights and drift. The
    masters are the checkpoint's fp32 weights (ZeRO-Offload's split: the engine keeps them in
    host memory), or with ``zero_master_weights=False`` the store's, saved as ``master``."""
    strategy, world = BF16_OFFLOAD[name]
    trainer = {"precision": "bf16-true"}
    straight = _fit(world, strategy, 2 * K, ACROSS_EPOCHS, trainer=trainer)
    first, second, ckpt = _stop_and_resume(
        tmp_path, world, strategy, ACROSS_EPOCHS, trainer=trainer
    )
    _assert_exact(straight, first, second)
    masters = [s["master"] for s in ckpt["optimizer_states"][0]["state"].values() if "master" in s]
    if strategy.get("zero_master_weights", True):
        masters = [v for v in ckpt["state_dict"].values() if v.dim() == 2]
    assert masters and all(m.dtype == torch.float32 for m in masters)


def test_without_rng_states_dropout_diverges(tmp_path):
    """The control: drop the RNG states from the checkpoint and the resumed losses differ."""
    first, path = _save_first(tmp_path, 1, None, WITHIN_EPOCH)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    del ckpt["callbacks"]["RNGStateCheckpoint"]
    torch.save(ckpt, tmp_path / "no_rng.ckpt")
    straight = _fit(1, None, 2 * K, WITHIN_EPOCH)
    second = _fit(1, None, 2 * K, WITHIN_EPOCH, resume_from=str(tmp_path / "no_rng.ckpt"))
    assert first["losses"] == straight["losses"][:K]
    assert max(abs(a - b) for a, b in zip(second["losses"], straight["losses"][K:])) > 1e-4
