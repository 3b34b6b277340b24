"""``auto=True`` / ``parallelism=auto``: run the planner's first choice for the world that is found.

The planner (:func:`~lightning_3d.planner.plan_layouts`) stays pure; this module is the glue
that describes the machine the run landed on as a :class:`~lightning_3d.planner.Cluster`, turns
the plan's other options into the planner's constraints, picks the first layout and makes it a
concrete :class:`~lightning_3d.options.Plan` (``auto`` off), logged on rank 0 with its predicted
memory per rank and tokens/s.

The cluster found (:func:`found_cluster`): devices per node = the local world size, nodes = world
/ local; device memory = ``torch.cuda.get_device_properties(...).total_memory`` on a GPU, and on a
CPU the host's RAM divided by its ranks (the ranks share the host; offload then saves nothing,
so CPU offload is not enumerated on CPUs unless asked for). Links and peaks the machine cannot
report are assumptions, named in :data:`CPU_ASSUMED` / :data:`GPU_ASSUMED`: they shift the
ranking's compute-to-communication balance, never what fits. On CPU ranks communication does
not overlap compute (:data:`CPU_OPTIONS`); ``python -m tools.calibration.machine`` measures
a machine's own figures.

Options given together with ``auto`` (rule: an option set to anything but its default):
``data`` / ``tensor`` / ``pipeline`` keep only layouts of that size; ``zero_stage``,
``ac_policy``, ``schedule``, ``virtual_stages`` and ``offload="cpu"`` / ``"nvme"`` (with
``offload_params``) narrow the planner's enumeration to that value; ``sequence_parallel=True``
keeps only sequence-parallel layouts; ``micro_batches`` keeps only pipelined layouts with that
many (layouts without a pipeline are unaffected). An option at its default (``zero_stage=0``,
``tensor=1``, ...) leaves the planner free, except that NVMe is only considered where
``offload_path`` names the drive. ``context`` keeps only layouts that split each sequence over
that many ranks (``context_scheme``, if given, only those by that scheme); without it the
planner may split sequences (``PlannerOptions.context_sizes="auto"``). ``expert`` keeps only
layouts that split a mixture-of-experts model's experts over that many ranks; without it the
planner may split them (``PlannerOptions.expert_sizes="auto"``). ``auto_memory_gb`` is the
device memory a rank's layout may fill instead of the device's own, less the 1 GB reserve
(a CPU rank's "device" is its share of the host). What the planner does not model
(``ac_policy="every_n"``) is refused with a ``ValueError``, as is a constraint no fitting layout
meets. Sequence-parallel activations are measured in a fake world, which cannot coexist with the
run's process group, so the strategy's ``auto`` does not choose sequence parallelism (the CLI
planner does). Every other option (bucket size, checkpoint format, compile, ...) passes through
to the chosen plan unchanged.

The memory kit (:mod:`lightning_3d.planner.kit`): a layout that does not fit may run with
the chunked loss (``loss_chunks``), 8-bit AdamW states and activation offload
(``activation_offload``), climbed in that order, and the chosen plan carries what was turned on.
``loss_chunks`` or ``activation_offload`` given with ``auto`` are the run's own (counted in every
layout, ``loss_chunks="auto"`` at the count the run will use) and leave that rung out. The
optimizer is the model's (``hparams.optimizer`` where it names one of
:data:`~lightning_3d.parallel.optimizers.OPTIMIZERS`, else AdamW is assumed); the 8-bit rung is
only climbed where the caller can set it (``optimizer_settable``: the fine-tune app, through
``model.optimizer``; a fine-tune's few steps from trained weights are what 8-bit states are
meant for), never by the strategy, whose model builds its own optimizer, nor by the training
app, whose optimizer's rounding it would change unasked; activation offload only on GPUs (a
CPU rank's host is its device).

The data decide the batch: the global batch per optimizer step is the data module's
``batch_size`` (global in this project) times the Trainer's ``accumulate_grad_batches``, and
the tokens per sample its ``block_size`` (without a data module: 8 samples per device and the
model's ``block_size``, the planner's defaults). The data loader's batch is fixed, so
micro-batching is only chosen where it needs no other loader: without a pipeline the
micro-batches must equal ``accumulate_grad_batches``; with one, they split the loader's batch
(and need ``accumulate_grad_batches=1``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from lightning_3d.options import AUTO_UNPLANNED, OPTIONS, Plan
from lightning_3d.planner.choice import Choice, PlannerOptions
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.search import Candidate, plan_candidates

# What a machine cannot tell us, by device kind (GB/s per device, dense TFLOP/s per device).
# CPU ranks: gloo through shared memory inside a node, a 10 Gb/s-class network between nodes,
# and a few hundred GFLOP/s of fp32 matmuls per rank; the host link is memory itself.
CPU_ASSUMED = {
    "intra_node_gbps": 2.0,
    "inter_node_gbps": 1.0,
    "peak_tflops": 0.2,
    "host_link_gbps": 20.0,
}
# CPU ranks: a collective is CPU work on the rank's own cores (gloo reduces and copies there), so
# no share of it hides behind compute (measured: python -m tools.calibration.memory --time).
# Round figures python -m tools.calibration.machine measured on gloo ranks of this project's
# 2-core CPU (2026-12-01, a loaded machine): gloo's all-to-all reduce-scatter and its all-gather
# reach ~0.8 and ~0.4 of an all-reduce's bytes/s; a tensor-parallel block costs ~0.5 more than its
# FLOP share (norms every rank repeats, DTensor dispatch); selective checkpointing adds ~0.3 of a
# block's time; a step of a gloo world costs ~15 ms whatever the model.
CPU_OPTIONS = {
    "overlap": 0.0,
    "reduce_scatter_efficiency": 0.8,
    "all_gather_efficiency": 0.4,
    "tp_overhead": 0.5,
    "selective_share": 0.3,
    "step_overhead_us": 15000.0,
}
# GPUs: an NVLink-class node and one 200 Gb/s NIC per device (Cluster's defaults); the peak
# from lightning_3d.observe.flops' table where the device is known, else an H100's.
GPU_ASSUMED = {
    "intra_node_gbps": 300.0,
    "inter_node_gbps": 25.0,
    "peak_tflops": 989.0,
    "host_link_gbps": 25.0,
}

_DEFAULTS = {option.name: option.default for option in OPTIONS}


@dataclass(frozen=True)
class Constraints:
    """What the options given with ``auto`` leave the planner: its enumeration and the sizes to keep."""

    # PlannerOptions keywords (zero_stages, ac_policies, offloads, schedules).
    planner: Mapping[str, Any]
    # Choice field -> the only value kept (data, tensor, pipeline, sequence_parallel)
    sizes: Mapping[str, Any]
    micro_batches: Optional[int] = None  # pipelined layouts: only this many
    # PlannerOptions keywords of memory: the run's own savings and the kit's rungs it may climb.
    memory: Mapping[str, Any] = field(default_factory=dict)


def host_memory_gb() -> float:
    """This host's physical RAM in GB (1e9 bytes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def found_cluster(
    devices_per_node: int, nodes: int, device_type: str, precision: str = "32-true"
) -> Cluster:
    """The machine a run found, as a :class:`Cluster` (see the module's docstring for what is
    assumed). ``device_type``: ``"cuda"`` reads device 0 of this process (all devices of a node
    alike), anything else is a CPU rank sharing the host's RAM with ``devices_per_node - 1`` others."""
    host = host_memory_gb()
    if device_type != "cuda":
        return Cluster(
            nodes=nodes,
            devices_per_node=devices_per_node,
            device_memory_gb=host / devices_per_node,
            host_memory_gb=host,
            **CPU_ASSUMED,
        )
    import torch

    from lightning_3d.observe.flops import named_device_peak

    device = torch.cuda.current_device()
    peak = named_device_peak(torch.cuda.get_device_name(device), precision).tflops
    return Cluster(
        nodes=nodes,
        devices_per_node=devices_per_node,
        device_memory_gb=torch.cuda.get_device_properties(device).total_memory / 1e9,
        host_memory_gb=host,
        **{**GPU_ASSUMED, **({"peak_tflops": peak} if peak else {})},
    )


