"""``self.log(..., sync_dist=True)`` and the module's torchmetrics count each sample once, as
under Lightning's ``ddp``, in every layout.

Tensor and context ranks hold copies of the same samples, and under a pipeline every stage runs
the module's validation step on the same outputs; only the data-parallel ranks hold different
samples. A reduction over the whole world counts each sample once per copy: a logged
``reduce_fx="sum"``, a ``SumMetric`` of samples seen and a ``CatMetric`` of sample ids doubled
under ``tensor=2``, ``context=2`` and in pipeline validation (means hid it). One world runs every
layout's ``Trainer`` one after another (:func:`_fit_layouts`); each test reads its layout's part.

Under a pipeline the module's ``training_step`` is not called (the schedule runs the batch): the
module counts its training samples in ``pipeline_training_step_end``, which the strategy calls
with the batch after the schedule, and every layout checks training and validation alike.

Each run also checks what the fix must not take along: a per-token metric given the data ×
context ranks by the user in ``setup()`` keeps them (under ``context=2`` the data ranks alone
would see half of each sequence's tokens), and ``reduce_boolean_decision`` (checkpoint paths,
early stopping) still agrees over every rank, not over the data ranks that ``reduce`` now uses.
"""

from __future__ import annotations

from typing import Any

import pytest

from tools.harness.world import run_world

TRAIN_SAMPLES, VAL_SAMPLES, BATCH, SEQ, VOCAB = 16, 8, 4, 8, 32
DRAWN = 4  # tokens drawn from [0, DRAWN): "next token = this token" holds often enough to count

# name -> ThreeDStrategy keywords (2 ranks): the ddp-like baseline, then one copy axis each.
LAYOUTS = {
    "dp2": {"zero_stage": 0},
    "tp2": {"tensor": 2},
    "cp2": {"context": 2},
    "pp2": {"pipeline": 2, "micro_batches": 2},
}
SLOW_LAYOUTS = {  # 4 ranks: the data axis and a copy axis together, under ZeRO-2 and ZeRO-3
    "dp2_tp2_zero3": {"tensor": 2, "zero_stage": 3},
    "dp2_cp2_zero2": {"context": 2, "zero_stage": 2},
    "dp2_pp2": {"pipeline": 2, "micro_batches": 2},
}


