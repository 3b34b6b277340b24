"""Small Lightning programs ("cases") for comparing ``ThreeDStrategy`` layouts with Lightning's
``ddp``, adapted from behaviours Lightning's own test suite checks (hooks and their order,
``self.log`` reductions, torchmetrics, callbacks, loops, schedulers, accumulation, clipping,
predict, manual optimization, exceptions, samplers, resume).

A case is a function of a :class:`Run` (the layout, this rank, a shared directory) that builds a
tiny GPT (``support/compat_run.py``), runs one or a few ``Trainer`` s and returns what it
recorded: plain values, tensors and whole weights, never a module. :func:`run_cases` runs every
case one after another in one world, so one process start serves them all; a case that raises
is recorded as ``{"error": "Type: message"}`` (the documented refusals are such records).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from support.compat_run import GLOBAL_BATCH, Run, barrier, base_class, synced_metrics
from support.ddp_parity import whole_state

# Per epoch, a validation score that improves twice and then stops improving.
EARLY_STOP_SCORES = [3.0, 2.0, 2.5, 2.6, 2.7, 2.8]
TOP_K_SCORES = [5.0, 3.0, 4.0, 1.0, 2.0]  # save_top_k=2, mode="min": epochs 3 and 4


# ------------------------------------------------------------------ hooks
HOOKS = (
    "setup configure_model configure_optimizers configure_callbacks configure_gradient_clipping "
    "on_fit_start on_fit_end on_train_start on_train_end on_train_epoch_start "
    "on_train_epoch_end on_train_batch_start on_train_batch_end on_before_backward "
    "on_after_backward on_before_optimizer_step optimizer_step optimizer_zero_grad "
    "on_before_zero_grad lr_scheduler_step on_validation_start on_validation_end "
    "on_validation_epoch_start on_validation_epoch_end on_validation_batch_start "
    "on_validation_batch_end on_validation_model_eval on_validation_model_train validation_step "
    "on_test_start on_test_end on_test_epoch_start on_test_epoch_end on_test_batch_start "
    "on_test_batch_end on_test_model_eval on_test_model_train test_step on_predict_start "
    "on_predict_end on_predict_epoch_start on_predict_epoch_end on_predict_batch_start "
    "on_predict_batch_end on_predict_model_eval predict_step on_before_batch_transfer "
    "transfer_batch_to_device on_after_batch_transfer teardown"
).split()


def _recording(parent: type, calls: list[str]) -> type:
    """``parent`` with every hook of :data:`HOOKS` appending its name to ``calls`` first (the
    training step's code as ``training_step``: under a pipeline it runs after the schedule)."""
    recording = type("Recording", (parent,), {})

    def wrap(name: str, method: Callable, recorded: str) -> Callable:
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(recorded)
            return method(self, *args, **kwargs)

        hook.__name__ = name
        return hook

    for name in HOOKS:
        setattr(recording, name, wrap(name, getattr(parent, name), name))
    recording.train_extra = wrap("train_extra", parent.train_extra, "training_step")
    return recording


def hooks(run: Run) -> dict[str, list[str]]:
    """As Lightning's hook tests: the module's hooks, in order, in fit (a sanity check, two
    batches, validation), then validate, test and predict on the same ``Trainer``. (An override
    of ``backward`` is :func:`backward_override`.)"""
    calls: list[str] = []
    module = _recording(base_class(), calls)()
    trainer = run.trainer(limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=1)
    out = {}
    trainer.fit(module, run.loader(), run.loader(seed=1))
    out["fit"], calls[:] = list(calls), []
    trainer.validate(module, run.loader(seed=1), verbose=False)
    out["validate"], calls[:] = list(calls), []
    trainer.test(module, run.loader(seed=2), verbose=False)
    out["test"], calls[:] = list(calls), []
    trainer.predict(module, run.loader(seed=2))
    out["predict"] = list(calls)
    return out


# ------------------------------------------------------------------ logging and metrics
def log_reduce(run: Run) -> dict[str, float]:
    """As Lightning's logging tests: ``self.log(..., sync_dist=True)``
    with ``reduce_fx`` sum, max, min and mean, on epoch (training, validation) and on step."""

    class Logging(base_class()):
        def _log(self, split: str, batch: Any) -> None:
            ids = batch[2].float()
            epoch = dict(on_step=False, on_epoch=True, sync_dist=True)
            self.log(f"{split}_sum", ids.sum(), reduce_fx="sum", **epoch)
            self.log(f"{split}_max", ids.max(), reduce_fx="max", **epoch)
            self.log(f"{split}_min", ids.min(), reduce_fx="min", **epoch)
            self.log(f"{split}_mean", ids.mean(), reduce_fx="mean", **epoch)
            self.log(f"{split}_count", float(ids.numel()), reduce_fx="sum", **epoch)

        def train_extra(self, batch: Any, batch_idx: int) -> None:
            self._log("train", batch)
            step = dict(on_step=True, on_epoch=False, sync_dist=True)
            self.log("step_sum", batch[2].float().sum(), reduce_fx="sum", **step)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            super().validation_step(batch, batch_idx)
            self._log("val", batch)

    trainer = run.trainer()
    trainer.fit(Logging(), run.loader(), run.loader(seed=1))
    return synced_metrics(trainer.callback_metrics)


def torchmetrics_metrics(run: Run) -> dict[str, Any]:
    """As Lightning's torchmetrics tests: ``SumMetric``, ``CatMetric``, ``MeanMetric``
    and ``MulticlassAccuracy`` updated in training and validation, logged as metric objects
    (reduced by Lightning at the epoch's end) and computed by the module."""
    import torchmetrics
    from torchmetrics.classification import MulticlassAccuracy

    kinds = {
        "sum": torchmetrics.SumMetric,
        "cat": torchmetrics.CatMetric,
        "mean": torchmetrics.MeanMetric,
        "acc": lambda: MulticlassAccuracy(num_classes=2, average="micro"),
    }

    class Metrics(base_class()):
        def __init__(self) -> None:
            super().__init__()
            self.metrics = torch.nn.ModuleDict(
                {f"{s}_{k}": make() for s in ("train", "val") for k, make in kinds.items()}
            )
            self.computed: dict[str, Any] = {}

        def _update(self, split: str, batch: Any) -> None:
            ids = batch[2]
            self.metrics[f"{split}_sum"].update(torch.tensor(float(ids.numel())))
            self.metrics[f"{split}_cat"].update(ids)
            self.metrics[f"{split}_mean"].update(ids.float())
            self.metrics[f"{split}_acc"].update(ids % 2, torch.zeros_like(ids))
            for kind in ("sum", "mean", "acc"):
                name = f"{split}_{kind}"
                self.log(f"logged_{name}", self.metrics[name], on_step=False, on_epoch=True)

        def train_extra(self, batch: Any, batch_idx: int) -> None:
            self._update("train", batch)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            super().validation_step(batch, batch_idx)
            self._update("val", batch)

        def _cat(self, split: str) -> None:
            self.computed[split] = sorted(self.metrics[f"{split}_cat"].compute().tolist())
            self.metrics[f"{split}_cat"].reset()

        def on_train_epoch_end(self) -> None:
            self._cat("train")

        def on_validation_epoch_end(self) -> None:
            super().on_validation_epoch_end()
            self._cat("val")

    module = Metrics()
    trainer = run.trainer()
    trainer.fit(module, run.loader(), run.loader(seed=1))
    return {"logged": synced_metrics(trainer.callback_metrics), "cat": module.computed}


def batch_end_outputs(run: Run) -> dict[str, list]:
    """As Lightning's step-output tests: what a callback's ``on_train_batch_end``
    receives as ``outputs["loss"]`` (per rank; under ddp each rank's own half batch)."""
    import lightning as L

    class Outputs(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.batches: list[int] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))
            self.batches.append(batch_idx)

    callback = Outputs()
    run.trainer(callbacks=[callback]).fit(base_class()(), run.loader())
    return {"losses": callback.losses, "batches": callback.batches}


