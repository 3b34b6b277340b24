"""How LoRA adapters split under tensor parallelism, beside the base weight they adapt.

A plan entry names the adapted module (``...q_proj``), which after ``peft`` is a LoRA layer,
not a ``Linear``; its style moves to the base (``...q_proj.base_layer``) and the adapters are
split so that ``base(x) + B(A(x))`` has the base's layout on every rank, with no collective of
their own beyond the ones a Megatron pair already has:

* column-parallel base (output features split): ``A`` replicated, ``B`` column-split with the
  base's style. ``B``'s input hook is Megatron's *f* (identity forward, all-reduce backward), so
  ``A``'s gradient is whole and equal on every tensor rank;
* row-parallel base (input features split): ``A`` row-split with the base's style (its output
  all-reduced as the base's is), ``B`` replicated, fed the reduced ``A x``.

Under sequence parallelism a row-parallel base hands on a sequence-sharded ``DTensor`` that a
replicated plain ``B`` cannot take: refused (``ValueError``) for now.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_3d.adapters.lora import adapted_modules
from lightning_3d.parallel.plans import build_plan
from lightning_3d.parallel.tensor import name_matches


def adapter_tensor_plan(
    module: nn.Module, plan: Mapping[str, ParallelStyle]
) -> dict[str, ParallelStyle]:
    """``plan`` with every entry that names an adapted module rewritten as the module docstring
    says (unchanged for a model without adapters); ``ValueError`` naming an adapted module whose
    style is neither column- nor row-parallel, or one whose output is not a local tensor."""
    adapted = {name: module.get_submodule(name) for name in adapted_modules(module)}
    if not adapted:
        return dict(plan)
    out: dict[str, ParallelStyle] = {}
    problems = []
    for pattern, style in plan.items():
        hits = [name for name in adapted if name_matches(name, pattern)]
        if not hits:
            out[pattern] = style
            continue
        column, row = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
        if not (column or row) or not getattr(style, "use_local_output", True):
            problems.append(
                f"{hits[0]} ({type(style).__name__}, use_local_output="
                f"{getattr(style, 'use_local_output', None)})"
            )
            continue
        # Every module the pattern names, by name: some may be adapted and others not (a
        # target_modules list that names only some layers).
        names = [n for n, _ in module.named_modules() if n and name_matches(n, pattern)]
        for name in names:
            if name not in adapted:
                out[name] = style
                continue
            out[f"{name}.base_layer"] = style
            for key in adapted[name].lora_A:  # the adapter names ("default")
                out[f"{name}.{'lora_B' if column else 'lora_A'}.{key}"] = style
    if problems:
        raise ValueError(
            "LoRA adapters split only beside a column- or row-parallel base with local "
            "outputs (sequence_parallel=False): " + "; ".join(problems)
        )
    return out


def build_styles(
    module: nn.Module, plan: Mapping | None, sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """The tensor plan to apply (:func:`~lightning_3d.parallel.plans.build_plan`) with LoRA
    adapters split beside the base weights they adapt (:func:`adapter_tensor_plan`): what the
    recipe applies and the launcher's check resolves. Call it on the whole model: it recognises
    the architecture."""
    return adapter_tensor_plan(module, build_plan(module, plan, sequence_parallel))
