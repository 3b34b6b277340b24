"""A NaN/inf loss, gradient or gradient norm stops the run (or skips the step) before the step applies it.

The dp2 runs inject an infinite loss on ONE rank at known global steps (the other rank's loss
stays finite), so they also catch a check that is not agreed over the ranks: that rank would
stop alone and its peer would hang in the next collective (run_world's timeout) or step on.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_3d.options import Plan
from lightning_3d.runtime.nonfinite import (
    NonFiniteError,
    NonFiniteGuard,
    NonFiniteOptions,
    SkipStep,
)
from tools.harness.runs import TINY_DATA, TINY_MODEL
from tools.harness.world import run_world

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 300.0
# A stray launcher variable would make the app think it is a rank already.
LAUNCHER_KEYS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_PROCID", "HYDRA_FULL_ERROR")


class _NanBackward(torch.autograd.Function):
    """The identity forward; NaN gradients backward: a finite loss with NaN gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def _fit_with_inf(rank, strategy, bad, steps, model=None, nan_grad=False):
    """Train the tiny GPT on 2 ranks with an infinite loss on the ranks ``bad[step]`` at each
    global step in ``bad`` (``nan_grad``: a finite loss, and NaN gradients from the first block
    down on those ranks; under a pipeline only the stage holding that block has it). Returns the
    error (or None), the weights after each completed step, the final weights, the optimizer's
    step counts and the steps the plugin skipped."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_3d import ThreeDStrategy
    from lightning_3d.data import TextDataModule
    from lightning_3d.models import LitGPT

    class InfAt(LitGPT):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if self._bad() and not nan_grad else loss

        def pipeline_training_step_end(self, loss, batch, batch_idx):
            # Under pp2 the schedule's loss is not this step's: the NaN comes from a gradient.
            super().pipeline_training_step_end(loss, batch, batch_idx)

        def _bad(self):
            return rank in bad.get(self.trainer.global_step, ())

        def on_train_start(self):
            first = dict(self.named_modules()).get("model.blocks.0")
            if nan_grad and first is not None:
                first.register_forward_hook(
                    lambda mod, args, out: _NanBackward.apply(out) if self._bad() else out
                )

    class Snapshots(Callback):
        def __init__(self):
            self.after = {0: _weights(module)}

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.after[trainer.global_step] = _weights(pl_module)

    L.seed_everything(1234, verbose=False)
    module = InfAt(**{**TINY_MODEL, **(model or {})})
    snapshots = Snapshots()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ThreeDStrategy(**strategy),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[snapshots],
    )
    error = None
    try:
        trainer.fit(module, TextDataModule(seed=1234, **TINY_DATA))
    except NonFiniteError as err:
        error = (str(err), err.step)
    optimizer = trainer.strategy.optimizers[0]
    adam_steps = sorted({int(s["step"]) for s in optimizer.state.values() if "step" in s})
    return {
        "error": error,
        "after": snapshots.after,
        "final": _weights(module),
        "adam_steps": adam_steps,
        "skipped": list(trainer.strategy.precision_plugin.nonfinite.skipped),
    }


def _weights(module):
    """This rank's values (its shards under ZeRO-3): compared across steps of one rank."""
    from lightning_3d.parallel.tensor import local_tensor

    return {k: local_tensor(v).detach().clone() for k, v in module.state_dict().items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_the_options_are_checked_before_any_work():
    plan = Plan.from_options(nonfinite="skip", max_nonfinite_skips=3)
    assert (plan.nonfinite.action, plan.nonfinite.max_skips) == ("skip", 3)
    assert Plan().nonfinite.action == "stop"
    with pytest.raises(
        ValueError, match=r"nonfinite must be one of \('stop', 'skip'\), got 'ignore'"
    ):
        Plan.from_options(nonfinite="ignore")
    with pytest.raises(ValueError, match="max_nonfinite_skips must be a whole number >= 0, got -1"):
        Plan.from_options(max_nonfinite_skips=-1)


def test_a_nan_loss_on_one_rank_stops_every_rank_before_the_step():
    """Rank 1's loss is infinite at global step 2: both ranks stop there, naming step 2 and rank
    1, with the weights of step 2's start (the NaN update was never applied). Catches: a check
    after the optimizer step (weights NaN), a check on rank 1 only (rank 0 hangs or steps on)."""
    runs = run_world(_fit_with_inf, 2, {"zero_stage": 2}, {2: (1,)}, 6, timeout=TIMEOUT)
    for rank, run in enumerate(runs):
        assert run["error"] is not None, rank
        message, step = run["error"]
        assert step == 2 and "global step 2" in message and "rank(s) [1]" in message, (
            rank,
            message,
        )
        assert sorted(run["after"]) == [0, 1, 2], rank  # no step completed after the bad one
        assert _same(run["final"], run["after"][2]), rank
        assert not _same(run["after"][2], run["after"][1]), rank  # the good steps did train
        assert all(torch.isfinite(v).all() for v in run["final"].values()), rank


@pytest.mark.parametrize(
    "strategy",
    [
        {"zero_stage": 0},
        {"zero_stage": 1},
        {"zero_stage": 2},
        {"zero_stage": 3},
        {"pipeline": 2, "micro_batches": 2},
    ],
    ids=["zero0", "zero1", "zero2", "zero3", "pp2"],
)
def test_nan_gradients_under_a_finite_loss_stop_every_rank_before_the_step(strategy):
    """One rank's gradients turn NaN at global step 2 while every loss stays finite (rank 1; under
    pp2 rank 0, the stage holding the first block, while the loss lives on rank 1). Both ranks
    stop at step 2 with step 2's starting weights. Broken variant caught (seen failing):
    ``NonFiniteGuard.resolve`` reading the loss flags only: the NaN update is applied."""
    bad_rank = 0 if "pipeline" in strategy else 1
    runs = run_world(_fit_with_inf, 2, strategy, {2: (bad_rank,)}, 4, None, True, timeout=TIMEOUT)
    for rank, run in enumerate(runs):
        assert run["error"] is not None, rank
        message, step = run["error"]
        assert step == 2 and "non-finite gradient" in message, (rank, message)
        assert sorted(run["after"]) == [0, 1, 2], rank
        assert _same(run["final"], run["after"][2]), rank
        assert all(torch.isfinite(v).all() for v in run["final"].values()), rank


@pytest.mark.parametrize(
    "bad, max_skips, stops_at",
    [
        ({1: (0,), 3: (1,)}, 2, None),
        pytest.param(
            {1: (0,), 2: (0,)}, 1, 2, marks=pytest.mark.slow
        ),  # the bound alone: test_the_skip_bound
    ],
    ids=["within_bound", "bound_exceeded"],
)
def test_skip_mode_drops_the_bad_steps_and_stops_past_the_bound(bad, max_skips, stops_at):
    """A skipped step leaves the weights and the optimizer (Adam's step count, ZeRO-1 slices)
    as they were, on both ranks; once more than max_nonfinite_skips steps were skipped the run
    stops naming them. Catches: a skipped step whose NaN gradients are applied or carried into
    the next step, an optimizer stepped with no gradient (Adam's step count moves), no bound."""
    strategy = {"zero_stage": 1, "nonfinite": "skip", "max_nonfinite_skips": max_skips}
    runs = run_world(_fit_with_inf, 2, strategy, bad, 5, timeout=TIMEOUT)
    for rank, run in enumerate(runs):
        after = run["after"]
        assert run["skipped"] == sorted(bad)[: len(bad) if stops_at is None else -1], rank
        if stops_at is None:
            assert run["error"] is None, (rank, run["error"])
            assert sorted(after) == [0, 1, 2, 3, 4, 5], rank
            assert run["adam_steps"] == [5 - len(bad)], rank
        else:
            message, step = run["error"]
            assert step == stops_at and f"after 1 skipped step(s) {sorted(bad)[:-1]}" in message, (
                rank,
                message,
            )
        for step in sorted(after)[1:]:  # the weights after step s moved iff step s - 1 was good
            assert _same(after[step], after[step - 1]) == (step - 1 in bad), (rank, step)
        assert all(torch.isfinite(v).all() for v in run["final"].values()), rank


def test_the_skip_bound_counts_every_skipped_step_and_names_them():
    guard = NonFiniteGuard(NonFiniteOptions("skip", max_skips=2))
    for step in (4, 9):
        guard.step = step
        with pytest.raises(SkipStep, match=f"global step {step}"):
            guard.check_norm(torch.tensor(float("nan")))
    guard.step = 12
    guard.check_norm(torch.tensor(3.0))  # a finite norm is no skip
    with pytest.raises(
        NonFiniteError, match=r"after 2 skipped step\(s\) \[4, 9\] \(max_nonfinite_skips=2\)"
    ) as err:
        guard.check_norm(torch.tensor(float("inf")))
    assert err.value.step == 12
    stop = NonFiniteGuard()
    with pytest.raises(NonFiniteError, match="non-finite gradient norm \\(nan\\) at global step 0"):
        stop.check_norm(torch.tensor(float("nan")))


@pytest.mark.slow
def test_a_diverging_pipeline_stops_both_stages_at_the_same_step():
    """pp2, lr 1e6, no clipping: the loss turns NaN on the last stage, which the pipeline
    broadcasts; both stages stop at the same step with their weights of that step's start."""
    runs = run_world(
        _fit_with_inf, 2, {"pipeline": 2, "micro_batches": 2}, {}, 20, {"lr": 1e6}, timeout=TIMEOUT
    )
    steps = {run["error"][1] for run in runs if run["error"] is not None}
    assert len(steps) == 1 and all(run["error"] is not None for run in runs), [
        run["error"] for run in runs
    ]
    step = steps.pop()
    for rank, run in enumerate(runs):
        assert "non-finite" in run["error"][0] and step >= 1, (rank, run["error"])
        assert sorted(run["after"])[-1] == step and _same(run["final"], run["after"][step]), rank
        assert all(torch.isfinite(v).all() for v in run["final"].values()), rank


def _fp16_clipped(rank):
    from lightning.pytorch.plugins.precision import MixedPrecision

    from tools.harness.runs import Run, fit_gpt

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**36, backoff_factor=2.0**-8)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    return fit_gpt(
        rank,
        Run(
            strategy={"zero_stage": 2},
            devices=2,
            steps=6,
            model={"optimizer": "sgd", "lr": 0.3},
            trainer={"plugins": [plugin], "gradient_clip_val": 1.0},
        ),
    )


