"""``HFCausalLM``: a LightningModule around any causal language model of Hugging Face ``transformers``.

Needs the optional extra ``lightning-3d[hf]``; the rest of the package never imports
``transformers``. Three ways to build one::

    HFCausalLM(path="/models/qwen2-0.5b")                      # local directory: config, safetensors, tokenizer
    HFCausalLM(config={"model_type": "llama", "vocab_size": 256, "hidden_size": 64, ...})  # random init
    HFCausalLM(model=AutoModelForCausalLM.from_config(cfg))   # an instance you built

Batches are ``(input_ids, targets)`` pairs (targets already shifted by one, as the project's
data modules give them; ``-100`` marks positions without a target), or dicts with ``input_ids``
and optionally ``attention_mask``, ``labels`` (Hugging Face's convention: unshifted labels,
``-100`` or a zero attention mask for padding) and ``position_ids`` (packed sequences, restarting
at 0 each: ``data=chat``'s packing; not under pipeline parallelism). Context parallelism hands
the model its dicts with ``targets`` (shifted before the sequence was cut) in place of
``labels``, and packed rows' ``document_ids`` (:mod:`lightning_3d.parallel.context.batch`).
The loss is the token mean over positions that have a target.

``ThreeDStrategy(tensor=2, pipeline=2)`` needs no user code: the tensor plan is the one the
model ships (``config.base_model_tp_plan``, translated by :mod:`lightning_3d.parallel.plans.hf`), and
:meth:`pipeline_spec` splits along its ``base_model_pp_plan`` with stages that run the model's
own forward (:mod:`lightning_3d.models.hf_pipeline`). A directory's weights are read where they
end up, each rank its own slices (:mod:`lightning_3d.models.hf_load`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from lightning_3d.data.labels import IGNORE_INDEX, shifted_targets
from lightning_3d.models.hf_moe import (
    ExpertLoads,
    bias_problems,
    global_router_loss,
    router_logits_kwargs,
    router_loss_of,
)
from lightning_3d.models.hf_pipeline_router import carry_router_loss, log_step_router_aux
from lightning_3d.models.lit_gpt import check_training_options, warmup_cosine_factor
from lightning_3d.parallel.chunked_loss import chunked_cross_entropy, head_input, head_problems
from lightning_3d.parallel.materialize import has_meta, materialize
from lightning_3d.parallel.optimizers import build_optimizer

HF_CONFIG_KEY = "hf_config"  # checkpoint entry: the model's transformers config as a dict


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "HFCausalLM needs Hugging Face transformers: pip install 'lightning-3d[hf]'"
        ) from err
    return transformers


def build_hf_model(
    path: Optional[str],
    config: Optional[Mapping[str, Any]],
    attn_implementation: Optional[str] = None,
    deferred_init: bool = True,
) -> nn.Module:
    """The ``transformers`` causal LM from a local directory (pretrained weights) or a config dict
    (random init, deterministic under ``torch.manual_seed``).

    A directory's model is built on ``meta`` with a :class:`~lightning_3d.models.hf_load.PretrainedWeights`
    record (``deferred_init=True``, the default): its weights are read where the model ends up,
    each rank its own slices (``ThreeDStrategy``), or on CPU at the first forward otherwise.
    ``attn_implementation=None`` takes the model's own default (``sdpa`` where ``transformers``
    has it for the family, ``eager`` otherwise). ``ValueError`` naming the directory or the class
    for what cannot be trained as a causal LM: no ``config.json``, unreadable or mis-shaped
    weights, an encoder (bidirectional attention), an attention implementation the family lacks."""
    transformers = _require_transformers()
    if (path is None) == (config is None):
        raise ValueError(
            f"give exactly one of path= or config= (got path={path!r}, config={config!r})"
        )
    if path is not None:
        from pathlib import Path

        directory = Path(path).expanduser()
        if not (directory / "config.json").is_file():
            raise ValueError(
                f"model path {str(path)!r} is not a model directory: it has no config.json"
            )
        hf_config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
        _refuse_encoders(hf_config, f"model directory {str(path)!r}")
        if deferred_init:
            model = _deferred(transformers, directory, hf_config, attn_implementation)
            if model is not None:
                return model
        kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        model = _attention_checked(
            attn_implementation,
            lambda: transformers.AutoModelForCausalLM.from_pretrained(
                str(directory), dtype=torch.float32, local_files_only=True, **kwargs
            ),
        )
        return _causal_checked(model)
    config = dict(config)
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise ValueError(
            f"config= needs a 'model_type' (e.g. 'llama', 'qwen2', 'gpt2'), got keys {sorted(config)}"
        )
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    _refuse_encoders(hf_config, f"config= (model_type={model_type!r})")
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    return _causal_checked(
        _attention_checked(
            attn_implementation,
            lambda: transformers.AutoModelForCausalLM.from_config(hf_config, **kwargs),
        )
    )


def _deferred(
    transformers: Any, directory: Any, hf_config: Any, attn_implementation: Optional[str]
) -> Optional[nn.Module]:
    """The directory's model on ``meta`` with its weights' record, or ``None`` where its files
    do not name the model's tensors (``transformers`` converts them on load: load it eagerly)."""
    from lightning_3d.models.hf_load import (
        PretrainedWeights,
        build_on_meta,
        names_match,
        read_headers,
    )

    headers = read_headers(directory)
    model = _causal_checked(
        _attention_checked(
            attn_implementation, lambda: build_on_meta(transformers, hf_config, attn_implementation)
        )
    )
    if not names_match(model, headers):
        return None
    model.deferred_init = PretrainedWeights(directory, model, headers)
    return model