def constraints(
    plan: Plan, device_type: str = "cuda", optimizer_settable: bool = False
) -> Constraints:
    """The planner's constraints from the options of ``plan`` that differ from their defaults;
    ``ValueError`` for a value the planner does not model. ``optimizer_settable``: the caller
    can run the low-bit optimizer the memory kit may choose (see the module docstring)."""
    given = {
        k: v
        for k, v in plan.options().items()
        if k not in ("auto", "auto_memory_gb") and v != _DEFAULTS[k]
    }
    for name, values in AUTO_UNPLANNED.items():
        if given.get(name) in values:
            raise ValueError(
                f"auto=True cannot plan {name}={given[name]!r} (the layout planner does not model it); "
                f"drop auto or choose another {name}"
            )
    planner: dict[str, Any] = {}
    if "zero_stage" in given:
        planner["zero_stages"] = (given["zero_stage"],)
    if "ac_policy" in given:
        planner["ac_policies"] = (given["ac_policy"],)
    if "schedule" in given:
        planner["schedules"] = (given["schedule"],)
    if given.get("virtual_stages") is not None and given["virtual_stages"] > 1:
        planner["virtual_stages"] = (given["virtual_stages"],)
    device = given.get("offload")
    if device in ("cpu", "nvme"):
        planner["offloads"] = (
            (f"{device}+params",) if given.get("offload_params") else (device, f"{device}+params")
        )
    elif given.get("offload_params"):
        raise ValueError("auto=True with offload_params=True needs offload='cpu' or 'nvme'")
    elif device_type != "cuda":
        # CPU ranks: host memory is device memory, offload saves nothing.
        planner["offloads"] = ("none",)
    elif "offload_path" not in given:  # NVMe needs a drive the run names
        planner["offloads"] = tuple(
            o for o in PlannerOptions().offloads if not o.startswith("nvme")
        )
    sizes = {
        name: given[name]
        for name in ("data", "tensor", "pipeline", "context", "sequence_parallel", "expert")
        if name in given
    }
    if "expert" in given:  # an MoE model's experts split over that many ranks, and no other size
        planner["expert_sizes"] = (given["expert"],)
    if "context_scheme" in given:  # kept for layouts that split sequences (see allowed)
        sizes["context_scheme"] = given["context_scheme"]
    # The run's own savings are counted in every layout; the rest of the kit may be climbed.
    memory: dict[str, Any] = {}
    kit = [] if "loss_chunks" in given else ["loss_chunks"]
    if "loss_chunks" in given:
        memory["loss_chunks"] = given["loss_chunks"]
    kit += ["low_bit"] if optimizer_settable else []
    if given.get("activation_offload"):
        memory["activation_offload"] = True
    if "zero_master_weights" in given:  # priced as the run keeps them (bf16-true, ZeRO 0-2)
        memory["zero_master_weights"] = given["zero_master_weights"]
    elif device_type == "cuda" and not given.get("compile"):
        # CPU ranks: the host is the device, so offloading saves nothing (as offload above);
        # beside compile it is refused (options' _across_groups).
        kit.append("activation_offload")
    memory["memory_kit"] = tuple(kit)
    return Constraints(planner, sizes, given.get("micro_batches"), memory)


