"""``RunSummary``: per-step global loss, throughput and per-rank memory, written to summary.json.
``RNGStateCheckpoint``: every rank's random-number generator states, saved in checkpoints and
restored on resume."""

from __future__ import annotations

import functools
import json
import random
import statistics
import time
import warnings
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_3d.observe.flops import Peak, check_peak_tflops, device_peak, model_flops_per_token
from lightning_3d.observe.memory import model_state_bytes, peak_rss_mb
from lightning_3d.parallel.activation_checkpoint import is_checkpointed, transformer_blocks
from lightning_3d.parallel.activations import ActivationMeter

UNREAD_STEPS = 100  # losses are read to the host every this many steps (and at the end)


def _dp_size(trainer: pl.Trainer) -> int:
    return getattr(trainer.strategy, "dp_size", trainer.world_size)


def _token_ids(batch: Any) -> Optional[torch.Tensor]:
    """The batch's input ids ``(B, T)``: its first tensor, or a dict's ``input_ids``."""
    if isinstance(batch, Mapping):
        first = batch.get("input_ids")
    else:
        first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    return first if isinstance(first, torch.Tensor) else None


def describe_layout(trainer: pl.Trainer) -> dict[str, Any]:
    """The run's parallel layout, for any strategy (a plain single-process run included)."""
    layout = getattr(trainer.strategy, "layout", None)
    sizes = (
        layout.as_dict()
        if layout is not None
        else {"data": trainer.world_size, "tensor": 1, "pipeline": 1}
    )
    sizes.setdefault("zero_stage", 0)
    return {
        "world_size": trainer.world_size,
        **sizes,
        "strategy": type(trainer.strategy).__name__,
        "precision": str(trainer.precision),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
    }


def _count_parameters(trainer: pl.Trainer, module: pl.LightningModule) -> int:
    parallelized = getattr(trainer.strategy, "parallelized", None)  # ThreeDStrategy: stages add up
    return (
        parallelized.count_parameters()
        if parallelized is not None
        else sum(p.numel() for p in module.parameters())
    )


