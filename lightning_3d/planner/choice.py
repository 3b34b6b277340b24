"""One candidate layout as data, and the planner's options (what to enumerate, how to model).

A :class:`Choice` is the part of a ``ThreeDStrategy`` plan the planner varies (sizes, ZeRO
stage, micro-batches and schedule, activation checkpointing, offload) plus the batch it was
sized for; :meth:`Choice.options` gives the strategy's own option names, so the planner only
proposes plans that ``Plan.from_options`` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_3d.layout import ZERO_STAGES
from lightning_3d.parallel.activation_checkpoint import POLICIES
from lightning_3d.parallel.chunked_loss import ChunkedLossOptions
from lightning_3d.parallel.optimizers import OPTIMIZERS
from lightning_3d.parallel.pipeline import MULTI_STAGE, SCHEDULES
from lightning_3d.planner.facts import PRECISIONS

# How the model is fine-tuned: every weight, LoRA adapters, or LoRA on an NF4 base
# (lightning_3d.adapters; HFCausalLM(adapter=...)). The planner's model: planner/methods.py.
ADAPTERS = ("none", "lora", "qlora")
# Where Adam's state goes; "+params": ZeRO-3's parameter and gradient shards in host memory too.
OFFLOADS = ("none", "cpu", "cpu+params", "nvme", "nvme+params")
# The schedules, the simpler first: the default enumeration order, which breaks the last ties
# among equally fast and equally simple layouts (the ranking sorts stably).
SCHEDULE_ORDER = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble")
# The memory kit's rungs, in the order the search climbs them (planner/kit.py):
# the chunked loss, AdamW's 8-bit states, activations offloaded to host memory.
MEMORY_KIT = ("loss_chunks", "low_bit", "activation_offload")
# The optimizer the low-bit rung puts in place of AdamW (torchao: it steps ZeRO's DTensor slices).
LOW_BIT_OPTIMIZER = "adamw8bit"


@dataclass(frozen=True)
class Choice:
    data: int
    tensor: int
    pipeline: int
    zero_stage: int = 0
    # Pipeline > 1: the schedule's micro-batches; else gradient accumulation steps.
    micro_batches: int = 1
    schedule: str = "1f1b"  # only meaningful with pipeline > 1
    ac_policy: str = "none"
    offload: str = "none"  # one of OFFLOADS
    batch_per_rank: int = 1  # samples per data-parallel rank per optimizer step
    virtual_stages: int = 1  # stages per pipeline rank (the interleaved schedules: more than 1)
    # Tensor > 1: norms, dropout and the residual stream sharded by sequence.
    sequence_parallel: bool = False
    # One of ADAPTERS: the model's option (HFCausalLM(adapter=...)), not the strategy's.
    adapter: str = "none"
    context: int = 1  # ranks each sequence is split over (context parallelism)
    context_scheme: str = "ring"  # with context > 1: "ring" or "alltoall"
    # ZeRO-3 with accumulation: units stay gathered, gradients unsharded, through the step.
    zero3_keep_gathered: bool = False
    # ZeRO-2 with accumulation: full-size gradients over the micro-batches, one reduce-scatter.
    zero2_defer_reduce: bool = False
    # ZeRO 0-2 with a bf16 module: fp32 masters (True, the default) or the bf16 weights stepped
    # with bf16 moments (False).
    zero_master_weights: bool = True
    # The head and loss over this many chunks of tokens (parallel/chunked_loss.py); 1: whole logits.
    loss_chunks: int = 1
    # The model's optimizer (parallel/optimizers.py: adamw, sgd, adamw8bit, adamw4bit, ...).
    optimizer: str = "adamw"
    # Each block's saved activations in host memory between forward and backward.
    activation_offload: bool = False
    # Ranks an MoE model's experts are split over, carved from the data ranks (parallel/expert.py).
    expert: int = 1

    @property
    def offload_device(self) -> str:
        """``none``, ``cpu`` or ``nvme``: where Adam's state lives."""
        return self.offload.split("+")[0]

    @property
    def offload_params(self) -> bool:
        return self.offload.endswith("+params")

    @property
    def world_size(self) -> int:
        return self.data * self.tensor * self.pipeline * self.context

    @property
    def micro_batch_size(self) -> int:
        return self.batch_per_rank // self.micro_batches

    def options(self) -> dict[str, Any]:
        """``ThreeDStrategy`` / ``Plan.from_options`` keyword arguments of this layout."""
        out: dict[str, Any] = {
            "data": self.data,
            "tensor": self.tensor,
            "pipeline": self.pipeline,
            "zero_stage": self.zero_stage,
            "ac_policy": self.ac_policy,
            "offload": self.offload_device,
            "offload_params": self.offload_params,
        }
        if self.pipeline > 1:
            out.update(micro_batches=self.micro_batches, schedule=self.schedule)
            if self.schedule in MULTI_STAGE:
                out["virtual_stages"] = self.virtual_stages
        if self.sequence_parallel:
            out["sequence_parallel"] = True
        if self.zero3_keep_gathered:
            out["zero3_keep_gathered"] = True
        if self.zero2_defer_reduce:
            out["zero2_defer_reduce"] = True
        if not self.zero_master_weights:
            out["zero_master_weights"] = False
        if self.context > 1:
            out.update(context=self.context, context_scheme=self.context_scheme)
        if self.loss_chunks > 1:
            out["loss_chunks"] = self.loss_chunks
        if self.activation_offload:
            out["activation_offload"] = True
        if self.expert > 1:
            out["expert"] = self.expert
        return out

    def trainer_options(self) -> dict[str, Any]:
        """Without a pipeline the micro-batches are Lightning's gradient accumulation."""
        return (
            {}
            if self.pipeline > 1 or self.micro_batches == 1
            else {"accumulate_grad_batches": self.micro_batches}
        )

    def label(self) -> str:
        sched = (
            f"{self.schedule} m={self.micro_batches}"
            if self.pipeline > 1
            else f"accum={self.micro_batches}"
        )
        if self.virtual_stages > 1:
            sched += f" v={self.virtual_stages}"
        sp = " sp" if self.sequence_parallel else ""
        method = f"{self.adapter} " if self.adapter != "none" else ""
        cp = f" cp={self.context} {self.context_scheme}" if self.context > 1 else ""
        cp += f" ep={self.expert}" if self.expert > 1 else ""
        sched += " keep" if self.zero3_keep_gathered else ""
        kit = f" {self.kit_label()}" if self.kit_label() else ""
        return (
            f"{method}dp={self.data}{cp} tp={self.tensor}{sp} pp={self.pipeline} "
            f"zero={self.zero_stage}{self.masters_label()} "
            f"{sched} mb={self.micro_batch_size} ac={self.ac_policy} offload={self.offload}{kit}"
        )

    def masters_label(self) -> str:
        """`` no-masters`` where ZeRO 0-2 step a low-precision module's own weights
        (``zero_master_weights=False``: bf16 moments, no fp32 masters); empty otherwise."""
        return " no-masters" if not self.zero_master_weights and self.zero_stage < 3 else ""

    def kit_label(self) -> str:
        """The memory savings this layout runs with (``loss_chunks=32 adamw8bit
        activation_offload``), empty without any."""
        parts = [f"loss_chunks={self.loss_chunks}"] if self.loss_chunks > 1 else []
        parts += [self.optimizer] if self.optimizer not in ("adamw", "sgd") else []
        parts += ["activation_offload"] if self.activation_offload else []
        return " ".join(parts)


