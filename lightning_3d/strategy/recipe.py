"""The recipe: a module and a :class:`~lightning_3d.options.Plan` in, this rank's part of the
parallel model out, in one place and in this order.

1. **Names and ties**, while the model is whole: checkpoints are keyed by the names one process
   has, and tied weights (embedding = head) must stay one parameter (or one copy per pipeline
   stage with summed gradients) through every rewrite below.
2. **Pipeline split**: keep only this rank's stages, so nothing else is ever sharded, wrapped or
   handed to the optimizer.
3. **Tensor parallelism** on the ``tp`` axis: weights become tp-sharded DTensors; ties re-made.
4. **Activation checkpointing** per block: after the split (placeholders are skipped) and after
   TP (its hooks run inside the recomputed region); before FSDP2, whose per-block gather and
   reshard hooks then wrap the checkpointed forward. Then, optionally, ``torch.compile`` of each
   block (it traces the TP layers and the checkpointed region; FSDP2's hooks stay outside).
   With ``context`` > 1, **context parallelism**: attention layers run across the ``cp`` ranks.
5. **ZeRO-3**: FSDP2 on the ``dp`` axis (``dp`` × ``cp`` with context parallelism: those ranks
   hold the same layers), with precision and offload policies.
   Then, for a module built on ``meta`` (``LitGPT(deferred_init=True)``), **materialisation**:
   each parameter filled once in its final dtype, device and shard (``parallel/materialize.py``).
6. **Pipeline runtime**: the schedule over this rank's stages.
7. At optimizer setup (:func:`attach_optimizers`): **ZeRO 0-2** flat-bucket engines, then
   **offload** of the (already sharded) optimizer state.

:func:`~lightning_3d.parallel.model_check.check` runs the shape-only part of 1-3 on a ``meta``
model in the launching process, so a bad plan fails before any rank starts. :class:`Parallelized`
is the public record of what the
recipe made, read by the strategy, the checkpoint hooks and the run summary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

from lightning_3d.adapters.qlora import check_qlora_plan
from lightning_3d.adapters.tensor import adapter_tensor_plan
from lightning_3d.layout import MeshAxis, shard_mesh
from lightning_3d.offload import OffloadedAdam
from lightning_3d.options import Plan
from lightning_3d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_3d.parallel.compile import compile_blocks
from lightning_3d.parallel.foreach import step_shards_together
from lightning_3d.parallel.fsdp import apply_zero3, fsdp_policies
from lightning_3d.parallel.materialize import has_meta, materialize
from lightning_3d.parallel.model_check import pipeline_spec
from lightning_3d.parallel.pipeline_runtime import PipelineRuntime
from lightning_3d.parallel.plans import build_plan
from lightning_3d.parallel.replicas import broadcast_start, tensor_replicas
from lightning_3d.parallel.stages import split_stages, tied_holders
from lightning_3d.parallel.tensor import resolve_plan
from lightning_3d.parallel.tied import (
    TiedGroups,
    check_tied_styles,
    find_tied,
    param_names,
    record_aliases,
    retie,
)
from lightning_3d.parallel.zero import ZeroDataParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer

    from lightning_3d.observe.telemetry import Telemetry


@dataclass(eq=False)
class Parallelized:
    """A module after the recipe, on this rank."""

    module: nn.Module
    mesh: DeviceMesh
    full_names: list[str]  # state_dict names as one process has them (checkpoints use these)
    full_param_names: list[str]  # parameter names as one process has them
    stages: Optional[list] = None  # this rank's pipeline stages (None without a pipeline)
    runtime: Optional[PipelineRuntime] = None  # the pipeline schedule runner
    tied: Optional[TiedGroups] = None  # tied weights with a copy on several pipeline ranks
    engines: list[ZeroDataParallel] = field(default_factory=list)  # ZeRO 0-2, one per optimizer
    tp_plan: dict = field(
        default_factory=dict
    )  # module name -> the style tensor parallelism gave it
    _bound: dict[int, ZeroDataParallel] = field(default_factory=dict)  # id(optimizer) -> its engine

    @property
    def pp_group(self) -> Any:
        """The pipeline process group when stages hold different parameters, else ``None``."""
        pp = self.mesh.get_group(MeshAxis.PIPELINE.value)  # no mesh slicing: called at every clip
        return pp if pp.size() > 1 else None

    def bind(self, optimizer: Optimizer, engine: ZeroDataParallel) -> None:
        """Record that ``engine`` serves ``optimizer`` (the user's, or a wrapper around it)."""
        if engine not in self.engines:
            self.engines.append(engine)
        self._bound[id(optimizer)] = engine

    def engine_for(self, optimizer: Optimizer) -> Optional[ZeroDataParallel]:
        """The ZeRO engine stepping ``optimizer`` (or the one a ``LightningOptimizer`` wraps), if any."""
        raw = getattr(optimizer, "_optimizer", optimizer)
        return self._bound.get(id(raw), self._bound.get(id(optimizer)))

    def clear_engines(self) -> None:
        for engine in self.engines:
            engine.detach()
        self.engines, self._bound = [], {}

    def tied_copies(self) -> list[tuple[Any, Any, bool]]:
        """``(parameter, group, is_first_holder)`` for this rank's copies of tied weights that
        other pipeline ranks hold too."""
        return self.tied.local(self.module) if self.tied else []

    def norm_duplicates(self) -> set[int]:
        """Optimizer parameters whose gradient another pipeline rank counts in the global norm
        already (a tied weight's copy on any holder but the first)."""
        out = set()
        for p, _, first in self.tied_copies():
            if not first:
                engine = next((e for e in self.engines if e.slice_of(p) is not None), None)
                out.add(id(engine.slice_of(p) if engine is not None else p))
        return out

    def replica_gradients(self, params: list[Tensor]) -> list[tuple[str, Any, list]]:
        """For :class:`~lightning_3d.parallel.replicas.ReplicaCheck`: the gradients of the
        optimizer's ``params`` (a ZeRO slice is named by its first and last parameter) that
        tensor ranks replicate, and of tied copies FSDP2 holds (whole gradients on each stage)."""
        names = param_names(self.module)
        for engine in self.engines:
            for owned in engine.owned_slices():
                members = [names.get(id(p), "?") for p in owned.params]
                names[id(owned.param)] = f"ZeRO slice of {members[0]} ... {members[-1]}"
        groups = []
        if self.mesh.get_group(MeshAxis.TENSOR.value).size() > 1:
            named = [
                (names.get(id(p), f"<parameter {i}>"), p, p.grad) for i, p in enumerate(params)
            ]
            groups += tensor_replicas(named, self.mesh.get_group(MeshAxis.TENSOR.value))
        if not self.engines:  # ZeRO 0-2 engines hold a tie's gradient in their buckets: values tell
            groups += [
                ("pipeline stages holding the tie", group, [(names[id(p)], p.grad)])
                for p, group, _ in self.tied_copies()
            ]
        return groups

    def replica_values(self) -> list[tuple[str, Any, list]]:
        """For :class:`~lightning_3d.parallel.replicas.ReplicaCheck`: every parameter tensor
        ranks replicate, and every tied copy over the pipeline stages holding it."""
        names = param_names(self.module)
        groups = []
        if self.mesh.get_group(MeshAxis.TENSOR.value).size() > 1:
            named = [(names[id(p)], p, p) for p in self.module.parameters()]
            groups += tensor_replicas(named, self.mesh.get_group(MeshAxis.TENSOR.value))
        groups += [
            ("pipeline stages holding the tie", group, [(names[id(p)], p)])
            for p, group, _ in self.tied_copies()
        ]
        return groups

    def count_parameters(self) -> int:
        """Parameters of the whole model (a DTensor counts its global size; pipeline stages add
        up; a tied weight once). A collective under a pipeline."""
        import torch.distributed as dist

        copies = sum(
            p.numel() for p, _, first in self.tied_copies() if not first
        )  # counted on another stage
        count = sum(p.numel() for p in self.module.parameters()) - copies
        if self.pp_group is None:
            return count
        # On the mesh's device: an NCCL group takes no host tensor.
        total = torch.tensor(count, dtype=torch.int64, device=torch.device(self.mesh.device_type))
        dist.all_reduce(total, group=self.pp_group)
        return int(total)


def parallelize(
    module: nn.Module,
    mesh: DeviceMesh,
    plan: Plan,
    *,
    device: torch.device,
    precision: str = "32-true",
    accumulation: Callable[[], int] = lambda: 1,
    scale_loss: Optional[Callable] = None,
    telemetry: Optional[Telemetry] = None,
    step: Callable[[str], None] = lambda name: None,
    objective: Optional[Any] = None,
) -> Parallelized:
    """Rewrite ``module`` in place into this rank's part of ``plan`` on ``mesh``; returns the
    record of what was made. ``step(name)`` is told each step as it starts (for error reports)."""
    from torch.distributed.tensor.parallel import parallelize_module

    layout = plan.layout
    data = mesh.get_group(MeshAxis.DATA.value).size()
    check_qlora_plan(module, plan, data)  # what an NF4 base (adapter method="qlora") cannot take
    made = Parallelized(
        module, mesh, list(module.state_dict()), [n for n, _ in module.named_parameters()]
    )
    ties = find_tied(module)
    record_aliases(module, ties)
    if layout.tensor > 1:  # recognise the architecture while the model is still whole
        styles = build_plan(module, plan.tp.plan, plan.tp.sequence_parallel)
        styles = adapter_tensor_plan(module, styles)  # LoRA adapters split beside their base
    step("the pipeline split")
    spec = None
    if layout.pipeline > 1:
        spec, pp_mesh = pipeline_spec(module), mesh[MeshAxis.PIPELINE.value]
        virtual, split = plan.pp.virtual_stages, plan.pp.split
        made.tied = TiedGroups(mesh, tied_holders(module, spec, pp_mesh.size(), virtual, split))
        shards = (
            layout.tensor if plan.tp.sequence_parallel else 1
        )  # a stage's input: this share of the sequence
        made.stages = split_stages(
            module, spec, pp_mesh.get_local_rank(), pp_mesh.size(), virtual, split, shards
        )
    if not has_meta(module) and (
        layout.tensor > 1 or layout.zero_stage == 3
    ):  # ZeRO 0-2: the engine's buckets
        step("the first rank's initial weights")
        # ZeRO 0-2's buckets broadcast over dp themselves: here only what they do not cover.
        groups = [mesh[MeshAxis.TENSOR.value].get_group()]
        groups += [shard_mesh(mesh).get_group()] if layout.zero_stage == 3 else []
        broadcast_start(module, groups)
    if not has_meta(module) and layout.zero_stage < 3:
        # A frozen weight (a LoRA base) is in no ZeRO 0-2 bucket: rank 0's, broadcast over dp here.
        broadcast_start(module, [shard_mesh(mesh).get_group()], frozen_only=True)
    step("tensor parallelism")
    if layout.tensor > 1:
        # Under a pipeline, patterns for other stages' modules (the head, say) match nothing here.
        tp_mesh = mesh[MeshAxis.TENSOR.value]
        resolved = resolve_plan(module, styles, tp_mesh.size(), spec is None)
        check_tied_styles(module, resolved, ties)
        parallelize_module(module, tp_mesh, resolved)
        made.tp_plan = resolved
        retie(module, ties)  # each module got its own sharded copy: make them one again
        if telemetry is not None:
            _publish_logits_sizes(module, resolved, telemetry)
    if layout.context > 1:
        step("context parallelism")
        # Attention across the cp ranks, each holding its tokens of every sequence (the strategy
        # splits the batches); only attributes of the attention layers change, so any order works.
        from lightning_3d.parallel.context.apply import apply_context_parallel

        apply_context_parallel(module, mesh.get_group(MeshAxis.CONTEXT.value), plan.cp.scheme)
    step("activation checkpointing")
    apply_activation_checkpointing(module, plan.ac.policy, plan.ac.every_n)
    if plan.compile.enabled:
        step("torch.compile")
        compiled = compile_blocks(module, plan.compile.backend)
        if telemetry is not None:
            telemetry.publish("compiled", blocks=compiled, backend=plan.compile.backend)
    step("ZeRO-3 (FSDP2) sharding")
    if layout.zero_stage == 3:
        policies = fsdp_policies(precision, plan.offload.params, device.type)
        apply_zero3(module, shard_mesh(mesh), roots=made.stages, **policies)
    step("materialising the weights")
    # Built on meta: each parameter filled once, in its final dtype, place and shard. Onto the
    # meta device (the planner's validate=true) only shapes are wanted: nothing to fill.
    if has_meta(module) and device.type != "meta":
        offloaded = (
            layout.zero_stage == 3 and plan.offload.params
        )  # FSDP2 keeps those shards in CPU memory
        materialize(module, torch.device("cpu") if offloaded else device)
    step("the pipeline schedule")
    if spec is not None:
        made.runtime = PipelineRuntime(
            made.stages,
            spec,
            mesh[MeshAxis.PIPELINE.value],
            plan.pp,
            device,
            mesh[MeshAxis.TENSOR.value],
            accumulation=accumulation,
            scale_loss=scale_loss,
            telemetry=telemetry,
            objective=objective,
        )
    return made


def _publish_logits_sizes(module: nn.Module, resolved: dict, telemetry: Telemetry) -> None:
    """A ``"logits"`` event per forward of the vocab-parallel head (local and full bytes)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    def publish(head: nn.Module, inputs: Any, output: Any) -> None:
        if isinstance(output, DTensor):
            telemetry.publish(
                "logits",
                local_bytes=output.to_local().numel() * output.element_size(),
                dense_bytes=output.numel() * output.element_size(),
            )

    for name, style in resolved.items():
        if (
            isinstance(style, ColwiseParallel) and not style.use_local_output
        ):  # the loss-parallel head
            module.get_submodule(name).register_forward_hook(publish)


def attach_optimizers(
    parallelized: Parallelized, optimizers: list[Optimizer], plan: Plan
) -> list[Optimizer]:
    """Step 7 of the recipe, once the optimizers exist: ZeRO 0-2 engines rewrite them to step
    their own slices (ZeRO-3's FSDP2 shards need none; both step with ``foreach``), then an
    offload device wraps the sharded optimizers in :class:`~lightning_3d.offload.OffloadedAdam`
    (only this rank's shard of the state moves). Returns the optimizers Lightning should step
    (the wrappers share the param groups, so LR schedulers built on the user's optimizers keep
    steering them)."""
    parallelized.clear_engines()
    if plan.layout.zero_stage < 3:
        mesh = shard_mesh(parallelized.mesh, tensor=True)
        tied = {id(p): group for p, group, _ in parallelized.tied_copies()}
        for optimizer in optimizers:
            engine = ZeroDataParallel(
                mesh, plan.layout.zero_stage, bucket_numel=_bucket_numel(optimizer, plan)
            )
            engine.attach(optimizer, tied=tied)
            parallelized.bind(optimizer, engine)
    if plan.offload.device == "none":
        for optimizer in optimizers:  # ZeRO 1-2's slices and ZeRO-3's shards are DTensors
            step_shards_together(optimizer)
        return list(optimizers)
    wrapped = []
    for optimizer in optimizers:
        offloaded = OffloadedAdam.from_optimizer(
            optimizer,
            plan.offload.device,
            plan.offload.path,
            plan.offload.chunk_bytes,
            delay_update=plan.offload.delay_update,
            direct_io="auto" if plan.offload.direct_io is None else plan.offload.direct_io,
            overlap=plan.offload.overlap,
        )
        optimizer._opt_called = (
            True  # its step is now the wrapper's: no "scheduler before step" warning
        )
        engine = parallelized.engine_for(optimizer)
        if engine is not None:
            parallelized.bind(offloaded, engine)
        wrapped.append(offloaded)
    return wrapped


def _bucket_numel(optimizer: Optimizer, plan: Plan) -> int:
    """Elements per bucket for ``bucket_size_mb``, by the size of the optimizer's elements."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    element = params[0].element_size() if params else 4
    return max(1, plan.zero.bucket_bytes // element)