class RunSummary(Callback):
    """Record what a run did, the same way in every layout, and write ``summary.json``.

    - ``losses``: the global mean training loss of every optimizer step: under
      ``ThreeDStrategy``, the token mean of the step's cross-entropy over the whole global batch
      (:mod:`lightning_3d.parallel.objective`, the same on every rank); otherwise the mean over
      the accumulated micro-batches of the step, then over data-parallel ranks;
    - ``local_losses``: this rank's own loss of every optimizer step, before any reduction over
      ranks (what tests check rank by rank: tensor-parallel peers must each compute the full
      loss; under ``ThreeDStrategy`` it is the global token mean on every rank);
    - ``tokens_per_s``: median over steps after ``warmup_steps`` of global tokens / step time;
    - ``flops_per_token`` (training FLOPs per token, mean over the trained tokens) and
      ``flops_formula`` (how it was counted, see :mod:`lightning_3d.observe.flops`); ``tflops``: the
      model FLOP/s achieved per device (median over steps after warm-up of the step's model
      FLOPs / step time / world size, in TFLOP/s); ``peak_tflops``: the device's peak dense
      TFLOP/s at the run's precision (``peak_tflops=`` if given, else the table in
      :data:`lightning_3d.observe.flops.PEAK_TFLOPS`), ``peak_source`` where it came from;
      ``mfu = tflops / peak_tflops``. Where no peak is known (every CPU, a device not in the
      table), ``peak_tflops`` and ``mfu`` are ``null`` and ``peak_source`` says why;
    - ``ranks``: per rank, peak RSS and the model-state bytes resident at the end of backward,
      just before the optimizer step (see :func:`lightning_3d.observe.memory.model_state_bytes`), and
      the activation memory per transformer block of the first training batch, on the device
      and offloaded to the host (``activation_bytes_per_block``,
      ``activation_host_bytes_per_block``, see :meth:`activation_figures`);
    - ``step_figures`` (only for a module with a ``step_figures()`` method, e.g.
      :class:`~lightning_3d.models.moe.LitMoEGPT`): each of its figures, per optimizer step;
      with an ``aux_loss`` among them, ``losses_include_aux_loss`` says whether ``losses`` hold
      that term (the returned loss does; ``ThreeDStrategy``'s cross-entropy token mean does not);
    - ``planned`` (only under ``auto=True`` / ``parallelism=auto``): the planner's predictions for
      the layout it chose (options, per-rank memory parts, step time parts, tokens/s; see
      :func:`lightning_3d.strategy.auto.planned_figures`), read from the strategy's ``planned``,
      to set against the measured figures above.

    Tokens/s, TFLOP/s per device and MFU (where a peak is known) are logged every optimizer step
    and shown on the progress bar as ``tok/s``, ``tflops`` and ``mfu``.

    ``peak_tflops``: the peak dense TFLOP/s of one device that MFU is measured against, for a
    device the table does not know (or to measure against another figure); ``ValueError``
    unless positive.
    """

    def __init__(
        self,
        out_dir: Optional[str] = None,
        warmup_steps: int = 3,
        filename: str = "summary.json",
        peak_tflops: Optional[float] = None,
    ) -> None:
        self.peak_tflops = check_peak_tflops(peak_tflops)
        self.out_dir = out_dir
        self.warmup_steps = warmup_steps
        self.filename = filename
        self._losses: list[float] = []
        self._local_losses: list[float] = []
        # (local, global) loss tensors of the steps not read yet: reading them costs a host
        # sync on an accelerator, so they are read together (see _read_losses), not every step.
        self._unread: list[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = []
        # The module's step_figures() of every step, read to the host at the end.
        self._figures: list[dict[str, torch.Tensor]] = []
        self._losses_are_objective = False
        self._dp = 1  # data-parallel size, known at train start
        self._cp = 1  # context-parallel size: a batch holds 1/cp of each sequence's tokens
        self.step_times: list[float] = []
        self.step_tokens: list[int] = []
        self.step_flops: list[float] = []  # global model FLOPs of each optimizer step
        self.memory: dict[str, int] = {}
        self.activations: dict[str, int] = {}
        self.summary: dict[str, Any] = {}
        self._meter: ActivationMeter | None = None
        self._meter_context = ExitStack()
        self._loss_sum: Optional[torch.Tensor] = None
        self._tokens = 0
        self._flops = 0.0
        self._per_token: Optional[Callable[[int], float]] = None  # seq_len -> FLOPs per token
        self._flops_formula = ""
        self._num_params: Optional[int] = None
        self._peak = Peak(None, "not measured")
        self._t0: Optional[float] = None
        self._last_step = 0
        self._observed: dict[str, list[dict[str, Any]]] = {}  # telemetry events by name
        self._unsubscribe: Optional[Any] = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        telemetry = getattr(trainer.strategy, "telemetry", None)  # ThreeDStrategy's observer hub
        if telemetry is not None and self._unsubscribe is None:
            self._unsubscribe = telemetry.subscribe(
                lambda event, fields: self._observed.setdefault(event, []).append(fields)
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        self._dp = _dp_size(trainer)  # a device-mesh lookup: once, not per step
        self._cp = getattr(trainer.strategy, "context_size", 1)
        # Once per fit, off the step: a collective under a pipeline (stages add up), on every rank.
        self._num_params = _count_parameters(trainer, pl_module)
        per_token, self._flops_formula = model_flops_per_token(pl_module, self._num_params)
        # A few sequence lengths at most.
        self._per_token = functools.lru_cache(maxsize=16)(per_token)
        self._peak = device_peak(
            trainer.strategy.root_device, str(trainer.precision), self.peak_tflops
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if not self.activations and self._meter is None:  # the first batch only: no cost afterwards
            self._start_meter(pl_module)

    def _start_meter(self, pl_module: pl.LightningModule) -> None:
        self._meter = ActivationMeter()
        self._meter_context.callback(self._meter.watch(transformer_blocks(pl_module)))
        self._meter.reset(pl_module.parameters())
        self._meter_context.enter_context(self._meter.hooks())

    def _stop_meter(self, pl_module: pl.LightningModule) -> None:
        meter, self._meter = self._meter, None
        self._meter_context.close()
        self.activations = self.activation_figures(meter, pl_module)

    @staticmethod
    def activation_figures(meter: ActivationMeter, pl_module: pl.LightningModule) -> dict[str, int]:
        """The summary's activation figures from a meter that watched one training batch:

        - ``activation_bytes_per_block``: bytes autograd saved for backward while this rank's
          transformer blocks ran (each storage once, parameters excluded; what checkpointing keeps
          included), divided by the number of blocks this rank holds. Under a pipeline the batch
          is all of the step's micro-batches; under tensor parallelism, this rank's shards;
        - ``activation_host_bytes_per_block``: bytes the same saves put in host memory instead
          (``activation_offload``: each block's saves wait there between forward and backward;
          0 without it), counted the same way, per block; ``activation_host_peak_bytes``: the
          most of them alive at once. On a device the first figure is what left it; on a CPU
          the host copy sits in the same memory, which is why the meter keeps the two apart;
        - ``blocks_on_rank``: that number of blocks; ``checkpointed_blocks``: how many of them
          recompute their activations in backward.

        ``activation_bytes_per_block`` is left out for a module without blocks (no
        ``nn.ModuleList`` of trainable modules).
        """
        blocks = transformer_blocks(pl_module)
        figures = {
            "blocks_on_rank": len(blocks),
            "checkpointed_blocks": sum(is_checkpointed(b) for _, b in blocks),
        }
        if meter.block_bytes:
            figures["activation_bytes_per_block"] = round(
                sum(meter.block_bytes.values()) / len(meter.block_bytes)
            )
            figures["activation_host_bytes_per_block"] = round(
                sum(meter.block_host_bytes.values()) / len(meter.block_bytes)
            )
            figures["activation_host_peak_bytes"] = meter.host_peak
        return figures

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._meter = None
        self._meter_context.close()  # the hooks of a batch that did not finish

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # End of backward, gradients reduced, optimizer not yet stepped: the ZeRO accounting point.
        # Steady state after the first step (optimizer state exists); counted once, off the hot path.
        if not self.memory or trainer.global_step == 1:
            self.memory = model_state_bytes(pl_module, trainer.optimizers)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._meter is not None:  # forward and backward of the first batch are done
            self._stop_meter(pl_module)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            # Lightning divides each micro-batch loss by accumulate_grad_batches: summing gives the mean.
            # At least fp32 (a bf16 loss sums badly), fp64 kept: an fp64 run's parity is read from it.
            loss = loss.detach().to(torch.promote_types(loss.dtype, torch.float32))
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        ids = _token_ids(batch)
        if ids is not None:
            tokens = ids.numel() * self._dp * self._cp
            self._tokens += tokens
            if self._per_token is not None and ids.dim() >= 1:
                self._flops += tokens * self._per_token(ids.shape[-1] * self._cp)
        if trainer.global_step == self._last_step:
            return  # still accumulating
        self._last_step = trainer.global_step
        local = step_loss = self._loss_sum
        objective = getattr(trainer.strategy, "objective", None)  # ThreeDStrategy's
        mean = None if objective is None else objective.value()
        if mean is not None:  # the step's token mean over the global batch: every rank's
            local = step_loss = mean
        elif local is not None and trainer.world_size > 1:  # reduced in place: keep ours
            local = local.clone()
            step_loss = trainer.strategy.reduce(self._loss_sum, reduce_op="mean")
        self._unread.append((local, step_loss))
        self._losses_are_objective = mean is not None
        figures = getattr(pl_module, "step_figures", None)
        step = figures() if callable(figures) else {}
        if step:  # a module with figures this step (a dense Hugging Face model has none)
            self._figures.append({k: v.detach() for k, v in step.items()})
        if len(self._unread) >= UNREAD_STEPS:
            self._read_losses()
        now = time.perf_counter()
        self.step_times.append(now - self._t0)
        self.step_tokens.append(self._tokens)
        self.step_flops.append(self._flops)
        elapsed = max(now - self._t0, 1e-9)
        logged = {"tok/s": self._tokens / elapsed}
        if self._per_token is not None:
            logged["tflops"] = self._flops / elapsed / trainer.world_size / 1e12
            if self._peak.tflops is not None:
                logged["mfu"] = logged["tflops"] / self._peak.tflops
        # As host tensors: a Python number would become a tensor on the module's device, a
        # host-to-device copy that waits for the device, three times a step.
        pl_module.log_dict(
            {k: torch.tensor(v, dtype=torch.float32) for k, v in logged.items()},
            prog_bar=True,
            on_step=True,
            logger=bool(trainer.loggers),
        )
        self._t0, self._tokens, self._flops, self._loss_sum = now, 0, 0.0, None

    @property
    def losses(self) -> list[float]:
        """The global mean training loss of every optimizer step so far (see the class docstring)."""
        self._read_losses()
        return self._losses

    @property
    def local_losses(self) -> list[float]:
        """This rank's own loss of every optimizer step so far (see the class docstring)."""
        self._read_losses()
        return self._local_losses

    def _read_losses(self) -> None:
        """Move the unread steps' losses to the host: one sync for all of them."""
        unread, self._unread = self._unread, []
        tensors = [t for pair in unread for t in pair if t is not None]
        if not tensors:
            self._losses.extend(float("nan") for _ in unread)
            return
        values = iter(torch.stack([t.reshape(()).to(tensors[0].device) for t in tensors]).tolist())
        for local, step_loss in unread:
            if local is not None:
                self._local_losses.append(next(values))
            self._losses.append(next(values) if step_loss is not None else float("nan"))

    def _observed_figures(self) -> dict[str, Any]:
        """What the strategy's telemetry reported: the vocab-parallel logits' sizes (tensor > 1)
        and, under a pipeline, the idle share of each schedule step (median after warm-up), the
        saved activations alive at once and the micro-batches between forward and backward."""
        figures: dict[str, Any] = {}
        logits = self._observed.get("logits")
        if logits:
            figures["logits_bytes"], figures["logits_dense_bytes"] = (
                logits[-1]["local_bytes"],
                logits[-1]["dense_bytes"],
            )
        compiled = self._observed.get("compiled")
        if compiled:
            figures["compiled_blocks"] = compiled[-1]["blocks"]
        steps = self._observed.get("pipeline_step")
        if steps:
            bubbles = [s["bubble_fraction"] for s in steps]
            figures["bubble_fraction"] = round(
                statistics.median(bubbles[self.warmup_steps :] or bubbles), 4
            )
            figures["activation_peak_bytes"] = max(s["activation_peak"] for s in steps)
            figures["in_flight_peak"] = max(s["in_flight_peak"] for s in steps)
        return figures

    def _steady_median(self, amounts: list[float]) -> float:
        """Median over steps after warm-up of ``amount / step time`` (all steps if none after)."""
        rates = [n / t for n, t in zip(amounts, self.step_times) if t > 0]
        steady = rates[self.warmup_steps :] or rates
        return statistics.median(steady) if steady else 0.0

    def tokens_per_s(self) -> float:
        return self._steady_median(self.step_tokens)

    def flops_figures(self, world_size: int) -> dict[str, Any]:
        """The summary's FLOP figures (see the class docstring)."""
        tokens = sum(self.step_tokens)
        tflops = (
            self._steady_median(self.step_flops) / world_size / 1e12 if self.step_flops else None
        )
        peak = self._peak.tflops
        return {
            "flops_per_token": sum(self.step_flops) / tokens if tokens else None,
            "flops_formula": self._flops_formula or None,
            "tflops": tflops,
            "peak_tflops": peak,
            "peak_source": self._peak.source,
            "mfu": tflops / peak if tflops is not None and peak is not None else None,
        }

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mine = {
            "rank": trainer.global_rank,
            "peak_rss_mb": round(peak_rss_mb(), 1),
            **self.memory,
            **self.activations,
        }
        device = trainer.strategy.root_device
        if device.type == "cuda":  # the accelerator's own peak, next to the host's RSS
            mine["device_peak_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
            mine["device_reserved_mb"] = round(torch.cuda.max_memory_reserved(device) / 2**20, 1)
        mine.update(self._observed_figures())
        ranks = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        self.summary = {
            "layout": describe_layout(trainer),
            "num_params": self._num_params
            if self._num_params is not None
            else _count_parameters(trainer, pl_module),
            "steps": len(self.losses),
            "losses": self.losses,
            "tokens_per_s": self.tokens_per_s(),
            **self.flops_figures(trainer.world_size),
            "step_time_s": statistics.median(self.step_times) if self.step_times else None,
            "ranks": ranks,
        }
        planned = getattr(trainer.strategy, "planned", None)  # parallelism=auto's predictions
        if planned is not None:
            self.summary["planned"] = planned
        if self._figures:
            names = {name for step in self._figures for name in step}
            self.summary["step_figures"] = {
                n: [s[n].tolist() if n in s else None for s in self._figures] for n in sorted(names)
            }
            if "aux_loss" in names:  # the returned loss adds it; the objective's token mean not
                self.summary["losses_include_aux_loss"] = not self._losses_are_objective
        if trainer.is_global_zero:
            out = Path(self.out_dir or trainer.default_root_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / self.filename).write_text(json.dumps(self.summary, indent=2))


def _rng_states() -> dict[str, Any]:
    """This process's generator states, in types a weights-only ``torch.load`` reads back."""
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()  # this rank's own device
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(states["torch"])
    n = states["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


class RNGStateCheckpoint(Callback):
    """Save every rank's RNG states (torch, CUDA, numpy, ``random``) in checkpoints; restore them
    when a fit resumes, so dropout after a resume draws what the uninterrupted run drew.

    Lightning itself keeps no RNG state in checkpoints. A checkpoint is consolidated (rank 0
    writes it), so saving gathers every rank's states into rank 0's; on load each rank takes its
    own. They are applied in ``on_train_start``, the last hook before the first resumed step
    (after the sanity check and the data loader's set-up). A checkpoint from a world of another
    size cannot be mapped rank to rank: the generators are then left as seeded, with a warning.

    Example::

        trainer = L.Trainer(callbacks=[RNGStateCheckpoint(), ModelCheckpoint(every_n_train_steps=100)])
        trainer.fit(model, data, ckpt_path="last")
    """

    def __init__(self) -> None:
        self._to_restore: Optional[list[dict[str, Any]]] = None

    @override
    def state_dict(self) -> dict[str, Any]:
        # Called on every rank while a checkpoint is assembled (all ranks take part in a save).
        local = _rng_states()
        if dist.is_available() and dist.is_initialized():
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, local)
        else:
            ranks = [local]
        return {"ranks": ranks}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict["ranks"]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        saved, self._to_restore = self._to_restore, None
        if saved is None:
            return
        if len(saved) != trainer.world_size:
            warnings.warn(
                f"the checkpoint holds RNG states of {len(saved)} ranks, this run has {trainer.world_size}: "
                "RNG states not restored, so random draws (dropout) differ from an uninterrupted run",
                stacklevel=2,
            )
            return
        _set_rng_states(saved[trainer.global_rank])
