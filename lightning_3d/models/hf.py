"""``HFCausalLM``: a LightningModule around any causal language model of Hugging Face ``transformers``.

Needs the optional extra ``lightning-3d[hf]``; the rest of the package never imports
``transformers``. Three ways to build one::

    HFCausalLM(path="/models/qwen2-0.5b")                      # local directory: config, safetensors, tokenizer
    HFCausalLM(config={"model_type": "llama", "vocab_size": 256, "hidden_size": 64, ...})  # random init
    HFCausalLM(model=AutoModelForCausalLM.from_config(cfg))   # an instance you built

Batches are ``(input_ids, targets)`` pairs (targets already shifted by one, as the project's
data modules give them; ``-100`` marks positions without a target), or dicts with ``input_ids``
and optionally ``attention_mask`` and ``labels`` (Hugging Face's convention: unshifted labels,
``-100`` or a zero attention mask for padding). The loss is the token mean over positions that
have a target.

It supplies its own :meth:`pipeline_spec` for the decoder families in
:mod:`lightning_3d.models.hf_pipeline`, and the strategy's built-in tensor-parallel plans
recognise their module names, so ``ThreeDStrategy(tensor=2, pipeline=2)`` needs no user code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from lightning_3d.models.lit_gpt import warmup_cosine_factor

IGNORE_INDEX = -100  # Hugging Face's (and F.cross_entropy's) "no target here"
HF_CONFIG_KEY = "hf_config"  # checkpoint entry: the model's transformers config as a dict


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "HFCausalLM needs Hugging Face transformers: pip install 'lightning-3d[hf]'"
        ) from err
    return transformers


def build_hf_model(path: Optional[str], config: Optional[Mapping[str, Any]],
                   attn_implementation: str = "sdpa") -> nn.Module:
    """The ``transformers`` causal LM from a local directory (pretrained weights) or a config dict
    (random init, deterministic under ``torch.manual_seed``). Raises ``ValueError`` for a
    directory without ``config.json``."""
    transformers = _require_transformers()
    if (path is None) == (config is None):
        raise ValueError(f"give exactly one of path= or config= (got path={path!r}, config={config!r})")
    if path is not None:
        from pathlib import Path

        directory = Path(path)
        if not (directory / "config.json").is_file():
            raise ValueError(f"model path {str(path)!r} is not a model directory: it has no config.json")
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), attn_implementation=attn_implementation, dtype=torch.float32
        )
    config = dict(config)
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"config= needs a 'model_type' (e.g. 'llama', 'qwen2', 'gpt2'), got keys {sorted(config)}")
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    return transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation)


class HFCausalLM(pl.LightningModule):
    """A ``transformers`` causal LM trained with token-mean cross-entropy (see the module docstring).

    Args:
        path: local model directory (``config.json``, safetensors weights, tokenizer files).
        config: a ``transformers`` config as a dict with ``model_type`` (random init).
        model: a ``transformers`` model instance (not saved in the hyper-parameters).
        lr, weight_decay, betas, warmup_steps, max_steps, min_lr_ratio, optimizer: the recipe of
            :class:`lightning_3d.models.LitGPT` (AdamW or momentum SGD, warmup + cosine).
        attn_implementation: ``"sdpa"`` (default) or ``"eager"``.
    """

    def __init__(
        self,
        path: Optional[str] = None,
        config: Optional[Mapping[str, Any]] = None,
        model: Optional[nn.Module] = None,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 0,
        max_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
        optimizer: str = "adamw",
        attn_implementation: str = "sdpa",
    ) -> None:
        super().__init__()
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
        if model is not None:
            if path is not None or config is not None:
                raise ValueError("give one of path=, config= or model=, not several")
            self.model = model
        else:
            self.model = build_hf_model(path, config, attn_implementation)
        self.model.config.use_cache = False  # training: no key/value cache
        self.save_hyperparameters(ignore=["model"])
        self.val_loss = torchmetrics.MeanMetric()
        self.test_loss = torchmetrics.MeanMetric()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The full config travels with every checkpoint: export-hf rebuilds the model from it.
        checkpoint[HF_CONFIG_KEY] = self.model.config.to_dict()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` (vocab-sharded under tensor parallelism)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    @staticmethod
    def split_batch(batch: Any) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """``(input_ids, attention_mask, targets)`` from a pair or a dict; targets are shifted."""
        if isinstance(batch, Mapping):
            ids = batch["input_ids"]
            mask = batch.get("attention_mask")
            labels = batch.get("labels", ids)
            if mask is not None:
                labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
            pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
            return ids, mask, torch.cat([labels[:, 1:], pad], dim=1)  # position t predicts t + 1
        ids, targets = batch[0], batch[1]
        return ids, None, targets

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    def _loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        ids, mask, targets = self.split_batch(batch)
        return self.loss_fn(self(ids, mask), targets), int((targets != IGNORE_INDEX).sum())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _evaluate(self, batch: Any, metric: torchmetrics.MeanMetric, name: str) -> None:
        loss, tokens = self._loss(batch)
        metric.update(loss, weight=max(tokens, 1))
        self.log(name, metric, on_step=False, on_epoch=True, prog_bar=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, "val_loss")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, "test_loss")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The most likely next token at every position, ``(B, T)``."""
        ids, mask, _ = self.split_batch(batch) if not isinstance(batch, torch.Tensor) else (batch, None, None)
        logits = self(ids, mask)
        if hasattr(logits, "full_tensor"):  # vocab-parallel logits under tensor parallelism
            logits = logits.full_tensor()
        return logits.argmax(-1)

    def pipeline_spec(self) -> Any:
        """How ``ThreeDStrategy(pipeline=...)`` splits this model (see ``hf_pipeline``)."""
        from lightning_3d.models.hf_pipeline import hf_pipeline_spec

        return hf_pipeline_spec(self)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]  # a tied weight once
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        if hp.optimizer == "adamw":
            opt = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas))
        else:
            opt = torch.optim.SGD(groups, lr=hp.lr, momentum=0.9)
        max_steps = hp.max_steps if hp.max_steps is not None else self.trainer.estimated_stepping_batches
        warmup, min_ratio = hp.warmup_steps, hp.min_lr_ratio
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: warmup_cosine_factor(step, warmup, max_steps, min_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
