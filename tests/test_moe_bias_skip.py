"""The aux-loss-free balancing bias on a step the non-finite agreement skips
(``nonfinite="skip"``): the step applies nothing, so the loads its forward counted move no bias
either, for the reference MoE GPT (``bias_update_rate``) and a Hugging Face family
(``router_bias_update_rate``, DeepSeek-V3's ``e_score_correction_bias``).

Each run plants NaN gradients on rank 0 at global step 1 of 3 (its first block's output gets a
NaN gradient; the loss stays finite): the step is skipped on every rank. Checked against one
process that skips the same step: every bias after each step (unchanged across the skipped step,
moved across the others), and the final weights.

The same under 16-mixed for a step the grad scaler skips (a scale that overflows fp16 for the
first steps: the scaler skips them and backs off), deepseek_v3 at dp2 against one process.

Broken variants caught (planted and reverted, seen failing): the bias moved after every optimizer
step, skipped or not (``step_skipped`` not read): the bias changes across step 1, for both
models; the grad scaler's overflow flag not consulted: the bias moves on the overflowed steps.
"""

from __future__ import annotations

import pytest
import torch

from tools.harness.parity import weight_mismatches
from tools.harness.runs import TINY_DATA, TINY_MODEL
from tools.harness.world import run_world

BAD_STEP = 1
STEPS = 3


class _NanBackward(torch.autograd.Function):
    """The identity forward; NaN gradients backward: a finite loss with NaN gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def _biases(module) -> dict:
    return {
        k: v.detach().clone().float()
        for k, v in module.state_dict().items()
        if k.endswith(("expert_bias", "e_score_correction_bias"))
    }


def _module(arch: str):
    if arch == "moe":
        from lightning_3d.models.moe import LitMoEGPT

        model = {**TINY_MODEL, "n_experts": 4, "top_k": 2, "bias_update_rate": 0.01}
        return LitMoEGPT(**model, optimizer="sgd", lr=0.1), "model.blocks.0"
    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_config

    module = HFCausalLM(
        config=tiny_config("deepseek_v3"), optimizer="sgd", lr=0.1, router_bias_update_rate=0.05
    )
    return module, "model.model.layers.0"


def fit_skipping(rank: int, arch: str, devices: int) -> dict:
    """``STEPS`` steps of ``arch`` on ``devices`` data ranks, NaN gradients on rank 0 at
    ``BAD_STEP``; the biases after each step, the final weights, the skipped steps."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_3d import ThreeDStrategy
    from lightning_3d.data import TextDataModule

    L.seed_everything(1234, verbose=False)
    module, first = _module(arch)

    def plant(block, args, out):
        bad = rank == 0 and module.trainer.global_step == BAD_STEP
        hidden = out[0] if isinstance(out, tuple) else out
        hidden = _NanBackward.apply(hidden) if bad else hidden
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    class Snapshots(Callback):
        def __init__(self):
            self.after = [_biases(module)]

        def on_train_start(self, trainer, pl_module):
            pl_module.get_submodule(first).register_forward_hook(plant)

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.after.append(_biases(pl_module))

    snapshots = Snapshots()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ThreeDStrategy(zero_stage=1, nonfinite="skip"),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[snapshots],
    )
    data = {**TINY_DATA, "batch_size": 4} if arch == "hf" else TINY_DATA
    trainer.fit(module, TextDataModule(seed=1234, **data))
    return {
        "after": snapshots.after,
        "state": trainer.strategy.full_state_dict() if rank == 0 else None,
        "skipped": list(trainer.strategy.precision_plugin.nonfinite.skipped),
    }


@pytest.mark.parametrize("arch", ["moe", "hf"])
def test_a_skipped_step_moves_no_bias(arch):
    """dp2 (NaN gradients on one rank at step 1) against one process skipping the same step:
    each bias unchanged across the skipped step, moved across the applied ones, and equal to
    one process's after every step; the final weights equal too."""
    if arch == "hf":
        pytest.importorskip("transformers")
    one = run_world(fit_skipping, 1, arch, 1)[0]
    ranks = run_world(fit_skipping, 2, arch, 2)
    assert one["skipped"] == [BAD_STEP] and all(r["skipped"] == [BAD_STEP] for r in ranks)
    after = one["after"]
    assert after[0]
    for step in range(STEPS):
        moved = any(not torch.equal(after[step + 1][k], after[step][k]) for k in after[0])
        assert moved == (step != BAD_STEP), f"step {step}: bias moved={moved}"
    for rank in ranks:
        for step, (mine, ref) in enumerate(zip(rank["after"], after)):
            bad = [k for k in ref if not torch.equal(mine[k], ref[k])]
            assert bad == [], f"after step {step}: {bad}"
    problems = weight_mismatches(ranks[0]["state"], one["state"], 1e-4, 1e-5)
    assert problems == [], "\n".join(problems)


def fit_overflowing(rank: int, devices: int) -> dict:
    """deepseek_v3 under 16-mixed with a grad scale that overflows fp16 at first (the scaler skips
    those steps and backs off): the biases and the scale after each step. (The reference MoE GPT
    does not run under autocast: its fp16 expert outputs meet an fp32 sum.)"""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_3d import ThreeDStrategy
    from lightning_3d.data import TextDataModule

    L.seed_everything(1234, verbose=False)
    module, _ = _module("hf")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**36, backoff_factor=2.0**-8)

    class Snapshots(Callback):
        def __init__(self):
            self.after, self.scales = [_biases(module)], [scaler.get_scale()]

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.after.append(_biases(pl_module))
            # The strategy's copy of the scaler (adapted to agree on overflows) is the one used.
            self.scales.append(trainer.precision_plugin.scaler.get_scale())

    snapshots = Snapshots()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ThreeDStrategy(zero_stage=1),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        max_steps=OVERFLOW_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[snapshots],
    )
    trainer.fit(module, TextDataModule(seed=1234, **{**TINY_DATA, "batch_size": 4}))
    return {"after": snapshots.after, "scales": snapshots.scales}


OVERFLOW_STEPS = 5


def test_a_step_the_grad_scaler_skips_moves_no_bias():
    """16-mixed, dp2: a step whose gradients overflow (the scaler skips it and lowers the scale)
    leaves every bias as it was; the others move it, as one process's do."""
    one = run_world(fit_overflowing, 1, 1)[0]
    ranks = run_world(fit_overflowing, 2, 2)
    scales, after = one["scales"], one["after"]
    skipped = [scales[s + 1] < scales[s] for s in range(OVERFLOW_STEPS)]
    assert any(skipped) and not all(skipped), scales
    for step in range(OVERFLOW_STEPS):
        moved = any(not torch.equal(after[step + 1][k], after[step][k]) for k in after[0])
        assert moved != skipped[step], f"step {step}: bias moved={moved}, scales {scales}"
    for rank in ranks:
        assert rank["scales"] == scales
        for step, (mine, ref) in enumerate(zip(rank["after"], after)):
            bad = [k for k in ref if not torch.allclose(mine[k], ref[k])]
            assert bad == [], f"after step {step}: {bad}"