def allowed(choice: Choice, fixed: Constraints, accumulate: int) -> bool:
    """``choice`` keeps the fixed sizes and micro-batches, and micro-batches the loader's fixed batch can make."""
    if any(
        getattr(choice, name) != size
        for name, size in fixed.sizes.items()
        if name != "context_scheme" or choice.context > 1  # a scheme is only a split's
    ):
        return False
    if choice.pipeline > 1:
        return accumulate == 1 and fixed.micro_batches in (None, choice.micro_batches)
    return choice.micro_batches == accumulate


def choose(
    module: Any,
    cluster: Cluster,
    plan: Plan,
    *,
    batch_size: Optional[int] = None,
    seq_len: Optional[int] = None,
    accumulate: int = 1,
    precision: str = "32-true",
    device_type: str = "cuda",
    context_sizes: Any = "auto",
    optimizer_settable: bool = False,
    checkpoints: bool = False,
) -> Candidate:
    """The planner's first fitting layout of ``module`` on ``cluster`` that the options of ``plan``
    and the data allow; ``ValueError`` naming why none is left. ``plan``'s ``auto_memory_gb``,
    where given, is the device memory a rank may fill (no reserve kept besides);
    ``context_sizes``: the planner's (``(1,)`` where the data cannot be split by sequence);
    ``optimizer_settable``: the low-bit rung may be climbed (the caller runs ``choice.optimizer``);
    ``checkpoints``: the run saves periodic checkpoints (which low-bit states refuse at ZeRO 1-3)."""
    import torch.distributed as dist

    from lightning_3d.planner.table import nothing_fits

    fixed = constraints(plan, device_type, optimizer_settable)
    # Sequence parallelism's activations are measured in a fake world: not beside a live process group.
    alone = (
        {}
        if fixed.sizes.get("sequence_parallel") or not dist.is_initialized()
        else {"sequence_parallel": False}
    )
    budget = plan.auto.memory_gb
    if budget is not None:
        cluster = replace(cluster, device_memory_gb=budget)
    options = PlannerOptions(
        batch_size=batch_size,
        seq_len=seq_len,
        precision=precision,
        **({"reserve_gb": 0.0} if budget is not None else {}),
        **(CPU_OPTIONS if device_type != "cuda" else {}),
        context_sizes=context_sizes,
        optimizer=model_optimizer(module),
        checkpoints=checkpoints,
        **fixed.planner,
        **fixed.memory,
        **alone,
    )
    _, candidates = plan_candidates(module, cluster, options, name=type(module).__name__)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise ValueError(
            f"auto: {nothing_fits(candidates, cluster, options.reserve_gb, options.offloads)}"
        )
    kept = [c for c in fitting if allowed(c.choice, fixed, accumulate)]
    if not kept:
        asked = ", ".join(
            f"{k}={v}"
            for k, v in {
                **fixed.sizes,
                "micro_batches": fixed.micro_batches,
                "accumulate_grad_batches": accumulate,
            }.items()
            if v is not None
        )
        raise ValueError(
            f"auto: no fitting layout of {cluster.world_size} ranks has {asked}; the planner's first "
            f"choice is {fitting[0].choice.label()}"
        )
    return kept[0]


