"""LightningModule wrapping :class:`GPT` for next-byte prediction."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics

from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.parallel.materialize import has_meta, materialize
from lightning_3d.parallel.optimizers import build_optimizer, optimizer_problems
from lightning_3d.parallel.pipeline import PipelineSpec


def warmup_cosine_factor(
    step: int, warmup_steps: int, max_steps: float | None, min_lr_ratio: float
) -> float:
    """LR multiplier: linear warmup, then cosine decay to ``min_lr_ratio``.

    ``max_steps=None`` (or inf) means "no known horizon": stay at the peak
    after warmup instead of guessing a decay length.
    """
    if warmup_steps > 0 and step < warmup_steps:
        # step + 1 so that the very first optimizer step already moves.
        return (step + 1) / warmup_steps
    if max_steps is None or math.isinf(max_steps):
        return 1.0
    progress = (step - warmup_steps) / max(1.0, max_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cosine


def _number(value: Any, whole: bool = False) -> bool:
    kinds = (int,) if whole else (int, float)
    return isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)


def check_training_options(
    lr: Any,
    weight_decay: Any,
    betas: Any,
    warmup_steps: Any,
    max_steps: Any,
    min_lr_ratio: Any,
    optimizer: Any,
) -> None:
    """``ValueError`` naming every optimizer and schedule argument a run could not use (both
    model classes call it in their constructors, so the launcher's build on ``meta`` refuses
    them before any rank starts): a positive learning rate, a weight decay >= 0, two betas in
    [0, 1), whole step counts (``max_steps`` >= 1, or -1 / ``None``: the Trainer's estimate, as
    ``trainer.max_steps=-1`` means), a ratio in [0, 1]."""
    problems = []
    if not (_number(lr) and lr > 0):
        problems.append(f"lr={lr!r} must be a number > 0")
    if not (_number(weight_decay) and weight_decay >= 0):
        problems.append(f"weight_decay={weight_decay!r} must be a number >= 0")
    if not (
        isinstance(betas, Sequence)
        and not isinstance(betas, str)
        and len(betas) == 2
        and all(_number(b) and 0 <= b < 1 for b in betas)
    ):
        problems.append(f"betas={betas!r} must be two numbers in [0, 1)")
    if not (_number(warmup_steps, whole=True) and warmup_steps >= 0):
        problems.append(f"warmup_steps={warmup_steps!r} must be a whole number >= 0")
    if max_steps is not None and not (
        _number(max_steps, whole=True) and (max_steps >= 1 or max_steps == -1)
    ):
        problems.append(
            f"max_steps={max_steps!r} must be a whole number >= 1, or -1 / null (the Trainer's)"
        )
    if not (_number(min_lr_ratio) and 0 <= min_lr_ratio <= 1):
        problems.append(f"min_lr_ratio={min_lr_ratio!r} must be a number in [0, 1]")
    problems += optimizer_problems(optimizer)
    if problems:
        raise ValueError("; ".join(problems))


class LitGPT(pl.LightningModule):
    """GPT language model trained with token-mean cross-entropy.

    All constructor arguments are plain keywords so Hydra can build it with
    ``_target_: lightning_3d.models.LitGPT``.

    ``deferred_init=True`` builds the network on ``meta`` (no memory, no random fill) and
    records its init; ``ThreeDStrategy`` then materialises every parameter once, straight in its
    final dtype, device and shard (bf16 on the device, ZeRO-3 shards, CPU-offloaded shards),
    with the same weights as the eager build at the same seed, bit for bit. Under another
    strategy :meth:`configure_model` materialises it as the eager build would (fp32, CPU). For
    models of billions of parameters: no full fp32 copy on the host, no copy per setup step.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        bias: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 10,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        optimizer: str = "adamw",
        deferred_init: bool = False,
        attn_dropout: float | None = None,
    ) -> None:
        if not isinstance(deferred_init, bool):
            raise ValueError(f"deferred_init={deferred_init!r} must be True or False")
        check_training_options(
            lr, weight_decay, betas, warmup_steps, max_steps, min_lr_ratio, optimizer
        )
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            mlp_ratio=mlp_ratio,
            dropout=dropout,
            bias=bias,
            attn_dropout=attn_dropout,
        )
        self.model = self.build_model()
        # A metric object (not a plain tensor) so that torchmetrics does the
        # cross-process reduction with the right token weighting.
        self.val_loss = torchmetrics.MeanMetric()
        self.test_loss = torchmetrics.MeanMetric()

    def build_model(self) -> torch.nn.Module:
        """The network trained; subclasses swap in other architectures with the same interface."""
        return GPT(self.config, defer_init=self.hparams.get("deferred_init", False))

    def configure_model(self) -> None:
        # A deferred model under a strategy that does not materialise meta modules itself
        # (ThreeDStrategy does, after sharding): here, in the eager build's place (fp32, CPU).
        strategy = self._trainer.strategy if self._trainer is not None else None
        if has_meta(self.model) and not getattr(strategy, "materializes_meta_modules", False):
            materialize(self.model, torch.device("cpu"))

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # LitGPT.load_from_checkpoint of a deferred run builds on meta, then loads the weights into
        # this module: they need storage first. (In a Trainer the strategy has materialised it.)
        if has_meta(self.model):
            materialize(self.model, torch.device("cpu"))

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)``; with ``targets``, the model's mean loss (chunked with
        ``loss_chunks`` > 1)."""
        # Models that take no targets (the test kit's tiny ones) are called with ids only.
        return self.model(idx) if targets is None else self.model(idx, targets)

    def pipeline_spec(self) -> PipelineSpec:
        """How ``ThreeDStrategy(pipeline=...)`` splits this module into stages (with
        ``loss_chunks`` > 1 the last stage ends at the norm and its loss is the chunked head)."""
        if self.model.loss_chunks > 1:
            return PipelineSpec(
                blocks="model.blocks",
                first=("model.tok_emb", "model.pos_emb", "model.drop"),
                last=("model.norm", "model.lm_head"),
                embed=self.model.embed,
                head=self._norm_or_head,
                loss=self.model.head_loss,
            )
        return PipelineSpec(
            blocks="model.blocks",
            first=("model.tok_emb", "model.pos_emb", "model.drop"),
            last=("model.norm", "model.lm_head"),
            embed=self.model.embed,
            head=self.model.head,
            loss=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        )

    def _norm_or_head(self, x: torch.Tensor) -> torch.Tensor:
        """The chunked pipeline's last stage: the normed stream for the loss in training; the
        logits without autograd (validation, test, predict read them from ``self(...)``)."""
        return self.model.norm(x) if torch.is_grad_enabled() else self.model.head(x)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if getattr(self.model, "loss_chunks", 1) > 1:  # no whole logits (parallel/chunked_loss.py)
            out = self(x, y)
            if out.dim() == 0:
                return out
            # Logits: a pipeline's forward-only schedule answered self(...) with its last stage's.
            return F.cross_entropy(out.flatten(0, 1), y.flatten())
        logits = self(x)  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def pipeline_training_step_end(self, loss: torch.Tensor, batch: Any, batch_idx: int) -> None:
        """Under a pipeline, which runs the batch in place of ``training_step``: what
        ``training_step`` logs, from the schedule's loss (docs/parallelism.md)."""
        self.log("train_loss", loss, prog_bar=True)

    def _evaluate(
        self, batch: tuple[torch.Tensor, torch.Tensor], metric: torchmetrics.MeanMetric, name: str
    ) -> None:
        loss = self._loss(batch)
        # Weight by tokens so the epoch value is the true per-token mean even
        # if batches were ever of different sizes.
        metric.update(loss, weight=batch[1].numel())
        self.log(name, metric, on_step=False, on_epoch=True, prog_bar=True)

    def _log_perplexity(self, metric: torchmetrics.MeanMetric, name: str) -> None:
        if metric.update_count == 0:
            return
        # compute() syncs across processes and caches the result, so the
        # logger connector's own compute of the loss later sees the same value.
        self.log(name, torch.exp(metric.compute()))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, "val_loss")

    def on_validation_epoch_end(self) -> None:
        self._log_perplexity(self.val_loss, "val_ppl")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, "test_loss")

    def on_test_epoch_end(self) -> None:
        self._log_perplexity(self.test_loss, "test_ppl")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The most likely next byte at every position, ``(B, T)``."""
        logits = self(batch[0] if isinstance(batch, (tuple, list)) else batch)
        if hasattr(logits, "full_tensor"):  # vocab-parallel logits under tensor parallelism
            logits = logits.full_tensor()
        return logits.argmax(-1)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        # Matrices and embeddings decay; norms and biases do not, since
        # shrinking them toward zero only fights the normalisation.
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        opt = build_optimizer(hp.optimizer, groups, hp.lr, tuple(hp.betas))

        max_steps = hp.max_steps
        if max_steps is None or max_steps == -1:  # -1: trainer.max_steps=-1, the epochs decide
            max_steps = self.trainer.estimated_stepping_batches
        warmup, min_ratio = hp.warmup_steps, hp.min_lr_ratio
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: warmup_cosine_factor(step, warmup, max_steps, min_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