def _refuse_encoders(hf_config: Any, where: str) -> None:
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(
            f"{where}: {type(hf_config).__name__} is an encoder-decoder model; HFCausalLM trains "
            "decoder-only causal language models"
        )


def _causal_checked(model: nn.Module) -> nn.Module:
    """``model``, or ``ValueError`` when its self-attention sees later tokens (an encoder such as
    BERT loaded as a causal LM without ``is_decoder``): trained so, it would learn to copy."""
    bidirectional = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if getattr(m, "is_causal", None) is False and "Cross" not in type(m).__name__
        }
    )
    if bidirectional:
        raise ValueError(
            f"{type(model).__name__} is an encoder: its attention ({', '.join(bidirectional)}) is not "
            "causal, so each position would see the tokens it must predict; train a decoder-only "
            "model (or one whose config.json sets is_decoder: true)"
        )
    return model


def _attention_checked(attn_implementation: Optional[str], build: Any) -> nn.Module:
    """``build()``, with transformers' refusal of an attention implementation as one line that
    names the option."""
    try:
        return build()
    except ValueError as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        if attn_implementation is None or "attention implementation" not in text:
            raise
        raise ValueError(
            f"attn_implementation={attn_implementation!r} (model.attn_implementation in the app): "
            f"{text} Leave it unset (null) for the model's default."
        ) from None


def _expert_loads(model: nn.Module) -> Optional[ExpertLoads]:
    """The expert loads of ``model``'s experts modules (its ``base_model_ep_plan``'s), or
    ``None`` for a dense model."""
    from lightning_3d.parallel.expert_hf import hf_experts_modules

    experts = hf_experts_modules(model) if hasattr(model, "base_model") else []
    return ExpertLoads(model, experts) if experts else None


