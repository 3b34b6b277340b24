"""ZeRO 0-2 with a bf16 module (``precision="bf16-true"``) and fp32 master weights.

The reference is one process in the same mode: the same engine at stage 0 on one device (bf16
weights and gradients, an fp32 master the optimizer steps). At data=2 (and data=2 x tensor=2),
stages 1 and 2 must give the same losses and the same updates of the fp32 weights (the masters,
which checkpoints and ``full_state_dict`` return), with gradient accumulation, under momentum SGD
(update proportional to the gradient: a wrong scale shows) with a clip threshold never reached,
and with one always hit (a norm over one rank's slice would show). Also: model-state bytes
counted from the tensors against the ZeRO paper's mixed-precision formula, the planner against
the paper's Figure 1, an exact resume across stages and onto one device, LoRA (masters for the
adapters only), the refused combinations, and ZeRO-2's deferred reduction's bytes.
"""

from __future__ import annotations

import math

import pytest

from tools.harness.parity import loss_mismatches, rank_state_mismatches, update_mismatches
from tools.harness.runs import Run, fit_gpt_ranks
from tools.harness.world import run_world

STEPS = 4
SGD = {"optimizer": "sgd", "lr": 0.3}
SETUPS = {
    # SGD's update is proportional to the gradient: a wrong scale (a sum over ranks instead of the
    # mean, a dropped micro-batch) shows. The clip threshold is never reached, but its global
    # norm is computed (over the masters' gradients) every step.
    "scale": {"precision": "bf16-true", "gradient_clip_val": 1e3, "accumulate_grad_batches": 2},
    # A threshold always hit: a norm over one rank's slice would clip by another factor.
    "clip": {"precision": "bf16-true", "gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
}
FAST = {(1, "scale"), (2, "clip")}
# bf16 gradients (2**-8 relative) over 4 steps: measured at most 1.0e-2 on the weights whose
# updates are large; a gradient scaled by 2 or a dropped micro-batch is off by 50-100 %.
UPDATE_RTOL = 2e-2
UPDATE_ATOL = 3e-5
# A norm's weight gradient sums over every token in bf16: half batches on two ranks round
# differently from the whole batch, by up to 6.3e-2 measured after 4 steps, the same at stages
# 0, 1 and 2 and with fp32 reduction (the data-parallel split's, not the engine's).
NORM_RTOL = 0.15


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(stage: int, data: int, setup: str = "scale", **strategy):
        key = (stage, data, setup, tuple(sorted(strategy.items())))
        if key not in cache:
            run = Run(
                strategy={"zero_stage": stage, **strategy},
                devices=data,
                steps=STEPS,
                model=SGD,
                trainer=SETUPS[setup],
            )
            cache[key] = run_world(fit_gpt_ranks, data, run)
        return cache[key]

    return get


def test_one_process_steps_fp32_masters(runs):
    """The reference itself: under bf16-true the checkpointed weights are fp32 (the masters),
    and they moved away from what the bf16 weights can hold (a master left at its bf16 rounding
    would mean the optimizer stepped the bf16 buffer)."""
    import torch

    (reference,) = runs(0, 1)
    state = reference["state"]
    weights = [v for k, v in state.items() if v.is_floating_point() and v.dim() == 2]
    assert weights and all(v.dtype == torch.float32 for v in weights)
    assert any(not torch.equal(v, v.bfloat16().float()) for v in weights)


def _assert_updates_match(
    result: dict, reference: dict, dtypes: bool = False, norm_keys: tuple = ("norm",)
) -> None:
    """``result`` (a rank's run) against the one-process ``reference`` in the same mode: losses
    within one unit of bf16 (the loss is computed in bf16: half-batch losses averaged over ranks
    may round one unit, 2**-8 relative, away from the whole batch's), each tensor's update over
    the run within ``UPDATE_RTOL`` (norm weights, named by ``norm_keys``: ``NORM_RTOL``); the
    weights saved are the fp32 masters, so ``dtypes``: each in the reference's dtype too."""
    assert loss_mismatches(result["losses"], reference["losses"], rtol=1e-2) == []
    state = result["state"]
    if dtypes:
        assert all(v.dtype == reference["state"][k].dtype for k, v in state.items())
    start = {k: v.bfloat16().float() for k, v in reference["initial_state"].items()}
    norms = {k: v for k, v in state.items() if any(n in k for n in norm_keys)}
    others = {k: v for k, v in state.items() if k not in norms}
    assert update_mismatches(others, reference["state"], start, UPDATE_RTOL, UPDATE_ATOL) == []
    assert update_mismatches(norms, reference["state"], start, NORM_RTOL, UPDATE_ATOL) == []


@pytest.mark.parametrize(
    "stage, setup",
    [
        pytest.param(stage, setup, marks=() if (stage, setup) in FAST else pytest.mark.slow)
        for stage in (1, 2)
        for setup in SETUPS
    ],
)
def test_masters_at_data_2_match_one_process(runs, stage, setup):
    """Catches (scale): the masters' gradients summed instead of averaged over ranks, a
    micro-batch dropped. Catches (clip): a clip norm over one rank's slice. Catches (both): a
    rank whose bf16 weights were not refreshed from the others' masters (every rank's own copy is
    compared with the rounding of the reference's masters)."""
    (reference,) = runs(0, 1, setup)
    world = runs(stage, 2, setup)
    _assert_updates_match(world[0], reference)
    # Each rank's own bf16 parameters are the rounding of the same masters.
    rounded = {"state": {k: v.bfloat16() for k, v in reference["state"].items()}}
    assert rank_state_mismatches(world, rounded, rtol=1e-2, atol=1e-2) == []


def _counted_bytes(rank: int) -> dict:
    """Model-state bytes on this rank after one AdamW step of a bf16 MLP, at ZeRO 0, 1 and 2
    (fp32 masters) and, for reference, ZeRO-3 (FSDP2: fp32 shards, bf16 compute)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lightning_3d.observe.memory import model_state_bytes
    from lightning_3d.parallel.masters import MASTER_DTYPE, zero_state_bytes
    from lightning_3d.parallel.zero import ZeroDataParallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(192, 192) for _ in range(4)))

    def loss(net, dtype):
        torch.manual_seed(rank)
        return net(torch.randn(4, 192, dtype=dtype)).float().square().mean()

    out = {}
    for stage in (0, 1, 2):
        net = model().bfloat16()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        engine = ZeroDataParallel(mesh, stage, master_dtype=MASTER_DTYPE)
        engine.attach(optimizer)
        engine.prepare_backward(sync=True)
        loss(net, torch.bfloat16).backward()
        engine.finish_backward()
        optimizer.step()
        out[stage] = zero_state_bytes(net, optimizer, engine)
        engine.after_step()
    net = model()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in net:
        fully_shard(layer, mesh=mesh, mp_policy=bf16)
    fully_shard(net, mesh=mesh, mp_policy=bf16)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    loss(net, torch.float32).backward()
    optimizer.step()
    counted = model_state_bytes(net, [optimizer])
    out[3] = {
        "params": counted["param_bytes"],
        "grads": counted["grad_bytes"],
        "optimizer_state": counted["optimizer_state_bytes"],
    }
    out["psi"] = sum(p.numel() for p in model().parameters())
    return out


# Against ZeRO-0 on the same ranks (same half batches): ZeRO-1 reduces the same bf16 sums once,
# measured bit for bit; ZeRO-2 reduces each micro-batch and adds the shards in bf16, another
# rounding order (measured up to 2.0e-2 of an update, norm weights included).
SAME_RANKS_RTOL = {1: 1e-6, 2: 3e-2}


@pytest.mark.parametrize("stage", [1, 2])
def test_sharding_the_masters_changes_no_update_against_stage_0_on_the_same_ranks(runs, stage):
    """The tolerances above absorb what the data-parallel split itself rounds (half batches in
    bf16: up to 6 % on norm weights). Against ZeRO-0 on the same two ranks, which rounds the same
    half batches, each tensor's update must agree to :data:`SAME_RANKS_RTOL`, norm weights
    included: a norm gradient 10 % off would pass the comparison with one process, not this."""
    (base, *_) = runs(0, 2, "scale")
    (sharded, *_) = runs(stage, 2, "scale")
    assert sharded["losses"] == pytest.approx(base["losses"], rel=SAME_RANKS_RTOL[stage])
    start = {k: v.bfloat16().float() for k, v in base["initial_state"].items()}
    rtol = SAME_RANKS_RTOL[stage]
    assert update_mismatches(sharded["state"], base["state"], start, rtol, 1e-7) == []


def test_counted_bytes_follow_the_papers_mixed_precision_formula():
    """On 2 ranks, per rank, from the tensors themselves (each storage once): bf16 weights (2Ψ),
    bf16 gradients (2Ψ, stage 2 2Ψ/N), fp32 masters (4Ψ, sharded from stage 1) and Adam's two
    fp32 moments (8Ψ/N from stage 1) add up to the ZeRO paper's 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N
    (16Ψ/N at ZeRO-3) within 1 %. Catches masters kept whole at stages 1-2 (a stage-1 rank would
    hold 8Ψ + 8Ψ/N), masters left as views of the bf16 buffer (no fp32 copy: 2Ψ less and bf16
    moments), or fp32 gradient buffers (2Ψ more). The master gradients, made in fp32 for the step
    only (as DeepSpeed's fp32 gradient partition), are counted apart: 4Ψ/N from stage 1."""
    from lightning_3d.parallel.masters import paper_bytes

    n = 2
    for rank_out in run_world(_counted_bytes, n):
        psi = rank_out["psi"]
        for stage in (0, 1, 2, 3):
            counted = rank_out[stage]
            total = counted["params"] + counted["grads"] + counted.get("masters", 0)
            total += counted["optimizer_state"]
            expected = paper_bytes(psi, stage, n)
            assert math.isclose(total, expected, rel_tol=0.01), (stage, counted, expected)
        for stage in (0, 1, 2):
            counted = rank_out[stage]
            share = 1 if stage == 0 else n
            assert math.isclose(counted["params"], 2 * psi, rel_tol=0.01), (stage, counted)
            assert math.isclose(counted["masters"], 4 * psi / share, rel_tol=0.01), counted
            assert math.isclose(counted["optimizer_state"], 8 * psi / share, rel_tol=0.01)
            assert math.isclose(counted["master_grads"], 4 * psi / share, rel_tol=0.01)


def _resume_run(
    world: int, stage: int, steps: int, save_to=None, resume_from=None, **strategy
) -> dict:
    run = Run(
        strategy={"zero_stage": stage, **strategy},
        devices=world,
        steps=steps,
        model={"lr": 1e-3},  # AdamW: its fp32 moments must come back too
        trainer={"precision": "bf16-true"},
        save_to=save_to,
        save_every_n_steps=1 if save_to else None,
        resume_from=resume_from,
    )
    return run_world(fit_gpt_ranks, world, run)[0]


@pytest.mark.slow
def test_resume_is_exact_across_zero_stages_and_to_one_device(tmp_path):
    """A checkpoint saved at data=2 ZeRO-1 holds the fp32 masters as the model's weights and
    fp32 moments. Resumed at data=2 ZeRO-2 it continues exactly as the uninterrupted ZeRO-1 run
    (one micro-batch a step: stages 1 and 2 do the same arithmetic); loaded on one device (stage
    0, nothing left to train) every master is the saved fp32 value. Catches a checkpoint of the
    bf16 weights (a resume from their rounding), masters not reloaded (left at the rounding of
    the loaded bf16 weights) and moments cast to bf16 on load."""
    import torch

    from lightning_3d.checkpoint.checks import load_lightning_checkpoint

    half = 2
    straight = _resume_run(2, 1, 2 * half)
    _resume_run(2, 1, half, save_to=str(tmp_path / "run.ckpt"))
    path = str(tmp_path / f"run-step={half}.ckpt")
    saved = load_lightning_checkpoint(path)
    weights = {k: v for k, v in saved["state_dict"].items() if v.is_floating_point()}
    assert all(v.dtype == torch.float32 for v in weights.values())
    moments = [s["exp_avg_sq"] for s in saved["optimizer_states"][0]["state"].values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)

    resumed = _resume_run(2, 2, 2 * half, resume_from=path)
    assert resumed["losses"] == straight["losses"][half:]
    for name, value in straight["state"].items():
        torch.testing.assert_close(resumed["state"][name], value, rtol=0, atol=0, msg=name)

    loaded = _resume_run(1, 0, half, resume_from=path)
    for name, value in weights.items():
        torch.testing.assert_close(loaded["state"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_masters_with_pipeline_stages_match_one_process(runs, stage):
    """pipeline=2 x data=2: each stage's engine keeps the masters of its own layers, and
    ``full_state_dict`` (as a checkpoint) merges them over the stages. Catches a stage whose
    masters are missing from the merged weights (they would be the bf16 parameters), a
    schedule's micro-batches reduced more than once."""
    (reference,) = runs(0, 1, "scale")
    world = runs(stage, 4, "scale", pipeline=2)
    _assert_updates_match(world[0], reference, dtypes=True)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_reduction_matches_one_process(runs, stage):
    """``zero_reduce_dtype="fp32"``: fp32 gradient buffers, accumulated and reduced in fp32,
    against the one-process reference (bf16 buffers: the difference is rounding). Catches an
    fp32 buffer whose gradients are not cast on the way in or out (a wrong dtype fails the
    step) or are reduced without the mean (SGD: the update doubles)."""
    (reference,) = runs(0, 1, "scale")
    world = runs(stage, 2, "scale", zero_reduce_dtype="fp32")
    _assert_updates_match(world[0], reference)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_masters_with_tensor_parallel_match_one_process(runs, stage):
    """data=2 x tensor=2: the masters of tp-sharded and tp-replicated buckets (DTensor slices on
    the (dp, tp) mesh), the clip norm counting each element once. Catches a master slice whose
    tp placement is lost (a replicated weight counted twice in the norm, or a sharded one once)."""
    (reference,) = runs(0, 1, "clip")
    world = runs(stage, 4, "clip", tensor=2)
    _assert_updates_match(world[0], reference)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_masters_with_context_parallel_match_one_process(runs, stage):
    """data=2 x context=2: ZeRO shards over the flattened data x context axis; the masters follow
    the slices. Catches masters sharded over data alone (context ranks would step the same
    slice twice, or miss one)."""
    (reference,) = runs(0, 1, "scale")
    world = runs(stage, 4, "scale", context=2)
    _assert_updates_match(world[0], reference, dtypes=True)


def test_bad_master_options_are_refused_naming_the_values():
    from lightning_3d.options import Plan

    with pytest.raises(ValueError, match="zero_reduce_dtype must be one of .*got 'fp16'"):
        Plan.from_options(zero_reduce_dtype="fp16")
    with pytest.raises(ValueError, match="zero_master_weights must be True or False, got 'yes'"):
        Plan.from_options(zero_master_weights="yes")


@pytest.mark.parametrize(
    "stage, precision, gigabytes",
    [(0, "bf16-true", 120), (1, "bf16-true", 31.4), (2, "bf16-true", 16.6), (3, "bf16-mixed", 1.9)],
)
def test_planner_predicts_the_papers_figure_1(stage, precision, gigabytes):
    """The ZeRO paper's Figure 1: 7.5B parameters, N = 64, mixed-precision Adam: 120 GB, 31.4,
    16.6 and 1.9 GB a device at stages 0-3. ZeRO 0-2 get it under bf16-true (fp32 masters);
    ZeRO-3 under bf16-mixed (FSDP2: fp32 shards, bf16 compute). Catches the planner pricing
    bf16-true's optimizer state at bf16 moments without masters (4 bytes: 60 GB at stage 0)."""
    import dataclasses

    from lightning_3d.planner.choice import Choice
    from lightning_3d.planner.facts import Part
    from lightning_3d.planner.memory import model_state
    from tools.calibration.layouts import tiny_facts

    facts = dataclasses.replace(tiny_facts(), precision=precision)
    params, grads, optimizer, host, disk = model_state(
        facts, Choice(64, 1, 1, stage), Part(params=7_500_000_000)
    )
    assert host == disk == 0
    assert round((params + grads + optimizer) / 1e9, 1) == gigabytes


def _lora_run(stage: int, data: int) -> list[dict]:
    run = Run(
        strategy={"zero_stage": stage},
        devices=data,
        steps=STEPS,
        arch="hf_llama",
        model={"adapter": {"method": "lora", "r": 4, "lora_alpha": 8}, **SGD},
        trainer=SETUPS["scale"],
    )
    return run_world(fit_gpt_ranks, data, run)


@pytest.mark.slow
def test_lora_adapters_get_masters_and_the_frozen_base_stays_bf16():
    """LoRA under bf16-true: only the adapters train, so only they get fp32 masters (saved as
    fp32); the frozen base stays bf16 and unchanged. data=2 ZeRO-1 against one process in the
    same mode. Catches the frozen base bucketed (and given masters), adapters' gradients not
    averaged over the data ranks (SGD: the update doubles)."""
    import torch

    from lightning_3d.adapters import is_adapter_name

    (reference,) = _lora_run(0, 1)
    world = _lora_run(1, 2)
    assert loss_mismatches(world[0]["losses"], reference["losses"], rtol=1e-2) == []
    state, initial = world[0]["state"], reference["initial_state"]
    adapters = {k: v for k, v in state.items() if is_adapter_name(k)}
    assert adapters and all(v.dtype == torch.float32 for v in adapters.values())
    start = {k: v.bfloat16().float() for k, v in initial.items()}
    assert update_mismatches(adapters, reference["state"], start, UPDATE_RTOL, UPDATE_ATOL) == []
    for name, value in state.items():
        if not is_adapter_name(name) and name in initial and value.is_floating_point():
            assert value.dtype == torch.bfloat16, name
            torch.testing.assert_close(value, initial[name].bfloat16(), rtol=0, atol=0)


def _bytes_sent_per_step(rank: int) -> dict:
    """Bytes each ZeRO-2 step hands to its reductions (every launched bucket's full-size
    gradient), at 1 micro-batch a step and at 4 with and without ``defer_reduce``, and the
    gradient shards the optimizer gets."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.parallel.masters import MASTER_DTYPE
    from lightning_3d.parallel.zero import ZeroDataParallel

    class Counting(ZeroDataParallel):
        sent = 0

        def _launch(self, bucket):  # each launch reduces one bucket's full-size gradient
            self.sent += bucket.flat.numel() * bucket.shard_grad.element_size()
            super()._launch(bucket)

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    out = {}
    for micro, defer in ((1, False), (4, False), (4, True)):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3))).bfloat16()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        engine = Counting(mesh, 2, master_dtype=MASTER_DTYPE, defer_reduce=defer)
        engine.attach(optimizer)
        torch.manual_seed(rank)
        batches = torch.randn(4, 8, 64, dtype=torch.bfloat16).chunk(micro)
        for i, batch in enumerate(batches):
            engine.prepare_backward(sync=i == micro - 1)
            net(batch).float().square().sum().backward()  # summed: the whole batch's
            engine.finish_backward()
        out[micro, defer] = (engine.sent, [b.slice.grad.to_local().clone() for b in engine.buckets])
        optimizer.step()
        engine.after_step()
    return out


def test_deferred_zero2_reduction_sends_one_steps_bytes_at_4_micro_batches():
    """``zero2_defer_reduce``: at 4 accumulated micro-batches a ZeRO-2 step reduces once, the
    bytes of a 1-micro-batch step (without it: 4 times those), to the same gradients up to
    bf16 rounding. Catches a deferred step that still reduces per micro-batch, or that drops the
    earlier micro-batches' gradients (the shards would differ by far more than rounding)."""
    import torch

    for rank_out in run_world(_bytes_sent_per_step, 2):
        one, _ = rank_out[1, False]
        eager, eager_grads = rank_out[4, False]
        deferred, deferred_grads = rank_out[4, True]
        _, whole_grads = rank_out[1, False]
        assert one > 0 and eager == 4 * one and deferred == one
        for got, want in zip(deferred_grads, whole_grads):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        for got, want in zip(eager_grads, whole_grads):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("stage", [1, 2])
def test_built_layout_matches_the_planner_under_bf16_true(stage):
    """The planner's validation (``parallelism=auto`` with ``validate``) builds a bf16-true rank
    in a fake 8-rank world and compares its bytes with the prediction: the masters are counted
    as optimizer state on both sides. Catches a planner that prices bf16-true at bf16 moments
    (4 bytes, not 12) while the engine keeps fp32 masters, or the other way round."""
    import torch

    from lightning_3d.models import LitGPT
    from lightning_3d.planner.choice import Choice
    from lightning_3d.planner.facts import model_facts
    from lightning_3d.strategy.choice_check import validate_layout

    tiny = dict(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=32)

    def make():
        with torch.device("meta"):
            return LitGPT(**tiny)

    facts = model_facts(make(), precision="bf16-true", tp_sizes=(1, 2), policies=("none",))
    choice = Choice(data=4, tensor=2, pipeline=1, zero_stage=stage, batch_per_rank=2)
    assert not validate_layout(make, facts, choice, "bf16-true").problems


def _skip_a_step(rank: int, stage: int) -> dict:
    """The tiny GPT under bf16-true at data=2, with an infinite loss on rank 0 at step 1 and
    ``nonfinite="skip"``: the masters (fp32) after every step, and the optimizer's step counts."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_3d import ThreeDStrategy
    from lightning_3d.data import TextDataModule
    from lightning_3d.models import LitGPT
    from tools.harness.runs import TINY_DATA, TINY_MODEL

    class InfAt(LitGPT):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            bad = rank == 0 and self.trainer.global_step == 1
            return loss * float("inf") if bad else loss

    class Masters(Callback):
        def __init__(self):
            self.after = {}

        def on_train_start(self, trainer, pl_module):
            self.on_train_batch_end(trainer, pl_module)

        def on_train_batch_end(self, trainer, pl_module, *args):
            masters = trainer.strategy.full_state_dict()  # a collective: every rank
            self.after[trainer.global_step] = {k: v.clone() for k, v in masters.items()}

    L.seed_everything(1234, verbose=False)
    snapshots = Masters()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ThreeDStrategy(zero_stage=stage, nonfinite="skip", max_nonfinite_skips=1),
        precision="bf16-true",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[snapshots],
    )
    trainer.fit(InfAt(**TINY_MODEL), TextDataModule(seed=1234, **TINY_DATA))
    optimizer = trainer.strategy.optimizers[0]
    return {
        "after": snapshots.after,
        "adam_steps": sorted({int(s["step"]) for s in optimizer.state.values() if "step" in s}),
        "skipped": list(trainer.strategy.precision_plugin.nonfinite.skipped),
    }


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_a_skipped_step_leaves_the_masters_as_they_were(stage):
    """One rank's infinite loss at global step 1 makes both ranks skip that step: the fp32
    masters after it equal those before it, Adam stepped twice in 3 steps, and the steps around
    it moved the masters. Catches a skip that still steps the
    masters, or carries the step's NaN gradients into the next step (non-finite masters)."""
    import torch

    for rank, run in enumerate(run_world(_skip_a_step, 2, stage)):
        after = run["after"]
        assert run["skipped"] == [1] and run["adam_steps"] == [2], rank
        assert sorted(after) == [0, 1, 2, 3], rank  # after[s]: the weights after s steps
        same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
        assert same(after[2], after[1]), rank  # the step run at global step 1 was skipped
        assert not same(after[1], after[0]) and not same(after[3], after[2]), rank
        assert all(v.dtype == torch.float32 for v in after[3].values() if v.dim() == 2), rank
        assert all(torch.isfinite(v).all() for v in after[3].values()), rank


@pytest.mark.slow
def test_a_tied_weight_across_pipeline_stages_keeps_one_master():
    """GPT-2's tied embedding and head on two pipeline stages: each stage's copy has its own
    master, stepped with the gradient summed over both stages, so the copies stay equal (the
    strategy's replica check at the first step) and match one process. Catches a tie's copies
    whose masters part ways (one stage's gradient only)."""
    (reference,) = _tied_run(0, 1)
    world = _tied_run(1, 2, pipeline=2)
    _assert_updates_match(world[0], reference, dtypes=True, norm_keys=("ln", "norm"))
    ties = world[0]["ties"]
    assert ties, "the tiny GPT-2 ties its embedding and head"


def _tied_run(stage: int, world: int, **strategy) -> list[dict]:
    run = Run(
        strategy={"zero_stage": stage, **strategy},
        devices=world,
        steps=STEPS,
        arch="hf_gpt2",
        model=SGD,
        trainer=SETUPS["scale"],
    )
    return run_world(fit_gpt_ranks, world, run)


@pytest.mark.slow
def test_a_pipeline_checkpoint_holds_every_stages_masters(tmp_path):
    """Saved at pipeline=2 ZeRO-1: every weight in the file is its stage's fp32 master (merged
    over the stages), and one device loads them exactly. Catches a checkpoint that keeps only
    the saving stage's masters (the other stage's weights would be bf16 roundings)."""
    import torch

    from lightning_3d.checkpoint.checks import load_lightning_checkpoint

    saved_run = _resume_run(2, 1, 2, save_to=str(tmp_path / "pp.ckpt"), pipeline=2)
    path = str(tmp_path / "pp-step=2.ckpt")
    weights = {
        k: v for k, v in load_lightning_checkpoint(path)["state_dict"].items() if v.dim() == 2
    }
    assert weights and all(v.dtype == torch.float32 for v in weights.values())
    assert all(not torch.equal(v, v.bfloat16().float()) for v in weights.values())
    for name, value in weights.items():
        torch.testing.assert_close(saved_run["state"][name], value, rtol=0, atol=0, msg=name)
    loaded = _resume_run(1, 0, 2, resume_from=path)
    for name, value in weights.items():
        torch.testing.assert_close(loaded["state"][name], value, rtol=0, atol=0, msg=name)
