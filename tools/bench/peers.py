"""The engines the benchmark compares, each training the same ``LitGPT`` inside one rank process.

``fit_lightning(rank, spec)`` runs a Lightning ``Trainer`` with one of:

- ``"3d"``: :class:`lightning_3d.ThreeDStrategy` with ``spec["options"]``;
- ``"ddp"``: Lightning's ``DDPStrategy``, its gradient all-reduce routed through
  :func:`~tools.bench.comm.counting_allreduce_hook` (same mean all-reduce, but visible to
  the byte counter; Lightning registers comm hooks on CUDA only, so the subclass does it);
- ``"fsdp"``: Lightning's ``FSDPStrategy`` (FSDP1, ``FULL_SHARD``, one unit per block). Lightning
  refuses it on CPU only when the class is exactly ``FSDPStrategy``; the subclass here changes
  nothing else;
- ``"mp"``: Lightning's ``ModelParallelStrategy`` with :class:`FSDP2LitGPT`, which applies FSDP2
  ``fully_shard`` per block and on the model in ``configure_model`` (the hook that strategy
  requires), on the ``data_parallel`` mesh axis.

``fit_deepspeed(rank, spec)`` trains the same model with DeepSpeed's engine (ZeRO 1/2/3, optimizer
offload, or its pipeline engine) in a plain loop: Lightning's ``DeepSpeedStrategy`` refuses CPU.
Both return ``summary`` (``RunSummary``'s keys), ``comm`` (per-op totals per step from the first
counted step on) and ``psi_rank`` (parameter elements this rank holds before data-parallel
sharding: its pipeline stage or tensor slice).
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_3d.models import LitGPT
from lightning_3d.models.gpt import Block
from lightning_3d.observe.memory import peak_rss_mb
from tools.bench.comm import CommCounter, count_collectives, counting_allreduce_hook


class CountingDDPStrategy(DDPStrategy):
    """Lightning ``ddp`` with its all-reduce made through Python ``dist.all_reduce`` (countable)."""

    def configure_ddp(self) -> None:
        super().configure_ddp()
        self.model.register_comm_hook(None, counting_allreduce_hook)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` on CPU: a subclass passes the Trainer's GPU-only check.

    FSDP1 itself needs ``device_id=torch.device("cpu")`` on CPU, which Lightning never passes
    (it passes the device index), so the model is wrapped here with Lightning's own settings
    and handed to Lightning as already wrapped.
    """

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(
            model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        # Used above; Lightning would warn that it is ignored.
        self.kwargs.pop("auto_wrap_policy", None)
        return super()._setup_model(wrapped)


class FSDP2LitGPT(LitGPT):
    """``LitGPT`` for ``ModelParallelStrategy``: FSDP2 on the ``data_parallel`` axis, one unit per block."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if any(isinstance(p, DTensor) for p in self.parameters()):
            return  # already sharded (the hook may run again, e.g. for validate after fit)
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)  # embeddings, final norm and head: the root unit


class CommWindow(Callback):
    """Brackets the counted steps: from the start of step ``skip`` to the end of training."""

    def __init__(self, counter: CommCounter, skip: int) -> None:
        self.counter, self.skip = counter, skip
        self.before: dict | None = None
        self.first_step = 0
        self.result: dict[str, Any] = {}
        self.psi_rank = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.psi_rank = local_param_elements(pl_module)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        if self.before is None and trainer.global_step >= self.skip:
            self.before, self.first_step = self.counter.snapshot(), trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = trainer.global_step - self.first_step
        self.result = per_step(self.counter.since(self.before or {}), steps)


def per_step(delta: dict[str, tuple[int, int, float]], steps: int) -> dict[str, Any]:
    """Per-op (calls, payload, sent) totals divided by the number of counted steps."""
    steps = max(steps, 1)
    ops = {
        k: {"calls": c / steps, "payload_bytes": p / steps, "sent_bytes": s / steps}
        for k, (c, p, s) in delta.items()
    }
    return {"steps": steps, "ops": ops, "sent_bytes": sum(o["sent_bytes"] for o in ops.values())}


def local_param_elements(module: nn.Module) -> int:
    """Parameter elements on this rank before dp sharding: a tensor-parallel DTensor counts its slice."""
    total = 0
    for p in module.parameters():
        tp_only = isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("tp",)
        total += p.to_local().numel() if tp_only else p.numel()
    return total


def build_strategy(kind: str, options: dict[str, Any], world: int) -> Any:
    """The Lightning strategy object of a row."""
    if kind == "3d":
        from lightning_3d import ThreeDStrategy

        return ThreeDStrategy(**options)
    if kind == "ddp":
        return CountingDDPStrategy()
    if kind == "fsdp":
        return CPUFSDPStrategy(
            auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD", use_orig_params=True
        )
    if kind == "mp":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    raise ValueError(f"unknown Lightning row kind {kind!r}; expected one of 3d, ddp, fsdp, mp")


def fit_lightning(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["steps"]`` steps under a Lightning strategy; see the module docstring."""
    from lightning_3d.data import TextDataModule
    from lightning_3d.observe.summary import RunSummary

    L.seed_everything(spec["seed"], verbose=False)
    with count_collectives() as counter:
        cls = FSDP2LitGPT if spec["kind"] == "mp" else LitGPT
        if spec.get("arch") == "moe":  # tools/bench/moe.py's rows
            from lightning_3d.models.moe import LitMoEGPT

            cls = functools.partial(LitMoEGPT, **spec["moe"])
        module = cls(**spec["model"], warmup_steps=2, max_steps=spec["steps"])
        datamodule = TextDataModule(seed=spec["seed"], **spec["data"])
        window = CommWindow(counter, skip=spec["comm_skip"])
        summary = RunSummary(warmup_steps=spec["warmup_steps"])
        with tempfile.TemporaryDirectory() as root:
            trainer = L.Trainer(
                accelerator="cpu",
                devices=spec["world"],
                num_nodes=1,
                strategy=build_strategy(spec["kind"], spec["options"], spec["world"]),
                max_steps=spec["steps"],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
                callbacks=[window, summary],
                default_root_dir=root,
            )
            trainer.fit(module, datamodule)
    return {"summary": summary.summary, "comm": window.result, "psi_rank": window.psi_rank}


# --- DeepSpeed ---------------------------------------------------------------------------------


class _Embed(nn.Module):
    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)


