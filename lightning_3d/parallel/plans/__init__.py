"""Tensor-parallel plans: mappings from module-name patterns to DTensor styles.

Where a plan comes from, first match wins (:func:`build_plan`): the user's explicit mapping
(``ThreeDStrategy(tensor=2, tp_plan={...})`` or ``parallelism.tp_plan`` in Hydra, style names as
strings: see :func:`plan_from_names`); the plan a ``transformers`` model ships with it,
translated (:mod:`lightning_3d.parallel.plans.hf`); a built-in plan recognised from module names
(:func:`detect_plan`: the reference GPT and its mixture-of-experts twin, Llama-style and
GPT-2-style naming, for models that ship none, such as GPT-2 and StableLM).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_3d.parallel.plans.common import TransformerNames, plan_from_names, transformer_plan
from lightning_3d.parallel.plans.gpt import GPT_NAMES
from lightning_3d.parallel.plans.gpt2 import GPT2_NAMES
from lightning_3d.parallel.plans.hf import hf_tensor_plan
from lightning_3d.parallel.plans.llama import LLAMA_NAMES
from lightning_3d.parallel.plans.moe import MOE_GPT_NAMES, moe_gpt_plan
from lightning_3d.parallel.tensor import name_matches


@dataclass(frozen=True)
class TensorParallelOptions:
    """The ``tp`` group of :class:`~lightning_3d.options.Plan`."""

    plan: Optional[Mapping[str, Any]] = None
    """``{module-name pattern: style}`` (option ``tp_plan``; styles or their names, see
    :func:`plan_from_names`); ``None``: the plan the model ships, else one recognised from its
    module names."""
    sequence_parallel: bool = False
    """Also shard norms and the residual stream along the sequence over the tensor group (option
    ``sequence_parallel``; needs ``tensor > 1``)."""

    def problems(self) -> list[str]:
        """What is wrong with these values, in the option names users give (empty: nothing)."""
        problems = []
        if self.plan is not None and not isinstance(self.plan, Mapping):
            problems.append(f"tp_plan={self.plan!r} must be a mapping {{module pattern: style}}")
        if not isinstance(self.sequence_parallel, bool):
            problems.append(f"sequence_parallel={self.sequence_parallel!r} must be True or False")
        return problems


BUILTIN: dict[str, TransformerNames] = {
    "gpt": GPT_NAMES,
    "moe_gpt": MOE_GPT_NAMES,
    "llama": LLAMA_NAMES,
    "gpt2": GPT2_NAMES,
}


def detect_plan(
    module: nn.Module, sequence_parallel: bool = False
) -> tuple[str, dict[str, ParallelStyle]]:
    """Recognise the architecture of ``module`` by its module names; return (name, plan)."""
    names = [n for n, _ in module.named_modules() if n]
    for arch, spec in BUILTIN.items():
        if all(any(name_matches(n, p) for n in names) for p in spec.signature):
            if spec is MOE_GPT_NAMES:  # its MoE layers and optional shared expert: plans/moe.py
                return arch, moe_gpt_plan(module, sequence_parallel)
            return arch, transformer_plan(spec, sequence_parallel)
    looked_for = {arch: list(spec.signature) for arch, spec in BUILTIN.items()}
    raise ValueError(
        f"no tensor-parallel plan matches {type(module).__name__}: looked for module names {looked_for}; "
        "pass an explicit plan (tp_plan={pattern: style})"
    )


def build_plan(
    module: nn.Module, plan: Mapping | None, sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """The plan to apply: ``plan`` if given (styles or style names), else the one the module's
    ``transformers`` model ships (translated), else the built-in recognised by module names."""
    if plan:
        return plan_from_names(plan, sequence_parallel)
    shipped = hf_tensor_plan(module, sequence_parallel)
    if shipped is not None:
        return shipped
    return detect_plan(module, sequence_parallel)[1]


__all__ = [
    "BUILTIN",
    "TensorParallelOptions",
    "TransformerNames",
    "build_plan",
    "detect_plan",
    "hf_tensor_plan",
    "plan_from_names",
    "transformer_plan",
]