def test_16_mixed_overflow_with_clipping_is_the_scalers_skip_not_an_error():
    """Scale 2**36 overflows fp16 for the first 3 steps: their gradient norm is inf, which the
    grad scaler handles (skip, back off 3 times); the run trains on. Catches: a norm check that
    treats a scaler overflow as divergence (the run stops at step 0)."""
    runs = run_world(_fp16_clipped, 2, timeout=TIMEOUT)
    for run in runs:
        assert run["loss_scale"] == 2.0**36 * (2.0**-8) ** 3
        assert len(run["losses"]) == 6 and all(torch.isfinite(torch.tensor(run["losses"])))


def _app(tmp_path, *overrides):
    return subprocess.run(
        [
            sys.executable,
            "examples/train.py",
            "model=gpt_tiny",
            "data.batch_size=8",
            "data.max_bytes=300000",
            "trainer.limit_val_batches=0",
            f"hydra.run.dir={tmp_path}",
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={
            **{k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS},
            "OMP_NUM_THREADS": "1",
        },
    )


def test_the_app_stops_a_diverging_run_with_an_error_and_no_final_checkpoint(tmp_path):
    """``model.lr=1e6``: training turns NaN within a few steps. Catches the old behaviour: NaN
    losses, "done", exit 0 and a NaN final.ckpt."""
    proc = _app(tmp_path, "model.lr=1e6", "trainer.max_steps=20")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: non-finite" in proc.stderr and "global step" in proc.stderr, proc.stderr[-3000:]
    assert "done" not in proc.stdout
    assert not (tmp_path / "final.ckpt").exists()


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["trainer.max_steps=0"], "trainer.max_steps=0 trains no step"),
        (["trainer.max_steps=-2"], "trainer.max_steps=-2 trains no step"),
        (["parallelism.nonfinite=ignore"], "nonfinite must be one of"),
        (
            ["parallelism.max_nonfinite_skips=-1"],
            "max_nonfinite_skips must be a whole number >= 0, got -1",
        ),
    ],
)
def test_the_app_refuses_max_steps_0_and_bad_nonfinite_options_up_front(overrides, named):
    """validate() (the app's exit 2, before any rank starts). Catches the old max_steps=0 run:
    it trained nothing, saved untrained weights and ended in KeyError: 'steps'."""
    from hydra import compose, initialize_config_dir

    from lightning_3d.app.config import CONF_DIR, register_configs
    from lightning_3d.app.run import validate

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="train", overrides=overrides)
    with pytest.raises(ValueError, match=re.escape(named)):
        validate(cfg)
