"""A tiny GPT and its data for comparing ``ThreeDStrategy`` layouts with Lightning's ``ddp`` on
2 ranks, as a user's code sees them: weights, gradient norms, test metrics and predictions.

Every layout reads the same global batches of :data:`GLOBAL_BATCH` samples: ``ddp`` and the
layouts with 2 data ranks read half of each (Lightning's distributed sampler: rank r the
samples r, r + 2, ...), the others (tensor, context, pipeline: one data rank) the whole batch.
The loss is a token mean over equal halves, so the same run moves the weights alike. SGD
without weight decay or warmup: a gradient reduced twice, or over half the samples, shows.
"""

from __future__ import annotations

from typing import Any

SAMPLES, GLOBAL_BATCH, SEQ, VOCAB = 16, 8, 8, 32
RANKS = 2
STEPS = 2  # optimizer steps per fit

# name -> ThreeDStrategy keywords (2 ranks), or "ddp": Lightning's own strategy
LAYOUTS: dict[str, Any] = {
    "ddp": "ddp",
    "zero1": {"zero_stage": 1},
    "zero3": {"zero_stage": 3},
    "tp2": {"tensor": 2},
    "cp2": {"context": 2},
    "pp2": {"pipeline": 2, "micro_batches": 2},
}


def data_ranks(layout: str) -> int:
    options = LAYOUTS[layout]
    if options == "ddp":
        return RANKS
    return RANKS // max(options.get(k, 1) for k in ("tensor", "context", "pipeline"))


def dataset(seed: int = 0) -> Any:
    """``(inputs, targets, sample id)`` of :data:`SAMPLES` sequences."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(SAMPLES))


def loader(layout: str, seed: int = 0) -> Any:
    from torch.utils.data import DataLoader

    return DataLoader(dataset(seed), batch_size=GLOBAL_BATCH // data_ranks(layout))


def module_class() -> type:
    """A :class:`~lightning_3d.models.LitGPT` that reads ``(inputs, targets, ids)`` batches,
    records the whole-model gradient norm before each step and predicts a dict of whole
    sequences and per-sample values."""
    import torch
    from lightning.pytorch.utilities import grad_norm

    from lightning_3d.models import LitGPT

    class Tiny(LitGPT):
        def __init__(self) -> None:
            super().__init__(
                vocab_size=VOCAB,
                block_size=SEQ,
                n_layer=2,
                n_head=2,
                n_embd=16,
                lr=0.1,
                weight_decay=0.0,
                warmup_steps=0,
                optimizer="sgd",
            )
            self.norms: list[float] = []  # the strategy's (ddp: Lightning's) whole-model norm
            self.lightning_norms: list[Any] = []  # Lightning's grad_norm total, or its error

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            try:
                total = float(grad_norm(self, 2).get("grad_2.0_norm_total", "nan"))
            except Exception as error:  # noqa: BLE001 -- recorded: which layouts it fails in
                total = f"{type(error).__name__}: {error}"[:80]
            self.lightning_norms.append(total)
            strategy = self.trainer.strategy
            whole = getattr(strategy, "gradient_norm", None)  # ddp: Lightning's grad_norm
            self.norms.append(float(whole(optimizer)) if whole is not None else total)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch[:2], batch_idx)

        def pipeline_training_step_end(self, loss: Any, batch: Any, batch_idx: int) -> None:
            self.log("train_loss", loss)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self._evaluate(batch[:2], self.val_loss, "val_loss")

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self._evaluate(batch[:2], self.test_loss, "test_loss")

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            logits = self(batch[0])  # (B, T, vocab)
            return {"logits": logits, "ids": batch[2], "pair": (logits.argmax(-1), batch[2])}

    torch.manual_seed(0)
    return Tiny


def trainer(layout: str, steps: int = STEPS, **kwargs: Any) -> Any:
    import lightning as L

    from lightning_3d import ThreeDStrategy

    options = LAYOUTS[layout]
    return L.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy=options if options == "ddp" else ThreeDStrategy(**options),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **kwargs,
    )


def whole_state(trainer: Any, module: Any) -> dict:
    """The module's whole weights as one process holds them: ddp's ``state_dict()``, the
    strategy's ``full_state_dict()`` (a collective under ZeRO-3, tensor parallelism and
    pipelines)."""
    if hasattr(trainer.strategy, "full_state_dict"):
        return trainer.strategy.full_state_dict()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def predictions(batches: list) -> dict[int, dict[str, Any]]:
    """Per sample id: its logits, argmax and the output types, from ``trainer.predict``'s
    list of dicts."""
    out: dict[int, dict[str, Any]] = {}
    for batch in batches:
        argmax, pair_ids = batch["pair"]
        types = {type(batch["logits"]).__name__, type(argmax).__name__}
        for row, sample in enumerate(batch["ids"].tolist()):
            out[sample] = {
                "logits": batch["logits"][row].detach().clone(),
                "argmax": argmax[row].clone(),
                "pair_id": int(pair_ids[row]),
                "types": sorted(types),
            }
    return out