@dataclass(frozen=True)
class PlannerOptions:
    """How the planner enumerates and models. Every figure is documented where it is used.

    ``batch_size``: global samples per optimizer step (``None``: 8 per device);
    ``seq_len``: tokens per sample (``None``: the model's maximum positions);
    ``efficiency``: the share of ``peak_tflops`` a step's matmuls reach (0.5: a typical
    well-tuned large-model run; MFU is then at most this);
    ``overlap``: the share of backward time gradient communication can hide behind;
    ``reserve_gb``: device memory no layout may use (CUDA context, allocator fragmentation);
    ``cpu_adam_params_per_s``: parameters one node's CPUs step per second in an offloaded Adam;
    ``latency_us``: the fixed cost of one collective or point-to-point message;
    ``launch_overhead_us``: the fixed cost of one block's forward and backward on one
    micro-batch (kernel launches), which many tiny micro-batches cannot go below;
    ``forward_share``: the forward's share of a block's forward + backward time, which full
    activation checkpointing runs again (1/3: the forward's 2 of 6 matmul FLOPs; 0.29-0.34
    measured on this project's 2-core CPU; ``python -m tools.calibration.machine`` measures it);
    ``adam_params_per_s``: parameters one device's (not offloaded) Adam updates per second, a
    memory-bound pass over parameters, gradients and moments (~28 bytes each in fp32: 1e11 is an
    H100's 3 TB/s; measured ~1e8 per core of this project's CPU);
    ``selective_share``: what selective activation checkpointing adds to a block's forward +
    backward time, as a share of it (its recomputed elementwise ops and caching; 0.05: a GPU's
    fused elementwise kernels; measured ~0.3 on this project's CPU);
    ``reduce_scatter_efficiency`` / ``all_gather_efficiency``: the bytes per second of a
    reduce-scatter / all-gather over an all-reduce's, per byte a rank sends (1: NCCL's rings run
    all three at the link's rate; gloo's all-gather reached ~0.3 here);
    ``tp_overhead``: a tensor-parallel block's time beyond its FLOP share and its all-reduces, as
    a share of that FLOP share (the norms and residuals every tensor rank repeats, DTensor's
    per-op dispatch; 0.05 on a GPU, ~0.4 measured on this project's CPU);
    ``step_overhead_us``: the fixed cost of one optimizer step whatever the model (the training
    loop, the data loader, the strategy's per-step agreement collectives; ~10 ms measured on two
    gloo ranks here). Every one of these is measured by ``python -m tools.calibration.machine``.

    What is enumerated: ``zero_stages``, ``ac_policies``, ``offloads`` (:data:`OFFLOADS`),
    ``schedules`` (with a pipeline; the interleaved ones with each of ``virtual_stages`` stages
    per rank), ``sequence_parallel`` (also each tensor-parallel layout with it) and micro-batches
    up to ``max_micro_batches``, and the fine-tune method, ``adapters`` (:data:`ADAPTERS`:
    ``none`` trains every weight; ``lora`` / ``qlora`` adapters of rank ``lora_r`` on every
    linear projection of the blocks, :mod:`lightning_3d.planner.methods`). QLoRA layouts with
    tensor parallelism are refused as the project refuses them; adapters are not tried with
    sequence parallelism (the project refuses that pair too). ``context_sizes``: the context
    (sequence-splitting) sizes tried, a list or ``"auto"`` (the default,
    :meth:`context_sizes_for`: the powers of two the world and the sequence allow, where the
    model's attention can be routed); a sequence whose activations fit no other layout is split
    over ranks (all-to-all where the heads divide, else ring), and a layout that fits without
    it keeps its rank, since splitting a sequence adds exchanges and saves no compute.
    ``expert_sizes``: the expert-parallel sizes tried on a mixture-of-experts model, a list or
    ``"auto"`` (the default, :meth:`expert_sizes_for`: every size dividing both the data size
    and the expert count); a dense model is planned without an expert axis.

    The run's own memory savings, counted in every layout: ``loss_chunks`` (1, a count, or
    ``"auto"``: ``ceil(vocabulary / width)`` chunks where the chunked loss is built, whole
    logits under tensor parallelism, as the run resolves it), ``optimizer`` (the model's:
    ``adamw``, ``adamw8bit``, ... its state bytes by :func:`~lightning_3d.planner.facts.optimizer_state_bytes`)
    and ``activation_offload``; ``zero_master_weights`` (False: a ``bf16-true`` module's ZeRO
    0-2 steps its bf16 weights with bf16 moments, no fp32 masters). ``memory_kit``: the savings
    the search may turn on where a layout does not fit without them (:data:`MEMORY_KIT`, climbed cheapest first, see
    :mod:`lightning_3d.planner.kit`); empty: none. ``checkpoints``: the run saves periodic
    checkpoints, which the low-bit states refuse under ZeRO 1-3.
    """

    batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    precision: str = "bf16-mixed"
    efficiency: float = 0.5
    overlap: float = 0.5
    reserve_gb: float = 1.0
    bucket_size_mb: float = 25.0
    cpu_adam_params_per_s: float = 2e9
    latency_us: float = 10.0
    launch_overhead_us: float = 30.0
    forward_share: float = 1 / 3
    adam_params_per_s: float = 1e11
    selective_share: float = 0.05
    reduce_scatter_efficiency: float = 1.0
    all_gather_efficiency: float = 1.0
    tp_overhead: float = 0.05
    step_overhead_us: float = 1000.0
    zero_stages: tuple[int, ...] = ZERO_STAGES
    ac_policies: tuple[str, ...] = ("none", "selective", "full")
    offloads: tuple[str, ...] = ("none", "cpu", "nvme")
    schedules: tuple[str, ...] = SCHEDULE_ORDER
    virtual_stages: tuple[int, ...] = (2,)  # stages per rank tried with the interleaved schedules
    sequence_parallel: bool = True  # also try each tensor-parallel layout with sequence parallelism
    max_micro_batches: int = 64
    adapters: tuple[str, ...] = ("none",)  # what parallelism=auto plans: the run's own method
    lora_r: int = 8  # rank of every adapter (peft's r)
    # context-parallel sizes tried (docs/context-parallelism.md); "auto": see context_sizes_for
    context_sizes: Union[str, tuple[int, ...]] = "auto"
    # expert-parallel sizes tried on an MoE model (docs/parallelism.md); "auto": expert_sizes_for
    expert_sizes: Union[str, tuple[int, ...]] = "auto"
    loss_chunks: Union[int, str] = 1  # the run's own: 1, a count, or "auto"
    optimizer: str = "adamw"  # the model's optimizer (parallel/optimizers.py)
    activation_offload: bool = False  # the run's own
    # the run's own: bf16-true at ZeRO 0-2 keeps fp32 masters (False: bf16 weights and moments)
    zero_master_weights: bool = True
    memory_kit: tuple[str, ...] = ()  # rungs of MEMORY_KIT the search may turn on
    checkpoints: bool = False  # the run saves periodic checkpoints

    def __post_init__(self) -> None:
        problems = []
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                problems.append(f"{name}={value!r} must be a positive integer or null")
        if self.precision not in PRECISIONS:
            problems.append(f"precision={self.precision!r} must be one of {list(PRECISIONS)}")
        for name, low, high in (
            ("efficiency", 0.0, 1.0),
            ("overlap", 0.0, 1.0),
            ("forward_share", 0.0, 1.0),
            ("reduce_scatter_efficiency", 0.0, 1.0),
            ("all_gather_efficiency", 0.0, 1.0),
        ):
            value = getattr(self, name)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not low < value <= high
            ):
                if not (name == "overlap" and value == 0):
                    problems.append(f"{name}={value!r} must be in ({low}, {high}]")
        for name in (
            "reserve_gb",
            "latency_us",
            "launch_overhead_us",
            "selective_share",
            "tp_overhead",
            "step_overhead_us",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                problems.append(f"{name}={value!r} must be a number >= 0")
        for name in ("bucket_size_mb", "cpu_adam_params_per_s", "adam_params_per_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                problems.append(f"{name}={value!r} must be a positive number")
        policies = tuple(p for p in POLICIES if p != "every_n")
        for name, allowed in (
            ("zero_stages", ZERO_STAGES),
            ("ac_policies", policies),
            ("offloads", OFFLOADS),
            ("schedules", SCHEDULES),
            ("adapters", ADAPTERS),
        ):
            values = tuple(getattr(self, name))
            bad = [v for v in values if v not in allowed]
            if not values or bad:
                problems.append(
                    f"{name}={list(values)!r} must be a non-empty list of {list(allowed)}"
                )
        if (
            not isinstance(self.max_micro_batches, int)
            or isinstance(self.max_micro_batches, bool)
            or self.max_micro_batches < 1
        ):
            problems.append(
                f"max_micro_batches={self.max_micro_batches!r} must be a positive integer"
            )
        virtual = tuple(self.virtual_stages)
        if not virtual or any(
            not isinstance(v, int) or isinstance(v, bool) or v < 2 for v in virtual
        ):
            problems.append(
                f"virtual_stages={list(virtual)!r} must be a non-empty list of integers >= 2"
            )
        if not isinstance(self.lora_r, int) or isinstance(self.lora_r, bool) or self.lora_r < 1:
            problems.append(f"lora_r={self.lora_r!r} must be a positive integer")
        contexts = self.context_sizes
        if contexts != "auto" and (
            isinstance(contexts, str)
            or not isinstance(contexts, (list, tuple))
            or not contexts
            or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in contexts)
        ):
            shown = list(contexts) if isinstance(contexts, (list, tuple)) else contexts
            problems.append(
                f"context_sizes={shown!r} must be 'auto' or a non-empty list of positive integers"
            )
        experts = self.expert_sizes
        if experts != "auto" and (
            isinstance(experts, str)
            or not isinstance(experts, (list, tuple))
            or not experts
            or any(not isinstance(e, int) or isinstance(e, bool) or e < 1 for e in experts)
        ):
            shown = list(experts) if isinstance(experts, (list, tuple)) else experts
            problems.append(
                f"expert_sizes={shown!r} must be 'auto' or a non-empty list of positive integers"
            )
        if not isinstance(self.sequence_parallel, bool):
            problems.append(f"sequence_parallel={self.sequence_parallel!r} must be true or false")
        problems += self._kit_problems()
        if problems:
            raise ValueError("; ".join(problems))
        for name in (
            "zero_stages",
            "ac_policies",
            "offloads",
            "schedules",
            "virtual_stages",
            "adapters",
            "memory_kit",
        ):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if contexts != "auto":
            object.__setattr__(self, "context_sizes", tuple(contexts))
        if experts != "auto":
            object.__setattr__(self, "expert_sizes", tuple(experts))

    def _kit_problems(self) -> list[str]:
        """The run's memory options and the kit's rungs, each problem naming its values."""
        problems = ChunkedLossOptions(self.loss_chunks).problems()
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer={self.optimizer!r} must be one of {list(OPTIMIZERS)}")
        for name in ("activation_offload", "checkpoints", "zero_master_weights"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be true or false")
        kit = self.memory_kit
        if isinstance(kit, str) or not isinstance(kit, (list, tuple)):
            problems.append(f"memory_kit={kit!r} must be a list of {list(MEMORY_KIT)}")
        elif any(rung not in MEMORY_KIT for rung in kit):
            problems.append(f"memory_kit={list(kit)!r} must be a list of {list(MEMORY_KIT)}")
        return problems

    def context_sizes_for(self, world: int, seq_len: int, routable: bool = True) -> tuple[int, ...]:
        """The context sizes to enumerate on ``world`` ranks for ``seq_len`` tokens: the given
        list, or for ``"auto"`` every power of two up to ``world`` that divides it and for which
        ``seq_len`` divides by twice the size (the kernels' two chunks per rank); only 1 where
        the model's attention cannot be routed (``routable=False``: no attention layer context
        parallelism knows, dropout in it, sliding windows, ...)."""
        if self.context_sizes != "auto":
            return self.context_sizes
        sizes, size = [1], 2
        while routable and size <= world:
            if world % size == 0 and seq_len % (2 * size) == 0:
                sizes.append(size)
            size *= 2
        return tuple(sizes)

    def expert_sizes_for(self, data: int, n_experts: int) -> tuple[int, ...]:
        """The expert sizes to enumerate on ``data`` data ranks for a model of ``n_experts``
        experts per layer: those of the given list, or for ``"auto"`` every size, that divide
        both (the expert axis is carved from the data ranks and splits each layer's experts
        evenly); empty where no given size does."""
        given = range(1, data + 1) if self.expert_sizes == "auto" else self.expert_sizes
        return tuple(sorted({e for e in given if data % e == 0 and n_experts % e == 0}))

    def global_batch(self, world_size: int) -> int:
        return self.batch_size if self.batch_size is not None else 8 * world_size
