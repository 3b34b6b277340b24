"""The recipe: a module and a :class:`~lightning_3d.options.Plan` in, this rank's part of the
parallel model out, in one place and in this order (one call per step, each owning its special
cases):

1. **While the model is whole**: a QLoRA plan it cannot take refused; the names one process has
   recorded (checkpoints are keyed by them); tied weights (embedding = head) found, to stay one
   parameter (or one copy per pipeline stage with summed gradients) through every rewrite below;
   the tensor plan recognised from the architecture (``parallel/plans/``, adapters included).
2. **Pipeline split** (``parallel/stages.py``): keep only this rank's stages, so nothing else is
   ever sharded, wrapped or handed to the optimizer.
3. **Initial weights**: the first rank's, over the tensor ranks and the ZeRO-3 ranks
   (``parallel/replicas.py``), before anything shards them.
   Then, for a mixture-of-experts model, **expert parallelism** (``parallel/expert.py``; a
   Hugging Face family's experts found by its ``base_model_ep_plan``, ``expert_hf.py``): each
   rank keeps its ``ep`` slice of those experts, with a gradient reduction of its own; ZeRO
   splits them further over the ranks holding the same ones (8: FSDP2 units of their own;
   11: a second flat-bucket engine, ``expert_zero.py``).
4. **Tensor parallelism** on the ``tp`` axis (``parallel/tensor.py``): weights become
   tp-sharded DTensors; ties re-made.
5. With ``context`` > 1, **context parallelism** (``parallel/context/``): attention layers run
   across the ``cp`` ranks.
6. **Activation checkpointing** per block: after the split (placeholders are skipped) and after
   TP (its hooks run inside the recomputed region); before FSDP2, whose per-block gather and
   reshard hooks then wrap the checkpointed forward.
7. Optionally **torch.compile** of each block: it traces the TP layers and the checkpointed
   region; FSDP2's hooks stay outside.
8. **ZeRO-3**: FSDP2 on the ``dp`` axis (``dp`` × ``cp`` with context parallelism: those ranks
   hold the same layers), with precision and offload policies (``parallel/fsdp.py``); a MoE
   model's experts modules first, each a unit over the ranks holding the same experts
   (``parallel/expert_fsdp.py``).
9. For a module built on ``meta`` (``LitGPT(deferred_init=True)``), **materialisation**: each
   parameter filled once in its final dtype, device and shard (``parallel/materialize.py``).
10. **Pipeline runtime**: the schedule over this rank's stages.
11. At optimizer setup (:func:`attach_optimizers`): **ZeRO 0-2** flat-bucket engines, then
    **offload** of the (already sharded) optimizer state.

:func:`~lightning_3d.options.model_check.check` runs the shape-only part of 1, 2, 4 and 5 on a
``meta`` model in the launching process, so a bad plan fails before any rank starts.
:class:`Parallelized` is the public record of what the recipe made, read by the strategy, the
checkpoint hooks and the run summary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

from lightning_3d.adapters.qlora import check_qlora_plan
from lightning_3d.adapters.tensor import build_styles
from lightning_3d.layout import MeshAxis, shard_mesh
from lightning_3d.offload import OffloadedAdam
from lightning_3d.options import Plan
from lightning_3d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_3d.parallel.chunked_loss import apply_chunked_loss
from lightning_3d.parallel.compile import compile_blocks
from lightning_3d.parallel.expert import moe_layers, set_aside
from lightning_3d.parallel.expert_pipeline import carry_aux_losses
from lightning_3d.parallel.expert_zero import attach_expert_zero, build_expert_zero_mesh
from lightning_3d.parallel.foreach import step_shards_together
from lightning_3d.parallel.fsdp import apply_zero3, fsdp_policies, keep_head_gathered
from lightning_3d.parallel.masters import master_options, refuse_master_combinations
from lightning_3d.parallel.materialize import materialize_shards
from lightning_3d.parallel.pipeline_runtime import PipelineRuntime
from lightning_3d.parallel.replicas import broadcast_initial, tensor_replicas
from lightning_3d.parallel.stages import split_pipeline
from lightning_3d.parallel.tensor import apply_tensor_parallel
from lightning_3d.parallel.tied import TiedGroups, param_names, record_ties
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
    # ZeRO 0-2: one per optimizer, each followed by its expert weights' (expert_zero.py), if any
    engines: list[ZeroDataParallel] = field(default_factory=list)
    tp_plan: dict = field(default_factory=dict)  # module name -> its tensor-parallel style
    experts: list = field(default_factory=list)  # ep-sharded expert weights (ZeRO 1-2: own engine)
    _bound: dict[int, ZeroDataParallel] = field(default_factory=dict)  # id(optimizer) -> its engine

    @classmethod
    def whole(cls, module: nn.Module, mesh: DeviceMesh) -> Parallelized:
        """The record begun while ``module`` is whole: its names as one process has them."""
        return cls(
            module, mesh, list(module.state_dict()), [n for n, _ in module.named_parameters()]
        )

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

        # A tied weight's copies past the first: counted on another stage.
        copies = sum(p.numel() for p, _, first in self.tied_copies() if not first)
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
    layout = plan.layout
    # Before any rewrite: what an NF4 base (adapter method="qlora") cannot take.
    check_qlora_plan(module, plan, mesh.get_group(MeshAxis.DATA.value).size())
    # Loaded here, not with the package: Hugging Face families' experts, found by their plan.
    from lightning_3d.parallel.expert_hf import (
        apply_model_expert_parallel,
        refuse_model_expert_plan,
    )

    # Before any rewrite: a model whose experts the expert axis cannot split.
    refuse_model_expert_plan(module, layout.expert)
    # fp32 masters for a bf16 module under ZeRO 0-2: the combinations not built for them yet.
    refuse_master_combinations(plan, precision)
    # While the model is whole: checkpoints use one process's names, ties must outlive every
    # rewrite below, and the tensor plan is recognised from the whole architecture.
    made, ties = Parallelized.whole(module, mesh), record_ties(module)
    # Before the split: the pipeline spec the split reads ends at the norm when the loss is chunked.
    apply_chunked_loss(module, plan.loss, layout)
    if layout.tensor > 1:
        styles = build_styles(module, plan.tp.plan, plan.tp.sequence_parallel)
    step("the pipeline split")
    # First: what other ranks' stages hold is never sharded, wrapped or given an optimizer.
    spec, made.stages, made.tied = split_pipeline(
        module, mesh, plan.pp.virtual_stages, plan.pp.split, plan.tp.sequence_parallel
    )
    step("the first rank's initial weights")
    # Before any sharding: each rank would otherwise shard its own differently seeded weights.
    broadcast_initial(module, mesh, layout.zero_stage)
    if moe_layers(module) or layout.expert > 1:
        step("expert parallelism")
        # After the initial weights (each rank keeps its slice of the same experts), before
        # ZeRO-3, which must leave the ep-sharded expert weights to their own gradient hook.
        made.experts = apply_model_expert_parallel(module, mesh, shard_mesh(mesh), layout.expert)
    step("tensor parallelism")
    if layout.tensor > 1:
        # After the split (other stages' modules match nothing), before AC, compile and FSDP2.
        tp_mesh = mesh[MeshAxis.TENSOR.value]
        made.tp_plan = apply_tensor_parallel(
            module, tp_mesh, styles, require_all=spec is None, ties=ties, telemetry=telemetry
        )
    if layout.context > 1:
        step("context parallelism")
        # Only attributes of the attention layers change, so any place in the order works.
        from lightning_3d.parallel.context.apply import apply_context_parallel

        apply_context_parallel(module, mesh.get_group(MeshAxis.CONTEXT.value), plan.cp.scheme)
    step("activation checkpointing")
    # After the split (placeholders skipped) and TP (its hooks run inside the recomputed region).
    apply_activation_checkpointing(module, plan.ac.policy, plan.ac.every_n, plan.ac.offload)
    if plan.compile.enabled:
        step("torch.compile")
        # Traces the TP layers and the checkpointed region; FSDP2's hooks stay outside the graph.
        compile_blocks(module, plan.compile.backend, telemetry)
    step("ZeRO-3 (FSDP2) sharding")
    if layout.zero_stage == 3:
        # Last of the wrappers: per-block gather and reshard hooks around all of the above.
        policies = fsdp_policies(precision, plan.offload.params, device.type)
        if made.experts:
            # Loaded here, not with the package, as expert_hf.py is.
            from lightning_3d.parallel.expert_fsdp import apply_expert_zero3

            # First the experts, each a unit over the ranks holding the same ones (inside out:
            # the blocks' units then skip them); left to their own hook when no rank shares them.
            made.experts = apply_expert_zero3(
                module, made.experts, shard_mesh(mesh).size(), **policies
            )
        ignored = {"ignored_params": set(made.experts)} if made.experts else {}
        apply_zero3(module, shard_mesh(mesh), roots=made.stages, **policies, **ignored)
        # A pipeline's chunked loss reads the last stage's head after its forward: kept whole.
        keep_head_gathered(module, made.stages)
    step("materialising the weights")
    # Built on meta: each parameter filled once, in its final dtype, place and shard.
    materialize_shards(module, device, offloaded=layout.zero_stage == 3 and plan.offload.params)
    step("the pipeline schedule")
    if spec is not None:
        # Over the finished stages: the schedule calls the wrapped, sharded modules.
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
        # The loss is the last stage's: each MoE layer's load-balancing term rides backward on
        # its own activations, weighted as the schedule weighs a micro-batch's loss.
        carry_aux_losses(module, made.runtime.loss_weight)
    return made


def attach_optimizers(
    parallelized: Parallelized, optimizers: list[Optimizer], plan: Plan
) -> list[Optimizer]:
    """Step 11 of the recipe, once the optimizers exist: ZeRO 0-2 engines rewrite them to step
    their own slices (ZeRO-3's FSDP2 shards need none; both step with ``foreach``), then an
    offload device wraps the sharded optimizers in :class:`~lightning_3d.offload.OffloadedAdam`
    (only this rank's shard of the state moves). Returns the optimizers Lightning should step
    (the wrappers share the param groups, so LR schedulers built on the user's optimizers keep
    steering them)."""
    parallelized.clear_engines()
    if plan.layout.zero_stage < 3:
        mesh = shard_mesh(parallelized.mesh, tensor=True)
        tied = {id(p): group for p, group, _ in parallelized.tied_copies()}
        # ZeRO 1-2: the mesh of the ranks holding the same experts (a collective; None: none do).
        stage, expert = plan.layout.zero_stage, plan.layout.expert
        expert_mesh = build_expert_zero_mesh(parallelized.mesh, expert) if stage else None
        for optimizer in optimizers:
            options = {
                "bucket_numel": _bucket_numel(optimizer, plan),
                **master_options(optimizer, plan),
            }
            engine = ZeroDataParallel(mesh, plan.layout.zero_stage, **options)
            # Expert weights: not in the data-parallel buckets (their gradient is no data mean).
            with set_aside(optimizer, parallelized.experts, engine.original_groups):
                engine.attach(optimizer, tied=tied)
            parallelized.bind(optimizer, engine)
            # ZeRO 1-2: in buckets of their own over the ranks holding the same experts
            # (parallel/expert_zero.py); where none share them, left to their own hook.
            experts = attach_expert_zero(
                optimizer, engine, parallelized.experts, expert_mesh, **options
            )
            if experts is not None:
                parallelized.engines.append(experts)
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
        # Its step is now the wrapper's: no "scheduler before step" warning.
        optimizer._opt_called = True
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
