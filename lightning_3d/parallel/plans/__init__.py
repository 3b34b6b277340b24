"""Tensor-parallel plans: mappings from module-name patterns to DTensor styles.

Where a plan comes from, first match wins (:func:`build_plan`): the user's explicit mapping
(``ThreeDStrategy(tensor=2, tp_plan={...})`` or ``parallelism.tp_plan`` in Hydra, style names as
strings: see :func:`plan_from_names`); the plan a ``transformers`` model ships with it,
translated (:mod:`lightning_3d.parallel.plans.hf`); a built-in plan recognised from module names
(:func:`detect_plan`: the reference GPT, Llama-style and GPT-2-style naming, for models that ship
none, such as GPT-2 and StableLM).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_3d.parallel.plans.common import TransformerNames, plan_from_names, transformer_plan
from lightning_3d.parallel.plans.gpt import GPT_NAMES
from lightning_3d.parallel.plans.gpt2 import GPT2_NAMES
from lightning_3d.parallel.plans.hf import hf_tensor_plan
from lightning_3d.parallel.plans.llama import LLAMA_NAMES
from lightning_3d.parallel.tensor import name_matches

BUILTIN: dict[str, TransformerNames] = {"gpt": GPT_NAMES, "llama": LLAMA_NAMES, "gpt2": GPT2_NAMES}


def detect_plan(
    module: nn.Module, sequence_parallel: bool = False
) -> tuple[str, dict[str, ParallelStyle]]:
    """Recognise the architecture of ``module`` by its module names; return (name, plan)."""
    names = [n for n, _ in module.named_modules() if n]
    for arch, spec in BUILTIN.items():
        if all(any(name_matches(n, p) for n in names) for p in spec.signature):
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
    "TransformerNames",
    "build_plan",
    "detect_plan",
    "hf_tensor_plan",
    "plan_from_names",
    "transformer_plan",
]
