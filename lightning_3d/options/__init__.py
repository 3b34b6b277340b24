"""The plan: every option of ``ThreeDStrategy``, its name, default and check, in one place.

A :class:`Plan` is frozen data, one group per concern (layout, tensor parallelism, context
parallelism, pipeline, ZeRO buckets, activation checkpointing, offload, saved-checkpoint format,
process group, non-finite losses). It is validated whole when it is built, in the launching
process, so a bad value fails with a ``ValueError`` naming it before any process, process group
or file exists.

:data:`OPTIONS` is the one table of option names: ``ThreeDStrategy(**options)``, the Hydra
``parallelism`` / ``offload`` schemas (:func:`hydra_schema`) and docs/options.md
(:func:`options_table`) are all made from it, and every default comes from the group's field.

Example::

    >>> plan = Plan.from_options(tensor=2, zero_stage=3, ac_policy="full")
    >>> plan.layout.tensor, plan.pp.micro_batches, plan.ac.policy
    (2, 1, 'full')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import Any, Optional

from lightning_3d.layout import Layout
from lightning_3d.offload.options import OffloadOptions, offload_options
from lightning_3d.parallel.activation_checkpoint import ActivationCheckpointOptions, ac_options
from lightning_3d.parallel.chunked_loss import ChunkedLossOptions
from lightning_3d.parallel.compile import CompileOptions
from lightning_3d.parallel.context import ContextParallelOptions, scheme_problems
from lightning_3d.parallel.fsdp import Zero3Options
from lightning_3d.parallel.pipeline import PipelineOptions, pipeline_options
from lightning_3d.parallel.plans import TensorParallelOptions
from lightning_3d.parallel.replicas import ReplicaOptions
from lightning_3d.parallel.zero import ZeroOptions
from lightning_3d.runtime.nonfinite import NonFiniteOptions

CHECKPOINT_FORMATS = ("consolidated", "sharded")
# Values of options the layout planner (lightning_3d.planner) does not model: refused with auto=True.
AUTO_UNPLANNED = {"ac_policy": ("every_n",)}


@dataclass(frozen=True)
class CheckpointOptions:
    """The ``checkpoint`` group (the files are written by ``lightning_3d.checkpoint``, a floor
    above the option table, so the group lives here)."""

    format: str = "consolidated"
    """``consolidated`` (one file, rank 0 writes) or ``sharded`` (a DCP directory, every rank
    writes) (option ``checkpoint_format``)."""

    def problems(self) -> list[str]:
        """What is wrong with these values, in the option names users give (empty: nothing)."""
        if self.format in CHECKPOINT_FORMATS:
            return []
        return [f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {self.format!r}"]


@dataclass(frozen=True)
class DistOptions:
    """The ``dist`` group: the process group the strategy creates."""

    backend: Optional[str] = None
    """``gloo``, ``nccl``, ... (option ``process_group_backend``); ``None``: nccl on GPUs, gloo on
    CPUs."""
    timeout_s: float = 600.0
    """Seconds a collective may wait before it fails: a peer stopped or stalled (option
    ``timeout_s``; Lightning's ``timeout=timedelta(...)`` is taken too)."""

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def problems(self) -> list[str]:
        """What is wrong with these values, in the option names users give (empty: nothing)."""
        if _positive(self.timeout_s):
            return []
        return [f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}"]


@dataclass(frozen=True)
class AutoOptions:
    """The ``auto`` group: the layout planner's choice at start (``strategy/auto.py``)."""

    enabled: bool = False
    """The planner chooses the layout when the world is known (option ``auto``)."""
    memory_gb: Optional[float] = None
    """Device memory in GB a rank may fill (option ``auto_memory_gb``); ``None``: what the device
    has."""

    def problems(self) -> list[str]:
        """What is wrong with these values alone, in the option names users give (the options
        the planner does not model are checked against the whole plan)."""
        problems = []
        if not isinstance(self.enabled, bool):
            problems.append(f"auto={self.enabled!r} must be True or False")
        if self.memory_gb is not None and not _positive(self.memory_gb):
            problems.append(
                f"auto_memory_gb={self.memory_gb!r} must be a positive number of GB or None"
            )
        return problems


@dataclass(frozen=True)
class Option:
    """One flat option: its name in ``ThreeDStrategy(...)``, where it lives in the plan, its
    Hydra group and key, and a line of documentation."""

    name: str
    group: str  # attribute of Plan
    attr: str  # field of that group
    doc: str
    hydra_group: Optional[str] = "parallelism"
    hydra_key: Optional[str] = None  # default: ``name``
    hydra_type: Any = None  # default: the default's type

    @property
    def default(self) -> Any:
        return _GROUP_DEFAULTS[self.group][self.attr]

    @property
    def key(self) -> str:
        return self.hydra_key or self.name


_GROUP_DEFAULTS = {
    group: {f.name: f.default for f in fields(cls)}
    for group, cls in (
        ("layout", Layout),
        ("tp", TensorParallelOptions),
        ("cp", ContextParallelOptions),
        ("pp", PipelineOptions),
        ("zero", ZeroOptions),
        ("fsdp", Zero3Options),
        ("ac", ActivationCheckpointOptions),
        ("offload", OffloadOptions),
        ("checkpoint", CheckpointOptions),
        ("compile", CompileOptions),
        ("dist", DistOptions),
        ("nonfinite", NonFiniteOptions),
        ("replicas", ReplicaOptions),
        ("auto", AutoOptions),
        ("loss", ChunkedLossOptions),
    )
}

OPTIONS: tuple[Option, ...] = (
    Option(
        "data",
        "layout",
        "data",
        "data-parallel size, or `auto` = world size / (tensor × pipeline × context)",
        hydra_type=Any,
    ),
    Option("tensor", "layout", "tensor", "tensor-parallel size (Megatron-style layer splitting)"),
    Option("pipeline", "layout", "pipeline", "pipeline-parallel size (layers split into stages)"),
    Option(
        "context",
        "layout",
        "context",
        "context-parallel size: each sequence split over this many ranks "
        "(docs/context-parallelism.md)",
    ),
    Option(
        "expert",
        "layout",
        "expert",
        "expert-parallel size, carved from the data axis: each group of this many data ranks "
        "splits a mixture-of-experts model's experts (docs/parallelism.md)",
    ),
    Option(
        "context_scheme",
        "cp",
        "scheme",
        "with context > 1: attention across the ranks by `ring` (k/v passed round) or "
        "`alltoall` (Ulysses: heads exchanged for sequence)",
    ),
    Option(
        "zero_stage",
        "layout",
        "zero_stage",
        "0 replicate; 1 shard optimizer state; 2 + gradients; 3 + parameters (FSDP2)",
    ),
    Option(
        "tp_plan",
        "tp",
        "plan",
        "explicit tensor-parallel plan `{module pattern: style}`; default: "
        "recognise the architecture",
        hydra_type=Any,
    ),
    Option(
        "sequence_parallel",
        "tp",
        "sequence_parallel",
        "with tensor > 1: also shard norms and the residual stream along the sequence",
    ),
    Option(
        "micro_batches",
        "pp",
        "micro_batches",
        "with pipeline > 1: micro-batches per batch (default: pipeline)",
        hydra_type=Optional[int],
    ),
    Option("schedule", "pp", "schedule", "`gpipe`, `1f1b`, `interleaved_1f1b`, `zero_bubble`"),
    Option(
        "virtual_stages",
        "pp",
        "virtual_stages",
        "stages per rank for the interleaved schedules (default 2; 1 otherwise)",
        hydra_type=Optional[int],
    ),
    Option(
        "split",
        "pp",
        "split",
        "`uniform` (by block count), `params` (by parameter count), or the block "
        "names that start stages 1, 2, ...",
        hydra_type=Any,
    ),
    Option(
        "bucket_size_mb",
        "zero",
        "bucket_size_mb",
        "largest gradient bucket (MiB) for ZeRO stages 0–2; a model of fewer than 4 such "
        "buckets gets 4 (none under 1 MiB), so the reduction left after backward is short",
    ),
    Option(
        "zero_master_weights",
        "zero",
        "master_weights",
        "ZeRO 0–2 with a bf16 module (`precision='bf16-true'`): each rank's optimizer steps fp32 "
        "masters of its slice only (2 + 2 + 12/N bytes a parameter at stage 2); False: bf16 steps",
    ),
    Option(
        "zero_reduce_dtype",
        "zero",
        "reduce_dtype",
        "with fp32 masters: gradients accumulated and reduced in `bf16` (2 bytes a parameter) or "
        "`fp32` (Megatron's choice: no bf16 rounding of the sums, 2 bytes more at stages 0–1)",
    ),
    Option(
        "zero2_defer_reduce",
        "zero",
        "defer_reduce",
        "ZeRO-2 with gradient accumulation: hold full-size gradients over the micro-batches and "
        "reduce-scatter once a step (one step's bytes, stage 1's gradient memory)",
    ),
    Option(
        "zero3_keep_gathered",
        "fsdp",
        "keep_gathered",
        "ZeRO-3 with gradient accumulation: weights stay gathered and gradients unsharded "
        "through the step, one gather and one reduce-scatter a step instead of per micro-batch "
        "(the stage's whole weights and gradients held meanwhile)",
    ),
    Option(
        "ac_policy",
        "ac",
        "policy",
        "activation checkpointing: `none`, `full`, `every_n`, `selective`",
    ),
    Option("ac_every_n", "ac", "every_n", "with `every_n`: blocks 0, n, 2n, ... recompute"),
    Option(
        "activation_offload",
        "ac",
        "offload",
        "each block's saved activations (under `full`: its checkpointed inputs) wait in host "
        "memory between forward and backward",
    ),
    Option(
        "offload",
        "offload",
        "device",
        "where Adam state and fp32 master weights live: `none`, `cpu`, `nvme`",
        hydra_group="offload",
        hydra_key="device",
    ),
    Option(
        "offload_path",
        "offload",
        "path",
        "nvme: the directory that holds the state",
        hydra_group="offload",
        hydra_key="path",
        hydra_type=Optional[str],
    ),
    Option(
        "offload_chunk_mb",
        "offload",
        "chunk_mb",
        "nvme: state streamed through RAM in chunks of this size",
        hydra_group="offload",
        hydra_key="chunk_mb",
    ),
    Option(
        "offload_params",
        "offload",
        "params",
        "zero_stage 3 with an offload device: sharded parameters and gradients in CPU memory too",
        hydra_group="offload",
        hydra_key="params",
    ),
    Option(
        "offload_delay_update",
        "offload",
        "delay_update",
        "ZeRO-Offload's one-step delayed parameter update: the CPU step overlaps the next forward and backward, "
        "which see weights one step old (changes the numerics)",
        hydra_group="offload",
        hydra_key="delay_update",
    ),
    Option(
        "offload_direct_io",
        "offload",
        "direct_io",
        "nvme: `O_DIRECT` reads and writes, bypassing the page cache; `null` where the file system allows, "
        "`true` required, `false` buffered (faster while the state fits in spare RAM; same numbers)",
        hydra_group="offload",
        hydra_key="direct_io",
        hydra_type=Optional[bool],
    ),
    Option(
        "offload_overlap",
        "offload",
        "overlap",
        "parameters on an accelerator: gradients come down and weights go up on side streams while the CPU "
        "steps; `false` copies in turn with the step (same numbers)",
        hydra_group="offload",
        hydra_key="overlap",
    ),
    Option(
        "checkpoint_format",
        "checkpoint",
        "format",
        "saved checkpoints: `consolidated` (one file, rank 0 writes) or `sharded` (a directory, every rank writes)",
    ),
    Option(
        "compile",
        "compile",
        "enabled",
        "`torch.compile` each transformer block (after activation checkpointing, before FSDP2)",
    ),
    Option(
        "compile_backend",
        "compile",
        "backend",
        "the `torch.compile` backend (`inductor`, `aot_eager`, ...)",
    ),
    Option(
        "process_group_backend",
        "dist",
        "backend",
        "`gloo`, `nccl`, ...; default follows the device",
        hydra_type=Optional[str],
    ),
    Option("timeout_s", "dist", "timeout_s", "seconds a collective may wait before it fails"),
    Option(
        "nonfinite",
        "nonfinite",
        "action",
        "a NaN/inf loss, gradient or gradient norm: `stop` the run before "
        "the step applies it, or `skip` the step (gradients dropped on every rank)",
    ),
    Option(
        "max_nonfinite_skips",
        "nonfinite",
        "max_skips",
        "with `nonfinite=skip`: the run stops once more steps than this were skipped",
    ),
    Option(
        "replica_check",
        "replicas",
        "check",
        "when every replica of a parameter (tensor ranks, a tied weight's "
        "copies on pipeline stages) must have the same gradient and update: `first` step, `off`, or every n "
        "steps; a mismatch stops the run naming the parameter",
        hydra_type=Any,
    ),
    Option(
        "auto",
        "auto",
        "enabled",
        "the layout planner's first choice for the world found at start (sizes, context, "
        "ZeRO stage, micro-batches, AC, offload); options set away from their defaults constrain it",
    ),
    Option(
        "auto_memory_gb",
        "auto",
        "memory_gb",
        "with `auto`: the device memory in GB a rank's layout may fill (`None`: the device's own, "
        "less the planner's 1 GB reserve)",
        hydra_type=Any,
    ),
    Option(
        "loss_chunks",
        "loss",
        "chunks",
        "head and cross-entropy over this many chunks of tokens, no whole logits tensor "
        "(LitGPT, HFCausalLM; vocabulary-parallel under tensor > 1); 1: whole logits; `auto`: "
        "vocabulary / width chunks (this rank's vocabulary under tensor > 1) where the chunked "
        "loss is built, else 1 (docs/memory.md)",
        hydra_type=Any,
    ),
)
OPTION_NAMES: tuple[str, ...] = tuple(option.name for option in OPTIONS)


@dataclass(frozen=True)
class Plan:
    """Everything ``ThreeDStrategy`` does to a model, as data (see :data:`OPTIONS`)."""

    layout: Layout = field(default_factory=Layout)
    tp: TensorParallelOptions = field(default_factory=TensorParallelOptions)
    cp: ContextParallelOptions = field(default_factory=ContextParallelOptions)
    pp: PipelineOptions = field(default_factory=PipelineOptions)
    zero: ZeroOptions = field(default_factory=ZeroOptions)
    fsdp: Zero3Options = field(default_factory=Zero3Options)
    ac: ActivationCheckpointOptions = field(default_factory=ActivationCheckpointOptions)
    offload: OffloadOptions = field(default_factory=OffloadOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    compile: CompileOptions = field(default_factory=CompileOptions)
    dist: DistOptions = field(default_factory=DistOptions)
    nonfinite: NonFiniteOptions = field(default_factory=NonFiniteOptions)
    replicas: ReplicaOptions = field(default_factory=ReplicaOptions)
    auto: AutoOptions = field(default_factory=AutoOptions)
    loss: ChunkedLossOptions = field(default_factory=ChunkedLossOptions)
    # The flat options this plan was built from (defaults such as micro_batches=None still
    # unresolved), so that updated(pipeline=4) re-derives them.
    given: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_options(cls, **options: Any) -> Plan:
        """A checked plan from flat option names; ``ValueError`` for unknown names or bad values."""
        return cls().updated(**options)

    def updated(self, **options: Any) -> Plan:
        """A checked copy with some flat options changed."""
        # A plan built here keeps the options it came from; one built by hand holds them as fields.
        options = {**(self.given or self.options()), **_renamed(options)}
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise ValueError(
                f"unknown ThreeDStrategy option(s) {unknown}; valid options are {list(OPTION_NAMES)}"
            )
        groups: dict[str, dict[str, Any]] = {}
        for option in OPTIONS:
            if option.name in options:
                groups.setdefault(option.group, {})[option.attr] = options[option.name]
        changed = {
            name: replace(getattr(Plan(), name), **values) for name, values in groups.items()
        }
        return _checked(replace(Plan(), **changed, given=options))

    def options(self) -> dict[str, Any]:
        """The plan as flat options (``Plan.from_options(**plan.options()) == plan``)."""
        return {
            option.name: getattr(getattr(self, option.group), option.attr) for option in OPTIONS
        }

    def resolved(self, world_size: int) -> Plan:
        """With the data-parallel size filled in; ``ValueError`` when the axes do not tile the world."""
        return replace(self, layout=self.layout.resolve(world_size))


def _renamed(options: dict[str, Any]) -> dict[str, Any]:
    options = dict(options)
    if "timeout" in options:  # Lightning's strategies take a timedelta named timeout
        if "timeout_s" in options:
            raise ValueError("give timeout_s or timeout, not both")
        timeout = options.pop("timeout")
        options["timeout_s"] = (
            timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        )
    return options


def _checked(plan: Plan) -> Plan:
    """Every group checked, and the pipeline's defaults (micro-batches, virtual stages) filled in;
    one ``ValueError`` naming every problem found, not only the first."""
    layout, problems = plan.layout, []
    # The groups whose check also fills in defaults (a dict of the checked values).
    pp = _collected(
        problems,
        pipeline_options,
        layout.pipeline,
        plan.pp.micro_batches,
        plan.pp.schedule,
        plan.pp.virtual_stages,
        plan.pp.split,
    )
    ac = _collected(problems, ac_options, plan.ac.policy, plan.ac.every_n, plan.ac.offload)
    offload = plan.offload
    checked = _collected(
        problems,
        offload_options,
        offload.device,
        offload.path,
        offload.chunk_mb,
        offload.params,
        layout.zero_stage,
        offload.delay_update,
        offload.direct_io,
        offload.overlap,
    )
    # Each group's own values, in the order of the plan's fields, then the rules that join a
    # group to the layout.
    for group in (plan.tp, plan.zero, plan.fsdp, plan.checkpoint, plan.compile, plan.dist):
        problems += group.problems()
    problems += scheme_problems(plan.cp.scheme)
    problems += plan.nonfinite.problems()
    problems += plan.replicas.problems()
    problems += plan.auto.problems()
    problems += plan.loss.problems(plan.layout.tensor)
    problems += _across_groups(plan)
    if problems:
        raise ValueError("; ".join(problems))
    tp = replace(plan.tp, plan=dict(plan.tp.plan)) if plan.tp.plan else replace(plan.tp, plan=None)
    return replace(
        plan,
        tp=tp,
        pp=PipelineOptions(**pp),
        ac=ActivationCheckpointOptions(**ac),
        offload=replace(offload, path=checked["path"]),
    )


def _collected(problems: list[str], check: Callable[..., dict], *args: Any) -> dict:
    """``check(*args)``'s values; its ``ValueError`` appended to ``problems`` instead (then an
    empty dict: the plan is refused below, so the values are never used)."""
    try:
        return check(*args)
    except ValueError as err:
        problems.append(str(err))
        return {}


def _across_groups(plan: Plan) -> list[str]:
    """The rules that join an option group to the layout or to another group."""
    layout, problems = plan.layout, []
    if plan.tp.sequence_parallel is True and layout.tensor == 1:
        # It shards activations over the tensor group: with one tensor rank it would do nothing.
        problems.append(
            "sequence_parallel=True needs tensor > 1 (with tensor=1 it would be ignored)"
        )
    if plan.compile.enabled is True and plan.ac.offload is True:
        # The offload hooks are Python callables around the block's forward: Dynamo would trace
        # them into the graph (torch.compile has its own activation offloading).
        problems.append("activation_offload=True with compile=True is not supported")
    if plan.compile.enabled is True and layout.tensor > 1 and layout.zero_stage < 3:
        # Dynamo (torch 2.13) fails to trace tensor-parallel DTensors whose local tensors are
        # views of the ZeRO 0-2 flat buckets; FSDP2's shards trace fine.
        problems.append(
            f"compile=True with tensor={layout.tensor} needs zero_stage=3, got "
            f"zero_stage={layout.zero_stage}"
        )
    if layout.expert > 1 and (plan.offload.device != "none" or plan.offload.params is True):
        # The expert weights are stepped outside the ZeRO engines, which the offload wraps.
        problems.append(
            f"expert={layout.expert} with offload={plan.offload.device!r} / offload_params="
            f"{plan.offload.params} is not supported yet"
        )
    if plan.fsdp.keep_gathered is True:
        # FSDP2's accumulation switches: the strategy's, without a pipeline (torch's stages
        # drive them there), and on device-resident weights.
        if layout.zero_stage != 3 or layout.pipeline > 1 or plan.offload.params is True:
            problems.append(
                f"zero3_keep_gathered=True needs zero_stage=3, pipeline=1 and no offload_params, "
                f"got zero_stage={layout.zero_stage}, pipeline={layout.pipeline}, "
                f"offload_params={plan.offload.params}"
            )
    if plan.auto.enabled is True:
        # Values the planner does not model: refused here, before any process starts.
        for option in OPTIONS:
            value = getattr(getattr(plan, option.group), option.attr)
            if value in AUTO_UNPLANNED.get(option.name, ()):
                problems.append(
                    f"auto=True cannot plan {option.name}={value!r} (the layout planner does not "
                    f"model it); drop auto or choose another {option.name}"
                )
    return problems


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def hydra_schema(group: str) -> type:
    """The structured-config dataclass of a Hydra group (``"parallelism"`` or ``"offload"``):
    every option of that group with its default."""
    specs = []
    for option in OPTIONS:
        if option.hydra_group != group:
            continue
        kind = option.hydra_type if option.hydra_type is not None else type(option.default)
        default = option.default
        specs.append(
            (
                option.key,
                kind,
                field(default_factory=lambda d=default: d) if _mutable(default) else default,
            )
        )
    return dataclasses.make_dataclass(f"{group.capitalize()}Config", specs, frozen=False)


def _mutable(value: Any) -> bool:
    return isinstance(value, (list, dict, set))


def from_hydra(parallelism: Mapping[str, Any], offload: Optional[Mapping[str, Any]] = None) -> Plan:
    """A plan from the Hydra ``parallelism`` and ``offload`` groups (plain mappings)."""
    options = dict(parallelism)
    by_key = {option.key: option.name for option in OPTIONS if option.hydra_group == "offload"}
    for key, value in (offload or {}).items():
        if key not in by_key:
            raise ValueError(f"unknown offload option {key!r}; valid options are {list(by_key)}")
        options[by_key[key]] = value
    return Plan.from_options(**options)


def hydra_overrides(plan: Plan, names: Sequence[str]) -> dict[str, Any]:
    """The options ``names`` of ``plan`` keyed as Hydra overrides spell them
    (``"<group>.<key>"``, e.g. ``offload_params`` -> ``offload.params``); ``ValueError`` for a
    name that has no Hydra key."""
    by_name = {option.name: option for option in OPTIONS}
    values = plan.options()
    unknown = [name for name in names if name not in by_name or not by_name[name].hydra_group]
    if unknown:
        raise ValueError(f"{unknown}: not options of a Hydra group")
    return {f"{by_name[n].hydra_group}.{by_name[n].key}": values[n] for n in names}


def hydra_group_values(plan: Plan, group: str) -> dict[str, Any]:
    """The Hydra group ``group`` (``"parallelism"`` or ``"offload"``) of ``plan`` as it was given
    (keys and unresolved values, e.g. ``path: None``): the inverse of :func:`from_hydra`."""
    given = plan.given or plan.options()
    return {
        option.key: given.get(option.name, option.default)
        for option in OPTIONS
        if option.hydra_group == group
    }


def options_table() -> str:
    """The option table of docs/options.md (rendered by tools.options_page)."""
    rows = ["| option | default | Hydra key | meaning |", "|---|---|---|---|"]
    for option in OPTIONS:
        hydra = f"`{option.hydra_group}.{option.key}`" if option.hydra_group else "—"
        rows.append(f"| `{option.name}` | `{option.default!r}` | {hydra} | {option.doc} |")
    return "\n".join(rows)