class _Head(nn.Module):
    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = gpt.norm, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))  # (B, T, vocab)


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def deepspeed_config(
    options: dict[str, Any], global_batch: int, micro_batch: int, lr: float
) -> dict[str, Any]:
    """DeepSpeed's JSON config for a row: fp32, AdamW, the row's ZeRO stage and offload."""
    config: dict[str, Any] = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": options.get("zero_stage", 0)},
    }
    if options.get("offload"):
        # DeepSpeed's own CPU Adam (a compiled op) is what optimizer offload runs.
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1},
        }
    return config


def _tensor_bytes(root: Any, seen: set[int], depth: int = 0) -> int:
    """Bytes of distinct storages reachable from ``root`` through containers and DeepSpeed/optim objects.

    Attributes named like communication workspace (``*ipg*``, ``*bucket*``: DeepSpeed's reduce
    buckets, allocated at ``reduce_bucket_size`` whatever the model) are not model state and are
    skipped; parameters, their flat groups and fp32 partitions, gradients and Adam state are kept.
    """
    if isinstance(root, torch.Tensor):
        storage = root.untyped_storage()
        extra = sum(
            _tensor_bytes(t, seen, depth)
            for t in (root.grad, getattr(root, "ds_tensor", None))
            if t is not None
        )
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return extra
        seen.add(storage.data_ptr())
        return storage.nbytes() + extra
    if depth > 5:
        return 0
    if isinstance(root, dict):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in root.values())
    if isinstance(root, (list, tuple, set)):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in root)
    module_name = type(root).__module__
    if hasattr(root, "__dict__") and (
        module_name.startswith("deepspeed") or module_name.startswith("torch.optim")
    ):
        return sum(
            _tensor_bytes(v, seen, depth + 1)
            for k, v in vars(root).items()
            if "ipg" not in k.lower() and "bucket" not in k.lower()
        )
    return 0


def fit_deepspeed(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["steps"]`` steps with a DeepSpeed engine; see the module docstring."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from lightning_3d.data import TextDataModule

    L.seed_everything(spec["seed"], verbose=False)
    options, world, steps = spec["options"], spec["world"], spec["steps"]
    with count_collectives() as counter:
        deepspeed.init_distributed(dist_backend="gloo")
        lit = LitGPT(**spec["model"], warmup_steps=2, max_steps=steps)
        num_params = sum(p.numel() for p in lit.model.parameters())  # before ZeRO-3 partitions them
        stages = options.get("pipeline", 1)
        dp = world // stages
        global_batch = spec["data"]["batch_size"]
        micro = global_batch // dp // (spec["micro_batches"] if stages > 1 else 1)
        model: nn.Module = lit.model
        if stages > 1:
            gpt = lit.model
            model = PipelineModule(
                [_Embed(gpt), *gpt.blocks, _Head(gpt)],
                num_stages=stages,
                loss_fn=_lm_loss,
                partition_method="uniform",
            )
        config = deepspeed_config(options, global_batch, micro, lit.hparams.lr)
        optimizer = None
        if not options.get("offload"):
            # LitGPT's AdamW and its groups.
            groups = lit.configure_optimizers()["optimizer"].param_groups
            optimizer = torch.optim.AdamW(
                [{k: v for k, v in g.items() if k != "initial_lr"} for g in groups],
                lr=lit.hparams.lr,
                betas=(0.9, 0.95),
            )
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        data = TextDataModule(seed=spec["seed"], **{**spec["data"], "batch_size": micro * dp})
        data.setup_for(dp, engine.global_rank // stages if stages > 1 else rank)
        batches = iter(data.train_dataloader())
        times, before, memory = [], None, 0
        for step in range(steps):
            if step == spec["comm_skip"]:
                before = counter.snapshot()
            t0 = time.perf_counter()
            if stages > 1:
                engine.train_batch(batches)
            else:
                x, y = next(batches)
                loss = _lm_loss(engine(x), y)
                engine.backward(loss)
                if step == 1 or steps == 1:
                    memory = _tensor_bytes(
                        [list(engine.module.parameters()), engine.optimizer], set()
                    )
                engine.step()
            times.append(time.perf_counter() - t0)
        comm = per_step(counter.since(before or {}), steps - spec["comm_skip"])
        if stages > 1:
            memory = _tensor_bytes([list(engine.module.parameters()), engine.optimizer], set())
        psi_rank = sum(
            p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters()
        )
    steady = times[spec["warmup_steps"] :] or times
    summary = {
        "tokens_per_s": global_batch * spec["model"]["block_size"] / statistics.median(steady),
        "num_params": num_params,
        "ranks": [{"rank": rank, "peak_rss_mb": round(peak_rss_mb(), 1), "state_bytes": memory}],
    }
    return {"summary": summary, "comm": comm, "psi_rank": psi_rank}
