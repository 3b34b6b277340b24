"""Under ``pipeline=2`` the module's own training-step code runs where the schedule lets it, or
is refused before training; what Lightning reports of the step is the whole model's, as under
``ddp``.

The schedule runs forward and backward of the batch in place of ``training_step``; the module
ends the step in ``pipeline_training_step_end(loss, batch, batch_idx)``
(``lightning_3d/strategy/pipeline_step.py``). One 2-rank world fits the same module under
Lightning's ``ddp`` (4 samples a rank and step) and under ``pipeline=2`` (one data rank: the 8
samples of both) for 4 SGD steps, then once more under ``pipeline=2`` with a hook that raises.
Compared with ``ddp``: the keys the module logged and their values, ``on_before_backward`` /
``on_after_backward`` (called once a step, the loss they see, the gradients they see),
:func:`lightning_3d.observe.grad_norm.grad_norm`, and the weights after fit
(``strategy.full_state_dict()``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tools.harness.parity import weight_mismatches
from tools.harness.world import run_world

SAMPLES, RANK_BATCH, SEQ, VOCAB = 32, 4, 8, 32
MODEL = dict(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, warmup_steps=1)
PP2 = {"pipeline": 2, "micro_batches": 2}


def _module(raise_in_hook: bool = False) -> Any:
    import torch

    from lightning_3d.models import LitGPT
    from lightning_3d.observe.grad_norm import grad_norm

    class Observed(LitGPT):
        """Logs its own loss key (not ``train_loss``) and records what Lightning's hooks see."""

        def __init__(self) -> None:
            super().__init__(**MODEL, optimizer="sgd", lr=0.1)
            self.records: dict[str, list] = {"before": [], "after": [], "norm": [], "stage": []}

        def _end(self, loss: Any, batch: Any) -> None:
            self.log("my_loss", loss, sync_dist=True)
            self.log("samples", float(batch[2].numel()), reduce_fx="sum", sync_dist=True)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self._loss(batch[:2])
            self._end(loss, batch)
            return loss

        def pipeline_training_step_end(self, loss: Any, batch: Any, batch_idx: int) -> None:
            if raise_in_hook and batch_idx == 1:
                raise ValueError("raised in the hook")
            self._end(loss, batch)

        def _grads(self) -> list[bool]:
            return [p.grad is not None for p in self.parameters()]

        def on_before_backward(self, loss: Any) -> None:
            self.records["before"].append((float(loss), any(self._grads())))

        def on_after_backward(self) -> None:
            self.records["after"].append(all(self._grads()))

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            from lightning.pytorch.utilities import grad_norm as stage_grad_norm

            norms = grad_norm(self, 2)
            self.records["norm"].append({k: float(v) for k, v in norms.items()})
            self.records["stage"].append(float(stage_grad_norm(self, 2)["grad_2.0_norm_total"]))

    torch.manual_seed(0)
    return Observed()


def _loader(batch_size: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(SAMPLES))
    return DataLoader(data, batch_size=batch_size)


def _fit(rank: int) -> dict[str, Any]:
    """``ddp``, ``pp2``, then ``pp2`` with a raising hook, one Trainer after another."""
    import lightning as L

    from lightning_3d import ThreeDStrategy

    out: dict[str, Any] = {}
    for name in ("ddp", "pp2", "pp2_raises"):
        pipeline = name != "ddp"
        module = _module(raise_in_hook=name == "pp2_raises")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=ThreeDStrategy(**PP2) if pipeline else "ddp",
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        error = None
        try:  # ddp: each rank 4 of every 8 samples; pp2: one data rank, all 8
            trainer.fit(module, _loader(RANK_BATCH * (2 if pipeline else 1)))
        except ValueError as err:
            error = str(err)
        if pipeline and error is None:
            weights = trainer.strategy.full_state_dict()
        else:
            weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
        out[name] = {
            "error": error,
            "step": trainer.global_step,
            "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "records": module.records,
            "weights": weights,
        }
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_fit, 2, timeout=300)


def test_the_module_logs_what_it_logs_under_ddp(world):
    """Catches the strategy logging ``train_loss`` itself (a key the module never logged, in the
    metrics, the progress bar and the loggers) while the module's own ``self.log`` calls in its
    step never ran: under ``ddp`` the keys are ``my_loss`` and ``samples``."""
    for rank, ranks in enumerate(world):
        ddp, pp2 = ranks["ddp"]["logged"], ranks["pp2"]["logged"]
        assert sorted(pp2) == sorted(ddp) == ["my_loss", "samples"], (rank, ddp, pp2)
        assert pp2["samples"] == ddp["samples"] == 2 * RANK_BATCH, (rank, ddp, pp2)
        assert pp2["my_loss"] == pytest.approx(ddp["my_loss"], rel=1e-5), (rank, ddp, pp2)


