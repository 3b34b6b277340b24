"""Sharded checkpoints (``checkpoint_format="sharded"``) of ZeRO 0-2 with fp32 master weights.

Under ``precision="bf16-true"`` the optimizer steps fp32 masters that the bf16 weights only
round; a sharded save writes each rank's master slice as the model's weights (fp32, at the
parameter's global shape), and a load reads every rank's owned elements back into its master
and rounds them into the bf16 buckets. The whole point of masters is an exact resume: a resumed
run's losses and every weight (each master, tensor by tensor) must be bitwise those of the
uninterrupted run. AdamW (fp32 moments) with one micro-batch a step: ZeRO-1 and ZeRO-2 do the
same arithmetic, so a resume across the two stages is exact too. Caught: a checkpoint of the
bf16 weights (the resume starts from their rounding), masters not reloaded or reloaded from
another rank's slice, bf16 buckets not refreshed from the loaded masters on every rank.
"""

from __future__ import annotations

import pytest
import torch

from lightning_3d.checkpoint.checks import load_lightning_checkpoint
from tools.harness.runs import Run, fit_gpt_ranks
from tools.harness.world import run_world

SHARDED = {"checkpoint_format": "sharded"}
STEPS = 4


def _run(
    world: int, steps: int, save_to=None, resume_from=None, arch="gpt", model=None, **strategy
) -> list:
    run = Run(
        strategy={**SHARDED, **strategy},
        devices=world,
        steps=steps,
        arch=arch,
        # AdamW: its fp32 moments come back with the masters.
        model={"lr": 1e-3, **(model or {})},
        trainer={"precision": "bf16-true"},
        save_to=save_to,
        save_every_n_steps=1 if save_to else None,
        resume_from=resume_from,
    )
    return run_world(fit_gpt_ranks, world, run)


def _step(root, stem: str, step: int) -> str:
    return str(root / f"{stem}-step={step}.ckpt")


