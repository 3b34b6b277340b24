"""One candidate layout as data, and the planner's options (what to enumerate, how to model).

A :class:`Choice` is the part of a ``ThreeDStrategy`` plan the planner varies (sizes, ZeRO
stage, micro-batches and schedule, activation checkpointing, offload) plus the batch it was
sized for; :meth:`Choice.options` gives the strategy's own option names, so the planner only
proposes plans that ``Plan.from_options`` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_3d.layout import ZERO_STAGES
from lightning_3d.parallel.activation_checkpoint import POLICIES
from lightning_3d.parallel.pipeline import MULTI_STAGE, SCHEDULES
from lightning_3d.planner.facts import PRECISIONS

OFFLOADS = ("none", "cpu", "cpu+params")  # cpu+params: ZeRO-3 shards of parameters on the host too


@dataclass(frozen=True)
class Choice:
    data: int
    tensor: int
    pipeline: int
    zero_stage: int = 0
    micro_batches: int = 1  # pipeline > 1: the schedule's micro-batches; else gradient accumulation steps
    schedule: str = "1f1b"  # only meaningful with pipeline > 1
    ac_policy: str = "none"
    offload: str = "none"  # one of OFFLOADS
    batch_per_rank: int = 1  # samples per data-parallel rank per optimizer step

    @property
    def world_size(self) -> int:
        return self.data * self.tensor * self.pipeline

    @property
    def micro_batch_size(self) -> int:
        return self.batch_per_rank // self.micro_batches

    def options(self) -> dict[str, Any]:
        """``ThreeDStrategy`` / ``Plan.from_options`` keyword arguments of this layout."""
        out: dict[str, Any] = {"data": self.data, "tensor": self.tensor, "pipeline": self.pipeline,
                               "zero_stage": self.zero_stage, "ac_policy": self.ac_policy,
                               "offload": "none" if self.offload == "none" else "cpu",
                               "offload_params": self.offload == "cpu+params"}
        if self.pipeline > 1:
            out.update(micro_batches=self.micro_batches, schedule=self.schedule)
        return out

    def trainer_options(self) -> dict[str, Any]:
        """Without a pipeline the micro-batches are Lightning's gradient accumulation."""
        return {} if self.pipeline > 1 or self.micro_batches == 1 else {"accumulate_grad_batches": self.micro_batches}

    def label(self) -> str:
        sched = f"{self.schedule} m={self.micro_batches}" if self.pipeline > 1 else f"accum={self.micro_batches}"
        return (f"dp={self.data} tp={self.tensor} pp={self.pipeline} zero={self.zero_stage} {sched} "
                f"mb={self.micro_batch_size} ac={self.ac_policy} offload={self.offload}")


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
    measured on this project's 2-core CPU; ``python -m lightning_3d.planner.machine`` measures it);
    ``adam_params_per_s``: parameters one device's (not offloaded) Adam updates per second, a
    memory-bound pass over parameters, gradients and moments (~28 bytes each in fp32: 1e11 is an
    H100's 3 TB/s; measured ~1e8 per core of this project's CPU).
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
    zero_stages: tuple[int, ...] = ZERO_STAGES
    ac_policies: tuple[str, ...] = ("none", "selective", "full")
    offloads: tuple[str, ...] = ("none", "cpu")
    schedules: tuple[str, ...] = ("1f1b", "gpipe")
    max_micro_batches: int = 64

    def __post_init__(self) -> None:
        problems = []
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                problems.append(f"{name}={value!r} must be a positive integer or null")
        if self.precision not in PRECISIONS:
            problems.append(f"precision={self.precision!r} must be one of {list(PRECISIONS)}")
        for name, low, high in (("efficiency", 0.0, 1.0), ("overlap", 0.0, 1.0), ("forward_share", 0.0, 1.0)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low < value <= high:
                if not (name == "overlap" and value == 0):
                    problems.append(f"{name}={value!r} must be in ({low}, {high}]")
        for name in ("reserve_gb", "latency_us", "launch_overhead_us"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                problems.append(f"{name}={value!r} must be a number >= 0")
        for name in ("bucket_size_mb", "cpu_adam_params_per_s", "adam_params_per_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                problems.append(f"{name}={value!r} must be a positive number")
        policies = tuple(p for p in POLICIES if p != "every_n")
        schedules = tuple(s for s in SCHEDULES if s not in MULTI_STAGE)  # interleaved: not modelled yet
        for name, allowed in (("zero_stages", ZERO_STAGES), ("ac_policies", policies), ("offloads", OFFLOADS),
                              ("schedules", schedules)):
            values = tuple(getattr(self, name))
            bad = [v for v in values if v not in allowed]
            if not values or bad:
                problems.append(f"{name}={list(values)!r} must be a non-empty list of {list(allowed)}")
        if not isinstance(self.max_micro_batches, int) or isinstance(self.max_micro_batches, bool) \
                or self.max_micro_batches < 1:
            problems.append(f"max_micro_batches={self.max_micro_batches!r} must be a positive integer")
        if problems:
            raise ValueError("; ".join(problems))
        for name in ("zero_stages", "ac_policies", "offloads", "schedules"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def global_batch(self, world_size: int) -> int:
        return self.batch_size if self.batch_size is not None else 8 * world_size
