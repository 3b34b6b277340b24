"""A plan checked against a model built on ``meta``, before any rank starts: shapes and names
only, no memory, no process group. The recipe, the app's launcher and the planner use it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lightning_3d.adapters.qlora import check_qlora_plan
from lightning_3d.adapters.tensor import build_styles
from lightning_3d.parallel.chunked_loss import chunked_loss_problems
from lightning_3d.parallel.plans.hf import whole_output_conflicts
from lightning_3d.parallel.stages import pipeline_spec, plan_stages
from lightning_3d.parallel.tensor import resolve_plan
from lightning_3d.parallel.tied import check_tied_styles, find_tied

if TYPE_CHECKING:
    from lightning_3d.options import Plan


def check(module: nn.Module, plan: Plan, world_size: int) -> None:
    """Check ``plan`` against a model built on ``meta`` (shapes and names only, no memory, no
    process group): the layout tiles the world, the tensor-parallel plan fits the shapes and
    splits tied weights alike, the pipeline split has enough blocks and valid split points,
    context parallelism can route the model's attention. ``ValueError`` naming the problem."""
    layout = plan.layout.resolve(world_size)
    check_qlora_plan(module, plan, layout.data)
    # Loaded here, not with the package: Hugging Face families' experts, found by their plan.
    from lightning_3d.parallel.expert_hf import model_expert_problems

    problems = model_expert_problems(module, layout.expert)
    if problems:
        raise ValueError("; ".join(problems))
    problems = chunked_loss_problems(module, plan.loss, layout)
    if problems:
        raise ValueError("; ".join(problems))
    if layout.tensor > 1:
        conflicts = whole_output_conflicts(module, plan.tp.plan or {})
        if conflicts:
            raise ValueError("; ".join(conflicts))
        styles = build_styles(module, plan.tp.plan, plan.tp.sequence_parallel)
        check_tied_styles(module, resolve_plan(module, styles, layout.tensor), find_tied(module))
    if layout.pipeline > 1:
        virtual = plan.pp.virtual_stages
        spec = pipeline_spec(module)
        plan_stages(module, spec, layout.pipeline * virtual, plan.pp.split, virtual)
        if spec.check is not None:
            spec.check()
    if layout.context > 1:
        from lightning_3d.parallel.context.apply import context_problems

        problems = context_problems(
            module, plan.cp.scheme, layout.context, layout.tensor, layout.pipeline
        )
        if problems:
            raise ValueError("; ".join(problems))