def _assert_same(resumed: dict, straight: dict, first_step: int) -> None:
    """Bitwise: the losses from ``first_step`` on, and every weight of the run (the fp32 master
    where one is kept), in its dtype."""
    assert resumed["losses"] == straight["losses"][first_step:]
    assert sorted(resumed["state"]) == sorted(straight["state"])
    for name, value in straight["state"].items():
        assert resumed["state"][name].dtype == value.dtype, name
        torch.testing.assert_close(
            resumed["state"][name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def _assert_ranks_same(resumed: list, straight: list) -> None:
    """Bitwise: every rank's own copy of its parameters (the bf16 weights the forward uses)."""
    for mine, theirs in zip(resumed, straight):
        for name, value in theirs["rank_state"].items():
            torch.testing.assert_close(
                mine["rank_state"][name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
            )


def _weights(path: str) -> dict:
    saved = load_lightning_checkpoint(path)  # the sharded directory, read in this process
    return {k: v for k, v in saved["state_dict"].items() if v.is_floating_point()}


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    """data=2 ZeRO-1, saving a sharded checkpoint after every step: the uninterrupted run."""
    root = tmp_path_factory.mktemp("zero1")
    return root, _run(2, STEPS, save_to=str(root / "z1.ckpt"), zero_stage=1)


@pytest.fixture(scope="module")
def zero2_resumed(zero1, tmp_path_factory):
    """Resumed at data=2 ZeRO-2 from ZeRO-1's step 2, saving sharded after every step."""
    root, _ = zero1
    out = tmp_path_factory.mktemp("zero2")
    ranks = _run(
        2,
        STEPS,
        save_to=str(out / "z2.ckpt"),
        resume_from=_step(root, "z1", 2),
        zero_stage=2,
    )
    return out, ranks


def test_sharded_masters_resume_exactly_at_zero2(zero1, zero2_resumed):
    """Saved at ZeRO-1, resumed at ZeRO-2: the stored weights are the fp32 masters (not what
    bf16 holds), and the resumed run is the uninterrupted one, bitwise, on every rank. Catches a
    writer that saves the bf16 buckets (weights differ by bf16 rounding after the resume)."""
    root, straight = zero1
    _, resumed = zero2_resumed
    _assert_same(resumed[0], straight[0], 2)
    _assert_ranks_same(resumed, straight)
    weights = _weights(_step(root, "z1", 2))
    matrices = [v for v in weights.values() if v.dim() == 2]
    assert matrices and all(v.dtype == torch.float32 for v in weights.values())
    assert all(not torch.equal(v, v.bfloat16().float()) for v in matrices)


@pytest.mark.slow
def test_a_resumed_run_resumes_exactly_again_into_a_consolidated_run(zero1, zero2_resumed):
    """ZeRO-2's resumed run's own sharded checkpoint (step 3) resumed at ZeRO-1 by a run that
    saves consolidated checkpoints: still the uninterrupted run, bitwise; and its consolidated
    checkpoint at step 4 holds what the sharded one of the uninterrupted run holds, exactly
    (model weights and optimizer state)."""
    root, straight = zero1
    out, _ = zero2_resumed
    again = _run(
        2,
        STEPS,
        save_to=str(out / "again.ckpt"),
        resume_from=_step(out, "z2", 3),
        zero_stage=1,
        checkpoint_format="consolidated",
    )
    _assert_same(again[0], straight[0], 3)
    _assert_ranks_same(again, straight)
    consolidated = load_lightning_checkpoint(_step(out, "again", 4))
    sharded = load_lightning_checkpoint(_step(root, "z1", 4))
    assert sorted(consolidated["state_dict"]) == sorted(sharded["state_dict"])
    for name, value in sharded["state_dict"].items():
        torch.testing.assert_close(consolidated["state_dict"][name], value, rtol=0, atol=0)
    ours, theirs = consolidated["optimizer_states"][0], sharded["optimizer_states"][0]
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for index, entry in theirs["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(ours["state"][index][key], value, rtol=0, atol=0)


@pytest.mark.slow
def test_one_process_zero3_and_bf16_mixed_load_the_masters(zero1):
    """Loaded on one process (stage 0 masters) every master is the stored fp32 value; under
    ZeRO-3 (FSDP2 keeps bf16 shards) every weight is its rounding; under bf16-mixed (fp32
    weights) the fp32 value. Nothing left to train: the state is what was loaded."""
    root, _ = zero1
    path = _step(root, "z1", 2)
    weights = _weights(path)
    (one,) = _run(1, 2, resume_from=path, zero_stage=0)
    for name, value in weights.items():
        torch.testing.assert_close(
            one["state"][name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
        torch.testing.assert_close(
            one["rank_state"][name], value.bfloat16(), rtol=0, atol=0, msg=name
        )
    zero3 = _run(2, 2, resume_from=path, zero_stage=3)
    for name, value in weights.items():
        torch.testing.assert_close(
            zero3[0]["state"][name], value.bfloat16(), rtol=0, atol=0, msg=name
        )
    mixed = run_world(
        fit_gpt_ranks,
        1,
        Run(
            strategy={**SHARDED, "zero_stage": 1},
            devices=1,
            steps=2,
            model={"lr": 1e-3},
            trainer={"precision": "bf16-mixed"},
            resume_from=path,
        ),
    )
    for name, value in weights.items():
        torch.testing.assert_close(
            mixed[0]["state"][name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.slow
def test_a_checkpoint_without_masters_loads_into_masters(tmp_path):
    """Saved with ``zero_master_weights=False`` (bf16 weights stored), loaded at ZeRO-2 with
    masters: each master is the stored bf16 value, upcast."""
    _run(2, 2, save_to=str(tmp_path / "bf16.ckpt"), zero_stage=1, zero_master_weights=False)
    path = _step(tmp_path, "bf16", 2)
    weights = _weights(path)
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    loaded = _run(2, 2, resume_from=path, zero_stage=2)
    for name, value in weights.items():
        assert loaded[0]["state"][name].dtype == torch.float32, name
        torch.testing.assert_close(loaded[0]["state"][name], value.float(), rtol=0, atol=0)


LORA = {"adapter": {"method": "lora", "r": 4, "lora_alpha": 8}}
LAYOUTS = {
    # GPT-2's fused q/k/v, regrouped per tensor rank, inside the ZeRO slices with masters.
    "tp2_dp2_fused": ("gpt2", None, {"tensor": 2, "data": 2}, (1, 2)),
    # hf GPT-2's embedding and head, tied across two pipeline stages (one master each).
    "pp2_tied": ("hf_gpt2", None, {"pipeline": 2, "micro_batches": 2}, (1, 2)),
    # the tie inside one module: one master, under two names in the checkpoint, read once.
    "dp2_tied": ("hf_gpt2", None, {}, (1, 2)),
    # ZeRO-Offload's split: the masters in host memory.
    "dp2_offload_cpu": ("gpt", None, {"offload": "cpu"}, (1, 2)),
    # ... with the moments on the drive, streamed out of and back into its store.
    "dp2_offload_nvme": ("gpt", None, {"offload": "nvme", "offload_path": "/tmp"}, (1, 2)),
    # stage 0: every data rank holds the whole master and lists the same boxes (written once).
    "dp2_stage0": ("gpt", None, {}, (0, 0)),
    # LoRA: only the adapters are bucketed and get masters; the frozen base is saved in bf16.
    "dp2_lora": ("hf_llama", LORA, {}, (1, 2)),
    # one process: the engine keeps its buckets for the masters alone.
    "dp1": ("gpt", None, {"devices": 1}, (0, 0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_resume_exactly(tmp_path, layout):
    """Saved at the first stage, resumed at the second, in each layout: bitwise the
    uninterrupted run."""
    arch, model, options, (saved_at, resumed_at) = LAYOUTS[layout]
    options = dict(options)
    world = options.pop("devices", 4 if options.get("tensor") else 2)
    common = dict(arch=arch, model=model, **options)
    straight = _run(world, STEPS, save_to=str(tmp_path / "s.ckpt"), zero_stage=saved_at, **common)
    path = _step(tmp_path, "s", 2)
    resumed = _run(world, STEPS, resume_from=path, zero_stage=resumed_at, **common)
    _assert_same(resumed[0], straight[0], 2)
    _assert_ranks_same(resumed, straight)
    # Each stored weight in its run's dtype: fp32 where a master was kept, bf16 elsewhere.
    state = straight[0]["state"]
    stored = {k: v.dtype for k, v in _weights(path).items() if k in state}
    assert stored == {k: state[k].dtype for k in stored}
    assert torch.float32 in stored.values()


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"offload": "cpu"}], ids=["device", "host_masters"])
def test_the_save_and_the_load_take_only_device_tensors_to_collectives(tmp_path, options):
    """Under ``support.device_guard`` (what an NCCL group refuses and gloo forgives): a sharded
    save with masters and its resume, with the masters on the device and in host memory (the
    load rounds host masters into the device buckets before they are gathered)."""
    from support.guarded_runs import guarded_fit

    common = dict(
        strategy={**SHARDED, "zero_stage": 1, **options},
        devices=2,
        model={"lr": 1e-3},
        trainer={"precision": "bf16-true"},
    )
    first = Run(steps=2, save_to=str(tmp_path / "g.ckpt"), save_every_n_steps=2, **common)
    resumed = Run(steps=4, resume_from=_step(tmp_path, "g", 2), **common)
    for rank, result in enumerate(run_world(guarded_fit, 2, first, (resumed,))):
        assert not result["violations"], f"rank {rank}:\n" + "\n".join(result["violations"])