# ------------------------------------------------------------------ callbacks
def _scored(scores: list[float], reduce_fx: str) -> Any:
    """A module whose validation score is ``scores[epoch]``, logged with ``sync_dist``: the mean
    of ``scores[epoch] + (mean id - 3.5)`` over the data ranks (ids 0..7 in the first val batch),
    or the sum of each rank's share of ``scores[epoch]``."""

    class Scored(base_class()):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            ids = batch[2].float()
            value = scores[self.current_epoch]
            if reduce_fx == "mean":
                score = value + ids.mean() - (GLOBAL_BATCH - 1) / 2
            else:  # sum: each rank its samples' share
                score = torch.tensor(value * ids.numel() / GLOBAL_BATCH)
            self.log("score", score, reduce_fx=reduce_fx, sync_dist=True, on_epoch=True)

    return Scored()


def early_stopping(run: Run) -> dict[str, Any]:
    """As Lightning's early-stopping tests: ``EarlyStopping(patience=1)`` stops after the first
    epoch whose score does not improve, on every rank at once."""
    from lightning.pytorch.callbacks import EarlyStopping

    stopper = EarlyStopping(monitor="score", patience=1, mode="min")
    trainer = run.trainer(
        max_epochs=len(EARLY_STOP_SCORES),
        limit_train_batches=1,
        limit_val_batches=1,
        callbacks=[stopper],
    )
    trainer.fit(_scored(EARLY_STOP_SCORES, "mean"), run.loader(), run.loader(seed=1))
    return {
        "stopped_epoch": stopper.stopped_epoch,
        "best": float(stopper.best_score),
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }


def checkpoint_top_k(run: Run) -> dict[str, Any]:
    """As Lightning's checkpoint-callback tests: ``ModelCheckpoint(monitor, save_top_k=2)`` keeps
    the two best epochs, the score in each file's name."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    directory = run.path("top_k")
    checkpoint = ModelCheckpoint(
        dirpath=directory, monitor="score", save_top_k=2, mode="min", filename="{epoch}-{score:.2f}"
    )
    trainer = run.trainer(
        max_epochs=len(TOP_K_SCORES),
        limit_train_batches=1,
        limit_val_batches=1,
        enable_checkpointing=True,
        callbacks=[checkpoint],
    )
    trainer.fit(_scored(TOP_K_SCORES, "sum"), run.loader(), run.loader(seed=1))
    barrier()
    return {
        "best": os.path.basename(checkpoint.best_model_path),
        "best_score": float(checkpoint.best_model_score),
        "kept": sorted(os.path.basename(p) for p in checkpoint.best_k_models),
        "files": sorted(os.listdir(directory)),
    }


# ------------------------------------------------------------------ optimization
def _scheduled(interval: str) -> Any:
    class Scheduled(base_class()):
        def __init__(self) -> None:
            super().__init__()
            self.lrs: list[float] = []

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": interval}}

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.lrs.append(self.optimizers().param_groups[0]["lr"])

    return Scheduled()


def lr_step_interval(run: Run) -> dict[str, Any]:
    """As Lightning's scheduler tests: a ``StepLR`` stepped every optimizer step; the lr each
    batch sees and the weights it moves."""
    module = _scheduled("step")
    trainer = run.trainer(max_epochs=1)
    trainer.fit(module, run.loader(samples=32))
    return {"lrs": module.lrs, "state": whole_state(trainer, module)}


def lr_epoch_interval(run: Run) -> dict[str, Any]:
    """The same, stepped every epoch (3 epochs of one batch)."""
    module = _scheduled("epoch")
    trainer = run.trainer(max_epochs=3, limit_train_batches=1)
    trainer.fit(module, run.loader())
    return {"lrs": module.lrs, "state": whole_state(trainer, module)}


def accumulate_grad_batches(run: Run) -> dict[str, Any]:
    """As Lightning's accumulation tests: 4 batches, an optimizer step every 2."""
    steps: list[int] = []

    class Accumulating(base_class()):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            steps.append(self.trainer.global_step)

    module = Accumulating()
    trainer = run.trainer(accumulate_grad_batches=2)
    trainer.fit(module, run.loader(samples=32))
    return {
        "steps": steps,
        "global_step": trainer.global_step,
        "state": whole_state(trainer, module),
    }