def model_optimizer(module: Any) -> str:
    """The optimizer ``module`` builds, where its hyperparameters name one the planner knows
    (``LitGPT``, ``HFCausalLM``: ``optimizer=``); else AdamW, the planner's assumption."""
    from lightning_3d.parallel.optimizers import OPTIMIZERS

    hparams = getattr(module, "hparams", None) or {}
    name = hparams.get("optimizer") if isinstance(hparams, Mapping) else None
    return name if name in OPTIMIZERS else "adamw"


def planned(plan: Plan, choice: Choice) -> Plan:
    """``plan`` with the layout of ``choice``, ``auto`` off (every other option kept; a
    ``loss_chunks="auto"`` too, which the run resolves to the count the planner counted)."""
    options = choice.options()
    if plan.loss.chunks == "auto":
        options.pop("loss_chunks", None)
    return plan.updated(**options, auto=False)


@dataclass(frozen=True)
class AutoChoice:
    """The planner's choice for a run: the plan to run and what to say and record about it."""

    plan: Plan  # the chosen layout, auto off (every other option kept)
    figures: Mapping[str, Any]  # planned_figures: for summary.json
    line: str  # describe: the info line, logged once
    optimizer: str = "adamw"  # the optimizer the layout was sized for (the kit may make it 8-bit)


def choose_plan(
    module: Any,
    plan: Plan,
    cluster: Cluster,
    *,
    batch_size: Optional[int],
    seq_len: Optional[int],
    accumulate: int,
    precision: str,
    device_type: str,
    context_sizes: Any = "auto",
    optimizer_settable: bool = False,
    checkpoints: bool = False,
) -> AutoChoice:
    """``auto`` resolved: :func:`choose`'s layout as a plan, with its figures and info line. The
    one resolution of both callers: the strategy's ranks (:func:`resolve_for_strategy`) and the
    Hydra app's launching process (``lightning_3d.app.spec.with_auto``)."""
    best = choose(
        module,
        cluster,
        plan,
        batch_size=batch_size,
        seq_len=seq_len,
        accumulate=accumulate,
        precision=precision,
        device_type=device_type,
        context_sizes=context_sizes,
        optimizer_settable=optimizer_settable,
        checkpoints=checkpoints,
    )
    return AutoChoice(
        planned(plan, best.choice),
        planned_figures(best, cluster),
        describe(best, cluster),
        best.choice.optimizer,
    )