def _module_class() -> type:
    import torch
    import torchmetrics
    from torch.utils.data import DataLoader, TensorDataset
    from torchmetrics.classification import MulticlassAccuracy

    from lightning_3d.models import LitGPT

    def dataset(n: int, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, DRAWN, (n, SEQ + 1), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(n))

    class Counting(LitGPT):
        """Counts the samples it sees: a logged sum, a ``SumMetric``, a ``CatMetric`` of ids, a
        ``MeanMetric`` of ids and a sample-level ``MulticlassAccuracy`` (even ids right)."""

        def __init__(self) -> None:
            super().__init__(
                vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, warmup_steps=1
            )
            self.metrics = torch.nn.ModuleDict(
                {
                    f"{split}_{kind}": make()
                    for split in ("train", "val")
                    for kind, make in (
                        ("sum", torchmetrics.SumMetric),
                        ("cat", torchmetrics.CatMetric),
                        ("mean", torchmetrics.MeanMetric),
                        ("acc", lambda: MulticlassAccuracy(num_classes=2, average="micro")),
                    )
                }
            )
            # Per token, set by the user to the data x context ranks (their own group is kept):
            # under context parallelism each rank holds part of every sequence's tokens.
            self.token_acc = MulticlassAccuracy(num_classes=VOCAB, average="micro")
            self.results: dict[str, Any] = {}

        def setup(self, stage: str) -> None:
            from lightning_3d.layout import shard_mesh

            mesh = self.trainer.strategy.device_mesh
            self.token_acc.process_group = shard_mesh(mesh).get_group()

        def _count(self, split: str, batch: Any) -> None:
            ids = batch[2]
            epoch = dict(on_step=False, on_epoch=True, sync_dist=True)  # over the whole epoch
            self.log(f"seen_{split}", float(ids.numel()), reduce_fx="sum", **epoch)
            self.log(f"max_id_{split}", ids.max().float(), reduce_fx="max", **epoch)
            self.log(f"min_id_{split}", ids.min().float(), reduce_fx="min", **epoch)
            self.metrics[f"{split}_sum"].update(torch.tensor(float(ids.numel())))
            self.metrics[f"{split}_cat"].update(ids)
            self.metrics[f"{split}_mean"].update(ids.float())
            self.metrics[f"{split}_acc"].update(ids % 2, torch.zeros_like(ids))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self._count("train", batch)
            return super().training_step(batch[:2], batch_idx)

        def pipeline_training_step_end(self, loss: Any, batch: Any, batch_idx: int) -> None:
            self._count("train", batch)  # under a pipeline, in place of training_step
            super().pipeline_training_step_end(loss, batch[:2], batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self(batch[0])  # under a pipeline: the forward-only schedule's answer
            self._count("val", batch)
            self.token_acc.update(batch[0].flatten(), batch[1].flatten())  # this rank's tokens

        def _compute(self, split: str) -> None:
            for kind in ("sum", "cat", "mean", "acc"):
                metric = self.metrics[f"{split}_{kind}"]
                value = metric.compute()
                self.results[f"{split}_{kind}"] = (
                    sorted(value.tolist()) if kind == "cat" else float(value)
                )
                metric.reset()

        def on_train_epoch_end(self) -> None:
            self._compute("train")

        def on_validation_epoch_end(self) -> None:
            self._compute("val")
            self.results["val_token_acc"] = float(self.token_acc.compute())
            self.token_acc.reset()

        def train_dataloader(self) -> DataLoader:
            return DataLoader(dataset(TRAIN_SAMPLES, 0), batch_size=BATCH)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(dataset(VAL_SAMPLES, 1), batch_size=BATCH)

    return Counting


def _fit_layouts(
    rank: int, world: int, layouts: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Fit the counting module one epoch under each layout in turn, on this rank; its
    ``callback_metrics`` and metric results per layout."""
    import lightning as L

    from lightning_3d import ThreeDStrategy

    out = {}
    for name, options in layouts.items():
        L.seed_everything(0, verbose=False)
        module = _module_class()()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=ThreeDStrategy(**options),
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(module)
        logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
        # A rank's own decision (checkpoint path, stop) is still agreed over every rank.
        strategy = trainer.strategy
        agreed = [
            strategy.reduce_boolean_decision(True),
            strategy.reduce_boolean_decision(rank == 0),
            strategy.reduce_boolean_decision(rank == 0, all=False),
        ]
        out[name] = {"logged": logged, "agreed": agreed, **module.results}
    return out


def _check(results: list[dict[str, Any]], name: str) -> None:
    """Every count of ``name``'s run is the number of samples in the epoch's global batches, on
    every rank; a failure lists each count that is not."""
    ours = [  # the module's own train_loss is logged without sync_dist: each rank's own
        {**r[name], "logged": {k: v for k, v in r[name]["logged"].items() if k != "train_loss"}}
        for r in results
    ]
    first, wrong = ours[0], []
    wrong += [f"rank {rank} differs from rank 0" for rank, r in enumerate(ours) if r != first]
    if first["agreed"] != [True, False, True]:
        wrong.append(f"reduce_boolean_decision (all, rank 0 only, any): {first['agreed']}")
    for split, n in [("val", VAL_SAMPLES), ("train", TRAIN_SAMPLES)]:
        expected = {
            f"logged seen_{split} (sum)": n,
            f"logged max_id_{split}": n - 1,
            f"logged min_id_{split}": 0,
            f"{split} SumMetric": n,
            f"{split} CatMetric": list(range(n)),
            f"{split} MeanMetric": (n - 1) / 2,
            f"{split} MulticlassAccuracy": 0.5,
        }
        got = dict(
            zip(
                expected,
                [first["logged"].get(f"{k}_{split}") for k in ("seen", "max_id", "min_id")]
                + [first.get(f"{split}_{k}") for k in ("sum", "cat", "mean", "acc")],
            )
        )
        wrong += [f"{k}: {got[k]} != {v}" for k, v in expected.items() if got[k] != v]
    x, y, _ = _module_class().val_dataloader(None).dataset.tensors
    repeats = float((x == y).float().mean())  # "next token = this token" over every val token
    if first.get("val_token_acc") != repeats:
        wrong.append(f"token MulticlassAccuracy: {first.get('val_token_acc')} != {repeats}")
    assert not wrong, f"{name}: " + "; ".join(wrong)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_world(_fit_layouts, 2, 2, LAYOUTS, timeout=300)


@pytest.mark.parametrize("name", ["dp2", "tp2", "cp2"])
def test_sums_count_each_sample_once(two_ranks, name):
    """Catches sums counted once per tensor / context copy: a logged ``reduce_fx="sum"``, a
    ``SumMetric`` and a ``CatMetric`` reduced over the whole world, not the data ranks, gave
    twice the samples (and every id twice) under ``tensor=2`` and ``context=2``; ``dp2`` is the
    ddp-like baseline, right before and after. Also: a user's ``process_group`` kept, and
    boolean decisions agreed over every rank (a ``reduce`` over the data ranks alone made
    ``reduce_boolean_decision(True)`` False under ``tensor=2``)."""
    _check(two_ranks, name)


def test_pipeline_counts_each_sample_once(two_ranks):
    """Catches pipeline validation metrics counted once per stage: every stage runs the
    module's ``validation_step`` on the same outputs, and the world-wide reduction doubled a
    logged sum, a ``SumMetric`` and a ``CatMetric``. Also catches training metrics that never
    update under a pipeline (the schedule runs the batch in place of ``training_step``): the
    module's ``pipeline_training_step_end`` counts them, on every stage, once per sample."""
    _check(two_ranks, "pp2")


@pytest.mark.slow
def test_sums_count_each_sample_once_on_four_ranks():
    """The same on 4 ranks, data 2 × a copy axis 2 (tensor under ZeRO-3, context under ZeRO-2,
    pipeline): the sum runs over the 2 data ranks, which hold different samples, and no copy."""
    results = run_world(_fit_layouts, 4, 4, SLOW_LAYOUTS, timeout=600)
    wrong = []
    for name in SLOW_LAYOUTS:
        try:
            _check(results, name)
        except AssertionError as error:
            wrong.append(str(error).splitlines()[0])
    assert not wrong, "\n".join(wrong)