def _clipped(run: Run, value: float, algorithm: str) -> dict[str, Any]:
    module = base_class()()
    trainer = run.trainer(max_steps=2, gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    trainer.fit(module, run.loader())
    return {"state": whole_state(trainer, module)}


def clip_norm(run: Run) -> dict[str, Any]:
    """As Lightning's clipping tests: ``gradient_clip_val`` by the global 2-norm."""
    return _clipped(run, 0.05, "norm")


def clip_value(run: Run) -> dict[str, Any]:
    """As Lightning's clipping tests: each gradient element clamped."""
    return _clipped(run, 0.002, "value")


def backward_override(run: Run) -> dict[str, Any]:
    """As Lightning's hook tests, ``backward`` overridden: the module's own ``backward(loss)``
    runs once a step and its gradients move the weights (refused under a pipeline, whose
    schedule runs the backward itself)."""
    calls: list[int] = []

    class OwnBackward(base_class()):
        def backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
            calls.append(self.global_step)
            (loss * 2).backward()  # twice the gradient: SGD moves twice as far

    module = OwnBackward()
    trainer = run.trainer(max_steps=2)
    trainer.fit(module, run.loader())
    return {"calls": calls, "state": whole_state(trainer, module)}


def manual_optimization(run: Run) -> dict[str, Any]:
    """As Lightning's manual-optimization tests: one optimizer, ``manual_backward`` and
    ``step`` in ``training_step`` (refused under a pipeline, docs/parallelism.md)."""

    class Manual(base_class()):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            loss = self._loss(batch[:2])
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    module = Manual()
    trainer = run.trainer(max_steps=2)
    trainer.fit(module, run.loader())
    return {"global_step": trainer.global_step, "state": whole_state(trainer, module)}


# ------------------------------------------------------------------ loops
def _looping(events: list[tuple]) -> Any:
    """A module that appends each training batch and each validation run to ``events``."""

    class Looping(base_class()):
        def train_extra(self, batch: Any, batch_idx: int) -> None:
            events.append(("train", self.current_epoch, batch_idx))

        def on_validation_start(self) -> None:
            events.append(("validate", self.current_epoch, self.global_step))

    return Looping()


def loop_epochs(run: Run) -> dict[str, Any]:
    """As Lightning's loop tests: ``max_epochs=3``,
    ``limit_train_batches=1``, validation every second epoch."""
    events: list[tuple] = []
    trainer = run.trainer(
        max_epochs=3, limit_train_batches=1, limit_val_batches=1, check_val_every_n_epoch=2
    )
    trainer.fit(_looping(events), run.loader(), run.loader(seed=1))
    return {"events": events, "epoch": trainer.current_epoch, "global_step": trainer.global_step}


def val_check_interval(run: Run) -> dict[str, Any]:
    """As Lightning's loop tests: 4 batches, validation after every 2."""
    events: list[tuple] = []
    trainer = run.trainer(val_check_interval=2, limit_val_batches=1)
    trainer.fit(_looping(events), run.loader(samples=32), run.loader(seed=1))
    return {"events": events, "global_step": trainer.global_step}


def sampler_per_rank(run: Run) -> dict[str, Any]:
    """As Lightning's sampler tests: after ``seed_everything(7)``, a shuffled
    loader's samples per rank, per epoch and batch (the sampler's seed and ``set_epoch``)."""
    import lightning as L

    L.seed_everything(7, verbose=False)
    seen: dict[str, list[int]] = {}

    class Sampling(base_class()):
        def train_extra(self, batch: Any, batch_idx: int) -> None:
            seen[f"{self.current_epoch}/{batch_idx}"] = batch[2].tolist()

    run.trainer(max_epochs=2).fit(Sampling(), run.loader(shuffle=True))
    return {"seen": seen}


# ------------------------------------------------------------------ evaluation and predict
def validate_test_after_fit(run: Run) -> dict[str, Any]:
    """As Lightning's evaluation tests: ``trainer.validate`` and
    ``trainer.test`` on the fitted module, with the fitting ``Trainer``."""
    module = base_class()()
    trainer = run.trainer(max_steps=2)
    trainer.fit(module, run.loader())
    validated = trainer.validate(module, run.loader(seed=1), verbose=False)
    tested = trainer.test(module, run.loader(seed=2), verbose=False)
    return {"validate": validated, "test": tested}


def predict_outputs(run: Run) -> dict[str, Any]:
    """As Lightning's predict tests: ``predict_step`` returning a tensor, then a dict; per sample
    id, the logits returned (ddp: each rank predicts its half of the samples)."""

    class Predicting(base_class()):
        def __init__(self, as_dict: bool) -> None:
            super().__init__()
            self.as_dict = as_dict
            self.ids: list[int] = []

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            logits = self(batch[0])  # (B, T, vocab)
            self.ids += batch[2].tolist()
            return {"logits": logits, "ids": batch[2]} if self.as_dict else logits

    out: dict[str, Any] = {}
    for as_dict in (False, True):
        module = Predicting(as_dict)
        batches = run.trainer().predict(module, run.loader(seed=2))
        rows = [b["logits"] if as_dict else b for b in batches]
        types = sorted({type(r).__name__ for r in rows})
        logits = torch.cat([torch.as_tensor(r) for r in rows]) if types == ["Tensor"] else None
        ids = torch.cat([b["ids"] for b in batches]).tolist() if as_dict else module.ids
        per_sample = {} if logits is None else dict(zip(ids, logits.detach().clone()))
        out["dict" if as_dict else "tensor"] = {"types": types, "logits": per_sample}
    return out


# ------------------------------------------------------------------ failures and resume
def exception_in_validation(run: Run) -> dict[str, Any]:
    """As Lightning's exception tests: an error raised in ``validation_step`` ends ``fit``
    with that error, after the callbacks' ``on_exception``."""
    import lightning as L

    class Raising(base_class()):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            raise RuntimeError(f"planted in validation_step at step {self.global_step}")

    class Hearing(L.Callback):
        heard: list[str] = []

        def on_exception(self, trainer, module, exception) -> None:
            self.heard.append(type(exception).__name__)

    callback = Hearing()
    trainer = run.trainer(limit_train_batches=1, limit_val_batches=1, callbacks=[callback])
    try:
        trainer.fit(Raising(), run.loader(), run.loader(seed=1))
        raised = "nothing"
    except RuntimeError as error:
        raised = f"RuntimeError: {error}"
    return {"raised": raised, "heard": callback.heard, "status": str(trainer.state.status)}


def resume(run: Run) -> dict[str, Any]:
    """As Lightning's resume tests: fit 2 steps, save, a new module (other initial
    weights) and ``Trainer`` resume to 4 steps; the step count and the weights after."""
    import lightning as L

    path = run.path("resume.ckpt")
    first = run.trainer(max_steps=2, max_epochs=-1)
    first.fit(base_class()(), run.loader())
    first.save_checkpoint(path)
    L.seed_everything(1, verbose=False)
    module = base_class()()
    resumed = run.trainer(max_steps=4, max_epochs=-1)
    resumed.fit(module, run.loader(), ckpt_path=path)
    return {"global_step": resumed.global_step, "state": whole_state(resumed, module)}


CASES: dict[str, Callable[[Run], Any]] = {
    "hooks": hooks,
    "log_reduce": log_reduce,
    "torchmetrics": torchmetrics_metrics,
    "batch_end_outputs": batch_end_outputs,
    "early_stopping": early_stopping,
    "checkpoint_top_k": checkpoint_top_k,
    "lr_step_interval": lr_step_interval,
    "lr_epoch_interval": lr_epoch_interval,
    "accumulate_grad_batches": accumulate_grad_batches,
    "clip_norm": clip_norm,
    "clip_value": clip_value,
    "backward_override": backward_override,
    "manual_optimization": manual_optimization,
    "loop_epochs": loop_epochs,
    "val_check_interval": val_check_interval,
    "sampler_per_rank": sampler_per_rank,
    "validate_test_after_fit": validate_test_after_fit,
    "predict_outputs": predict_outputs,
    "exception_in_validation": exception_in_validation,
    "resume": resume,
}


def run_cases(
    rank: int, world: int, layout: str, strategy: Any, directory: str, names: list[str]
) -> dict[str, Any]:
    """Every case of ``names`` in turn on this rank, each from ``seed_everything(0)``; what each
    recorded, or ``{"error": ...}`` for a case that raised."""
    import time

    import lightning as L

    run = Run(layout, strategy, world, rank, directory)
    os.makedirs(run.path(), exist_ok=True)
    out: dict[str, Any] = {}
    for name in names:
        L.seed_everything(0, verbose=False)
        start = time.perf_counter()
        try:
            record = CASES[name](run)
        except Exception as error:  # noqa: BLE001 -- recorded: a refusal is an expected result
            record = {"error": f"{type(error).__name__}: {error}"}
        out[name] = {"record": record, "seconds": time.perf_counter() - start}
    return out