def describe(candidate: Candidate, cluster: Cluster) -> str:
    """The info line: the choice and its predicted figures."""
    c, memory = candidate.choice, candidate.memory
    sched = (
        f"{c.micro_batches} micro-batches ({c.schedule})"
        if c.pipeline > 1
        else f"accumulate_grad_batches={c.micro_batches}"
    )
    split = f"context {c.context} ({c.context_scheme}), " if c.context > 1 else ""
    split += f"expert {c.expert}, " if c.expert > 1 else ""
    kit = f", memory kit: {c.kit_label()}" if c.kit_label() else ""
    return (
        f"auto: dp={c.data} x tp={c.tensor} x pp={c.pipeline}, ZeRO stage {c.zero_stage}, {split}"
        f"{sched}, "
        f"ac={c.ac_policy}, offload={c.offload}{kit}; predicted {memory.total / 1e9:.3g} GB per rank "
        f"(of {cluster.device_memory_gb:.3g} GB), {candidate.tokens_per_s:,.0f} tokens/s "
        f"on {cluster.describe()}"
    )


def planned_figures(candidate: Candidate, cluster: Cluster) -> dict[str, Any]:
    """The choice's predictions as JSON data, for the run's ``summary.json`` (key ``"planned"``,
    next to what the run measured): the layout's options, per-rank memory parts (bytes, the
    largest pipeline stage), step time parts (seconds), tokens/s, MFU and the cluster assumed."""
    c, memory, time = candidate.choice, candidate.memory, candidate.time
    return {
        "layout": {
            **c.options(),
            "micro_batches": c.micro_batches,
            "batch_per_rank": c.batch_per_rank,
        },
        "label": c.label(),
        "optimizer": c.optimizer,
        "memory_bytes": {
            "params": memory.params,
            "grads": memory.grads,
            "optimizer": memory.optimizer,
            "activations": memory.activations,
            "buffers": memory.buffers,
            "total": memory.total,
            "host": memory.host,
            "disk": memory.disk,
        },
        "step_time_s": {
            "compute": time.compute,
            "comm": time.comm,
            "bubble": time.bubble,
            "offload": time.offload,
            "optimizer": time.optimizer,
            "overhead": time.overhead,
            "total": time.total,
        },
        "tokens_per_s": candidate.tokens_per_s,
        "mfu": candidate.mfu,
        "cluster": cluster.as_dict(),
    }


def data_batch(trainer: Any) -> tuple[Optional[int], Optional[int]]:
    """(global batch per loader step, tokens per sample) from the trainer's data module, where it says."""
    datamodule = getattr(trainer, "datamodule", None)
    values = []
    for name in ("batch_size", "block_size"):
        value = getattr(datamodule, name, None)
        if value is None and datamodule is not None:
            value = getattr(datamodule, "hparams", {}).get(name)
        values.append(
            value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
        )
    return values[0], values[1]


def resolve_for_strategy(strategy: Any) -> Plan:
    """The strategy's plan with ``auto`` resolved, once the process group exists
    (``setup_environment``): rank 0 plans, every rank gets its plan (or its ``ValueError``).
    The predictions (:func:`planned_figures`) are left on every rank as ``strategy.planned``,
    which :class:`~lightning_3d.observe.summary.RunSummary` writes into ``summary.json``."""
    import torch.distributed as dist
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    payload: list[Any] = [None]
    if strategy.global_rank == 0:
        try:
            trainer = strategy.lightning_module.trainer
            batch, seq_len = data_batch(trainer)
            accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
            device_type, precision = (
                strategy.root_device.type,
                str(strategy.precision_plugin.precision),
            )
            cluster = found_cluster(
                strategy.num_processes, strategy.num_nodes, device_type, precision
            )
            chosen = choose_plan(
                strategy.lightning_module,
                strategy.plan,
                cluster,
                batch_size=batch * accumulate if batch else None,
                seq_len=seq_len,
                accumulate=accumulate,
                precision=precision,
                device_type=device_type,
            )
            payload = [("ok", chosen)]
        except ValueError as err:
            payload = [("error", str(err))]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = strategy.root_device if strategy.root_device.type == "cuda" else None
        dist.broadcast_object_list(payload, src=0, device=device)
    kind, value = payload[0]
    if kind == "error":
        raise ValueError(value)
    rank_zero_info(value.line)
    strategy.planned = dict(value.figures)
    return value.plan


def record_planned(summary_path: Any, figures: Optional[Mapping[str, Any]]) -> None:
    """Add ``figures`` (:func:`planned_figures`) to a written ``summary.json`` under ``"planned"``
    (the app's launcher, which planned, once its ranks are done); nothing when either is missing."""
    import json
    from pathlib import Path

    path = Path(summary_path)
    if figures is None or not path.is_file():
        return
    summary = json.loads(path.read_text())
    summary["planned"] = dict(figures)
    path.write_text(json.dumps(summary, indent=2))