class HFCausalLM(pl.LightningModule):
    """A ``transformers`` causal LM trained with token-mean cross-entropy (see the module docstring).

    Args:
        path: local model directory (``config.json``, safetensors weights, tokenizer files).
        config: a ``transformers`` config as a dict with ``model_type`` (random init).
        model: a ``transformers`` model instance (not saved in the hyper-parameters).
        lr, weight_decay, betas, warmup_steps, max_steps, min_lr_ratio, optimizer: the recipe of
            :class:`lightning_3d.models.LitGPT` (AdamW or momentum SGD, warmup + cosine).
        attn_implementation: ``None`` (default: the model's own, ``sdpa`` where the family has
            it), ``"sdpa"`` or ``"eager"``.
        adapter: ``None`` / ``"none"`` (full fine-tune), ``"lora"``, or a mapping of
            :class:`~lightning_3d.adapters.AdapterOptions` (``method``, ``r``, ``lora_alpha``,
            ``lora_dropout``, ``target_modules``): peft's LoRA on a frozen base; checkpoints
            then hold only the adapters (see ``docs/adapters.md``).
        deferred_init: with ``path=``, build on ``meta`` and read the weights where the model
            ends up (each rank its own slices under ``ThreeDStrategy``); ``False`` loads the
            whole model on construction.
        router_aux_loss_coef: weight of a mixture-of-experts family's router load-balancing
            loss in the objective, computed over the global batch (``models/hf_moe.py``);
            ``None`` (default): the config's, as ``transformers`` trains it (its
            ``router_aux_loss_coef`` where ``output_router_logits`` is on, else none); 0: none.
        router_bias_update_rate: step of the aux-loss-free balancing bias of a family whose router
            keeps one (``e_score_correction_bias``: deepseek_v3, glm4_moe, ...) after each
            optimizer step, from the global batch's expert loads (``models/hf_moe.py``); 0
            (default): the bias stays as loaded. A mixture-of-experts model logs
            ``expert_imbalance`` either way.
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
        attn_implementation: Optional[str] = None,
        deferred_init: bool = True,
        adapter: Any = None,
        router_aux_loss_coef: Optional[float] = None,
        router_bias_update_rate: float = 0.0,
    ) -> None:
        super().__init__()
        from lightning_3d.adapters import AdapterOptions, apply_adapter

        self.adapter = AdapterOptions.parse(adapter)
        check_training_options(
            lr, weight_decay, betas, warmup_steps, max_steps, min_lr_ratio, optimizer
        )
        if model is not None:
            if path is not None or config is not None:
                raise ValueError("give one of path=, config= or model=, not several")
            self.model = model
        else:
            # QLoRA quantizes the base as it is built: its values are needed now.
            self.model = build_hf_model(
                path, config, attn_implementation, deferred_init and self.adapter.method != "qlora"
            )
        apply_adapter(self.model, self.adapter)
        # The router's load-balancing loss (None: none); its logits, set by each training forward.
        self.router_loss = router_loss_of(self.model, router_aux_loss_coef)
        self.router_logits: Optional[tuple] = None
        # Under a pipeline: a micro-batch's loss weight, set by the strategy (hf_pipeline_router).
        self.aux_weight: Optional[Callable[[], torch.Tensor]] = None
        # A mixture-of-experts model's expert loads (None: no experts modules), and the bias step.
        self.expert_loads = _expert_loads(self.model)
        problems = bias_problems(
            self.expert_loads, router_bias_update_rate, type(self.model).__name__
        )
        if problems:
            raise ValueError("; ".join(problems))
        self.router_bias_update_rate = float(router_bias_update_rate)
        self.strict_loading = not self.adapter.enabled  # adapter checkpoints lack the base
        self.model.config.use_cache = False  # training: no key/value cache
        self.model.train()  # from_pretrained returns it in eval mode: dropout would be off
        # Context parallelism sets this (parallel/context/apply.py): the positions of this rank's
        # tokens, passed as position_ids (rotary and learned positions read them).
        self.context_shard: Optional[Any] = None
        # ThreeDStrategy(loss_chunks=n) sets this (parallel/chunked_loss.py): the head and the
        # loss then run n chunks of tokens at a time, no whole logits tensor.
        self.loss_chunks = 1
        self.save_hyperparameters(ignore=["model"])
        self.val_loss = torchmetrics.MeanMetric()
        self.test_loss = torchmetrics.MeanMetric()

    @property
    def keeps_in_checkpoint(self) -> Optional[Callable[[str], bool]]:
        """Which tensors a checkpoint holds (``None``: all): with an adapter, the adapters only;
        ``ThreeDStrategy`` then never gathers the frozen base to save it."""
        if not self.adapter.enabled:
            return None
        from lightning_3d.adapters import is_adapter_name

        return is_adapter_name

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The full config travels with every checkpoint: export-hf rebuilds the model from it.
        checkpoint[HF_CONFIG_KEY] = self.model.config.to_dict()
        if self.adapter.enabled:  # the base is the model's own weights: only the adapters are saved
            from lightning_3d.adapters import adapter_state
            from lightning_3d.adapters.checkpoint import ADAPTER_KEY

            checkpoint["state_dict"] = adapter_state(checkpoint["state_dict"])
            checkpoint[ADAPTER_KEY] = self.adapter.as_dict()

    def configure_model(self) -> None:
        # Weights still on meta under a strategy that does not place them itself (ThreeDStrategy
        # reads each rank's slices after sharding): here, where an eager load would have put them.
        strategy = self._trainer.strategy if self._trainer is not None else None
        if not getattr(strategy, "materializes_meta_modules", False):
            self.load_weights()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.load_weights()  # HFCausalLM.load_from_checkpoint: the tensors need storage first
        if self.adapter.enabled:
            from lightning_3d.adapters.checkpoint import check_adapter_checkpoint

            check_adapter_checkpoint(self, checkpoint)

    def load_weights(self, device: Optional[torch.device] = None) -> None:
        """Read the directory's weights into a model still on ``meta`` (a no-op otherwise)."""
        if has_meta(self.model):
            materialize(self.model, torch.device("cpu") if device is None else device)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` (vocab-sharded under tensor parallelism). ``position_ids``
        that restart at 0 within a row mark packed sequences: without an ``attention_mask``,
        ``transformers`` keeps each one's attention to itself (``lightning_3d.data.chat_layout``).
        ``document_ids``: the same under context parallelism, (B, T) of the whole sequence
        (passed on to the attention function)."""
        if getattr(self.model, "deferred_init", None) is not None and self._trainer is None:
            self.load_weights()  # used outside a Trainer: read the weights on the first call
        if position_ids is None and self.context_shard is not None:
            B, T = input_ids.shape  # this rank's tokens of each sequence
            position_ids = self.context_shard.positions(T, input_ids.device).expand(B, T)
        documents = {} if document_ids is None else {"document_ids": document_ids}
        router = router_logits_kwargs(self.model, self.router_loss, self.training)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **documents,
            **router,
        )
        self.router_logits = out.router_logits if router.get("output_router_logits") else None
        return out.logits

    @staticmethod
    def positions_of(batch: Any) -> Optional[torch.Tensor]:
        """A dict batch's ``position_ids`` (packed sequences), else ``None``."""
        return batch.get("position_ids") if isinstance(batch, Mapping) else None

    @staticmethod
    def documents_of(batch: Any) -> Optional[torch.Tensor]:
        """A dict batch's ``document_ids`` (packed sequences under context parallelism)."""
        return batch.get("document_ids") if isinstance(batch, Mapping) else None

    @staticmethod
    def split_batch(batch: Any) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """``(input_ids, attention_mask, targets)`` from a pair or a dict; targets are shifted
        (a dict's ``targets`` already are: context parallelism's)."""
        if isinstance(batch, Mapping):
            ids = batch["input_ids"]
            mask = batch.get("attention_mask")
            if batch.get("targets") is not None:
                return ids, mask, batch["targets"]
            return ids, mask, shifted_targets(batch.get("labels", ids), mask)
        ids, targets = batch[0], batch[1]
        return ids, None, targets

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss and its count of trained tokens, both on the device (an ``int`` would wait
        for the device at every step)."""
        ids, mask, targets = self.split_batch(batch)
        if self.loss_chunks > 1:  # the head's input, then head and loss by chunks
            head = self.model.get_output_embeddings()
            with head_input(head) as hidden:  # the model's own forward, logits of no token
                logits = self(ids, mask, self.positions_of(batch), self.documents_of(batch))
            # No hidden states: a pipeline's forward-only schedule answered self(...) with its
            # last stage's logits (models/hf_pipeline.py), and the head never ran here.
            loss = (
                chunked_cross_entropy(
                    hidden[0], head.weight, targets, self.loss_chunks, bias=head.bias
                )
                if hidden
                else self.loss_fn(logits, targets)
            )
        else:
            logits = self(ids, mask, self.positions_of(batch), self.documents_of(batch))
            loss = self.loss_fn(logits, targets)
        if self.training and self.expert_loads is not None:
            counts = self.expert_loads.take()  # (layers, experts), the global batch's
            if counts is not None:
                self.log("expert_imbalance", (counts.max(-1).values / counts.mean(-1)).max())
        if self.router_logits is not None:  # a training forward of a model with a router loss
            aux = global_router_loss(self.router_logits, self.router_loss, mask)
            self.router_logits = None
            self.log("router_aux_loss", aux.detach())
            if self.expert_loads is not None:
                self.expert_loads.add_aux(aux)
            loss = loss + aux
        return loss, (targets != IGNORE_INDEX).sum()

    def loss_chunk_problems(self, pipeline: int = 1) -> list[str]:
        """Why the head and loss of this model cannot run in chunks (``loss_chunks`` > 1)."""
        return head_problems(self.model, pipeline)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def pipeline_training_step_end(self, loss: torch.Tensor, batch: Any, batch_idx: int) -> None:
        """Under a pipeline, which runs the batch in place of ``training_step``: what it logs, from
        the schedule's loss, and the router loss gathered over the stages (docs/parallelism.md)."""
        self.log("train_loss", loss, prog_bar=True)
        if self.router_loss is not None:
            log_step_router_aux(self, loss.device)

    def _evaluate(self, batch: Any, metric: torchmetrics.MeanMetric, name: str) -> None:
        loss, tokens = self._loss(batch)
        # Weighed by trained tokens: a batch with none (its mean NaN, or a context group's
        # mean on a chunk of its own) adds nothing to the sum over batches and ranks.
        metric.update(torch.nan_to_num(loss, nan=0.0), weight=tokens)
        self.log(name, metric, on_step=False, on_epoch=True, prog_bar=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, "val_loss")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, "test_loss")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The most likely next token at every position, ``(B, T)``; ``IGNORE_INDEX`` where the
        attention mask is 0. A padded position predicts nothing, and what its logits say depends
        on the layout: a pipeline's stages see the causal mask only (``hf_pipeline``)."""
        ids, mask, _ = (
            self.split_batch(batch) if not isinstance(batch, torch.Tensor) else (batch, None, None)
        )
        logits = self(ids, mask, self.positions_of(batch), self.documents_of(batch))
        if hasattr(logits, "full_tensor"):  # vocab-parallel logits under tensor parallelism
            logits = logits.full_tensor()
        predicted = logits.argmax(-1)
        return predicted if mask is None else predicted.masked_fill(mask == 0, IGNORE_INDEX)

    def pipeline_spec(self) -> Any:
        """How ``ThreeDStrategy(pipeline=...)`` splits this model (see ``hf_pipeline``)."""
        if self.router_bias_update_rate > 0:
            raise ValueError(
                f"router_bias_update_rate={self.router_bias_update_rate} with a pipeline: the "
                "expert loads of other stages are not gathered; set it to 0"
            )
        from lightning_3d.models.hf_pipeline import hf_pipeline_spec

        spec = hf_pipeline_spec(self, lambda model: HFCausalLM(model=model))
        # The router loss pools every layer's sums: they travel with the activations.
        return spec if self.router_loss is None else carry_router_loss(self, spec, self.router_loss)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step, then the balancing bias moved by the step's global loads."""
        super().optimizer_step(*args, **kwargs)
        if self.expert_loads is not None:
            rate = self.router_bias_update_rate
            # A skipped step (non-finite, a grad-scaler overflow) applied nothing: no bias move.
            skipped = rate > 0 and getattr(self.trainer.strategy, "step_skipped", False)
            self.expert_loads.finish_step(0.0 if skipped else rate)

    def step_figures(self) -> dict[str, torch.Tensor]:
        """A mixture-of-experts model's last optimizer step, global: ``tokens_per_expert`` (layers,
        experts), ``expert_imbalance`` (layers,) (not under a pipeline), ``router_aux_loss`` (mean
        over micro-batches); empty for a dense model (``summary.json``)."""
        return {} if self.expert_loads is None else dict(self.expert_loads.finished)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]  # a tied weight once
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
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
