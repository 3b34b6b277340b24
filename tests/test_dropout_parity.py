"""The reference GPT trained with dropout on, under each layout, against a run that draws the
same masks (losses and every tensor's weights).

What makes masks comparable differs by layout:

- **data parallel** (ZeRO 0-3): every rank draws from the same seed, as Lightning seeds them, so
  rank r's masks are those of rank r in Lightning's own ``DDPStrategy``: the reference is that
  independent implementation, dropout on, same sampler.
- **tensor parallel**: dropout on the replicated residual stream (embeddings, attention output,
  MLP output) draws on every tensor rank the mask one process draws (same seed, same shapes,
  same order); attention-weight dropout acts on the rank's own heads, so it is off
  (``attn_dropout=0``). The reference is one process under the strategy, which re-seeds at
  start as multi-process strategies do.
- **pipeline**: a stage draws from its own stream, never one process's, so no mask matches.
  What is checked instead: every stage's dropout modules drop in training (and nothing is
  dropped in validation), so a stage that skips its dropout or trains in eval mode fails.

A Hugging Face model (GPT-2, every dropout at 0.1) is held to Lightning's DDP the same way.

Broken variants caught (seen failing): the model trained in eval mode (``LitGPT`` calling
``self.eval()`` at ``on_train_start``): every case; dropout skipped on pipeline stages
(``Dropout`` replaced by ``Identity`` on stage 1): the pipeline case.
"""

from __future__ import annotations

import pytest
import torch

from tools.harness.parity import assert_same_run
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

SEED = 1234
STEPS = 4
DROPOUT = {"dropout": 0.1}


@pytest.fixture(scope="module")
def ddp_reference():
    """Lightning's own DDP on 2 ranks, dropout on (``strategy=None``: the Trainer's choice)."""
    runs = run_world(fit_gpt, 2, Run(devices=2, steps=STEPS, seed=SEED, model=DROPOUT))
    plain = run_world(fit_gpt, 2, Run(devices=2, steps=STEPS, seed=SEED))
    assert runs[0]["losses"] != plain[0]["losses"]  # the dropout is on
    return runs[0]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_with_dropout_matches_lightnings_ddp(ddp_reference, zero):
    run = run_world(
        fit_gpt,
        2,
        Run(strategy={"zero_stage": zero}, devices=2, steps=STEPS, seed=SEED, model=DROPOUT),
    )
    assert_same_run(run[0], ddp_reference, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("zero", [1, 3])
def test_a_hugging_face_model_with_dropout_under_data_parallelism_matches_lightnings_ddp(zero):
    """GPT-2 from transformers, every dropout it has at 0.1 (tensor and pipeline cases with
    dropout: tests/test_hf_families.py)."""
    common = dict(
        devices=2,
        steps=STEPS,
        seed=SEED,
        arch="hf_gpt2",
        model={"hf": {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}},
    )
    ddp = run_world(fit_gpt, 2, Run(**common))[0]
    if zero == 1:  # the dropout is on (once is enough)
        assert ddp["losses"] != run_world(fit_gpt, 2, Run(**{**common, "model": None}))[0]["losses"]
    run = run_world(fit_gpt, 2, Run(strategy={"zero_stage": zero}, **common))[0]
    assert_same_run(run, ddp, rtol=2e-5, atol=2e-5)


def test_tensor_parallel_with_residual_dropout_matches_one_process():
    model = {**DROPOUT, "attn_dropout": 0.0}
    one = run_world(fit_gpt, 1, Run(strategy={}, devices=1, steps=STEPS, seed=SEED, model=model))[0]
    plain = run_world(fit_gpt, 1, Run(strategy={}, devices=1, steps=STEPS, seed=SEED))[0]
    assert one["losses"] != plain["losses"]
    tp = run_world(
        fit_gpt, 2, Run(strategy={"tensor": 2}, devices=2, steps=STEPS, seed=SEED, model=model)
    )[0]
    assert_same_run(tp, one, rtol=2e-5, atol=2e-5)


def _dropout_seen(rank: int) -> dict:
    """pp2 with dropout 0.1: for each Dropout module this stage runs, whether it ran in training
    mode and zeroed elements, in training and in validation."""
    import lightning as L

    from lightning_3d import ThreeDStrategy
    from lightning_3d.data import TextDataModule
    from lightning_3d.models import LitGPT
    from tools.harness.runs import TINY_DATA, TINY_MODEL

    seen: dict = {}

    class Watched(LitGPT):
        def on_fit_start(self):
            for name, module in self.named_modules():
                if isinstance(module, torch.nn.Dropout):
                    module.register_forward_hook(self._record(name))

        def _record(self, name):
            def hook(module, args, out):
                if args[0].device.type == "meta" or bool((args[0] == 0).all()):
                    return  # the pipeline's shape inference, not a step
                phase = "train" if self.trainer.training else "eval"
                # zeroed: an element that was not zero before (an exact zero in the input, as an
                # activation may give, is no drop: CI read one as a drop in validation)
                dropped = bool(((out == 0) & (args[0] != 0)).any())
                seen.setdefault((phase, name), []).append((module.training, dropped))

            return hook

    L.seed_everything(SEED, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ThreeDStrategy(pipeline=2, micro_batches=2),
        max_steps=2,
        val_check_interval=2,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Watched(**{**TINY_MODEL, **DROPOUT}), TextDataModule(seed=SEED, **TINY_DATA))
    return seen


def test_every_pipeline_stage_drops_in_training_and_not_in_validation():
    stages = run_world(_dropout_seen, 2)
    for rank, seen in enumerate(stages):
        trained = {name for (phase, name) in seen if phase == "train"}
        assert trained, f"stage {rank} ran no dropout"
        for (phase, name), calls in seen.items():
            # In training mode at every call, and dropping (a call may drop nothing).
            if phase == "train":
                assert (
                    all(training for training, _ in calls)
                    and sum(z for _, z in calls) > len(calls) // 2
                ), (rank, name, calls)
            else:
                assert not any(training or zeroed for training, zeroed in calls), (
                    rank,
                    name,
                    calls,
                )
        # Validation ran them all.
        assert {name for (phase, name) in seen if phase == "eval"} == trained, rank
    names = [set(name for _, name in seen) for seen in stages]
    assert not names[0] & names[1]  # each stage its own blocks' dropout: the split is real