def test_backward_hooks_run_once_a_step_as_under_ddp(world):
    """Catches ``on_before_backward`` / ``on_after_backward`` never called under a pipeline (the
    strategy's backward skipped Lightning's precision hooks): each runs once a step on every
    stage; the first sees no gradient yet and the step's loss (the mean of the ddp ranks'
    losses: the same 8 samples), the second every parameter's gradient on this stage."""
    steps = SAMPLES // (2 * RANK_BATCH)
    ddp = [ranks["ddp"]["records"] for ranks in world]
    for rank, ranks in enumerate(world):
        ours = ranks["pp2"]["records"]
        assert len(ours["before"]) == len(ours["after"]) == steps, (rank, ours)
        assert ours["after"] == ddp[rank]["after"] == [True] * steps, (rank, ours)
        for step, (loss, had_grads) in enumerate(ours["before"]):
            expected = sum(r["before"][step][0] for r in ddp) / 2
            assert not had_grads and loss == pytest.approx(expected, rel=1e-5), (rank, step)


def test_grad_norm_is_the_whole_models(world):
    """Catches a gradient norm of one stage's parameters: Lightning's ``grad_norm`` under
    ``pipeline=2`` reads this stage's only; ``lightning_3d.observe.grad_norm.grad_norm`` has
    every parameter's norm and the total of ``ddp``'s, on both stages."""
    for rank, ranks in enumerate(world):
        ddp, ours = ranks["ddp"]["records"], ranks["pp2"]["records"]
        assert len(ours["norm"]) == len(ddp["norm"]) == SAMPLES // (2 * RANK_BATCH), rank
        for step, (got, expected) in enumerate(zip(ours["norm"], ddp["norm"])):
            assert sorted(got) == sorted(expected), (rank, step)
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=1e-4), (rank, step, key)
            assert ours["stage"][step] < 0.99 * got["grad_2.0_norm_total"], (rank, step)


def test_weights_after_fit_are_ddps(world):
    """``strategy.full_state_dict()`` after a pipeline fit (every rank) holds both stages' weights,
    trained as under ``ddp``; the module's own ``state_dict()`` holds this stage's only."""
    for rank, ranks in enumerate(world):
        expected = ranks["ddp"]["weights"]
        assert ranks["pp2"]["step"] == ranks["ddp"]["step"] == SAMPLES // (2 * RANK_BATCH)
        problems = weight_mismatches(ranks["pp2"]["weights"], expected, rtol=1e-4, atol=1e-5)
        assert problems == [], (rank, problems)


def test_an_error_in_the_hook_ends_the_fit(world):
    """Catches user code that never runs: the hook's ``ValueError`` at batch 1 ends the fit on
    every rank, after one optimizer step."""
    for rank, ranks in enumerate(world):
        run = ranks["pp2_raises"]
        assert run["error"] == "raised in the hook" and run["step"] == 1, (rank, run["error"])


# ------------------------------------------------------------------------------ refused before
def _own_step(hook: str = "") -> Any:
    """A ``LitGPT`` whose ``training_step`` is its own; ``hook``: the hook in a subclass
    (``"subclass"``) or in a mixin before it (``"mixin"``), or none but ``LitGPT``'s."""
    from lightning_3d.models import LitGPT

    class OwnStep(LitGPT):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self._loss(batch)
            self.log("my_loss", loss)
            return loss

    class LogsMyLoss:
        def pipeline_training_step_end(self, loss: Any, batch: Any, batch_idx: int) -> None:
            self.log("my_loss", loss)

    class OwnStepWithHook(OwnStep):
        pipeline_training_step_end = LogsMyLoss.pipeline_training_step_end

    class OwnStepWithMixin(LogsMyLoss, OwnStep):
        pass

    classes = {"": OwnStep, "subclass": OwnStepWithHook, "mixin": OwnStepWithMixin}
    return classes[hook](**MODEL)


def test_a_training_step_the_pipeline_skips_is_refused():
    """Catches a subclass's ``training_step`` dropped without a word under a pipeline (its
    logging, metrics and loss skipped): refused by name before any process group, saying what to
    define; accepted with the hook (in a subclass, or a mixin before the step's class in the
    MRO), and at ``pipeline=1``."""
    from lightning_3d import ThreeDStrategy

    with pytest.raises(
        ValueError,
        match=r"^OwnStep.training_step does not run under pipeline=2 .* define "
        r"pipeline_training_step_end\(self, loss, batch, batch_idx\) in OwnStep",
    ):
        ThreeDStrategy(**PP2).connect(_own_step())
    ThreeDStrategy(**PP2).connect(_own_step("subclass"))
    ThreeDStrategy(**PP2).connect(_own_step("mixin"))
    ThreeDStrategy().connect(_own_step())


def test_the_projects_modules_declare_their_pipeline_step():
    """``LitGPT`` and ``HFCausalLM`` log in the hook what their ``training_step`` logs: accepted."""
    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import LitGPT
    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.strategy.pipeline_step import refuse_unrun_training_step

    ThreeDStrategy(**PP2).connect(LitGPT(**MODEL))
    # Its class is what is checked: an instance not built (building needs a transformers model).
    refuse_unrun_training_step(HFCausalLM.__new__(HFCausalLM), ThreeDStrategy(**PP2).layout)
