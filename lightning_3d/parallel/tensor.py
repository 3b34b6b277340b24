"""Tensor parallelism on the ``tp`` axis: apply a plan (module-name pattern -> DTensor style).

A plan is data: an ordered mapping from ``fnmatch`` patterns over the full module names of the
``LightningModule`` (``"model.blocks.*.attn.wq"``; ``*`` also crosses dots) to PyTorch parallel
styles. :func:`resolve_plan` expands it against the module's real names, refusing patterns that
match nothing and dimensions the tensor size does not divide — before any collective runs —
and :func:`apply_tensor_parallel` hands the result to ``parallelize_module``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Set on a module whose parameters' rows FusedColwiseParallel regrouped: (chunks, tp size).
# On the module, not the parameters: Module._apply swaps DTensor parameters for new objects.
FUSED_ROWS_ATTR = "_l3d_fused_rows"


class FusedColwiseParallel(ColwiseParallel):
    """Column parallelism for a fused projection (e.g. GPT-2's ``c_attn`` = [q; k; v]).

    Plain column sharding would hand rank 0 all of q and part of k. The weight's rows are
    regrouped first so that rank r's contiguous block is [q_r; k_r; v_r]: the local output still
    splits into ``chunks`` equal parts, each holding this rank's heads. The regrouping is
    recorded on the module (``FUSED_ROWS_ATTR``) so full state dicts can undo it.
    """

    def __init__(self, chunks: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.chunks = chunks

    def _partition_linear_fn(self, name, module, device_mesh):
        tp = device_mesh.size()
        for pname, param in module.named_parameters():
            rows = regroup_fused_rows(param.detach(), self.chunks, tp)
            dist = nn.Parameter(distribute_tensor(rows, device_mesh, [Shard(0)]), requires_grad=param.requires_grad)
            module.register_parameter(pname, dist)
        setattr(module, FUSED_ROWS_ATTR, (self.chunks, tp))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor``, ``t`` itself otherwise."""
    return t._local_tensor if isinstance(t, DTensor) else t


def regroup_fused_rows(t: torch.Tensor, chunks: int, tp: int, inverse: bool = False) -> torch.Tensor:
    """[c0 | c1 | c2] with each chunk split in tp parts -> [c0_0 c1_0 c2_0 | c0_1 c1_1 c2_1 | ...]."""
    rest = t.shape[1:]
    if inverse:  # (tp, chunks, rows, ...) back to (chunks, tp, rows, ...)
        return t.reshape(tp, chunks, -1, *rest).transpose(0, 1).reshape(t.shape)
    return t.reshape(chunks, tp, -1, *rest).transpose(0, 1).reshape(t.shape)


def name_matches(name: str, pattern: str) -> bool:
    """``fnmatch`` over a full module name; ``"*.norm"`` also matches a top-level ``norm``."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase("." + name, pattern)


def resolve_plan(
    module: nn.Module, plan: Mapping[str, ParallelStyle], tp: int, require_all: bool = True
) -> dict[str, ParallelStyle]:
    """Expand ``plan`` to concrete module names; ``ValueError`` for unmatched or indivisible.

    ``require_all=False`` lets patterns match nothing (a pipeline stage lacks other stages' modules).
    """
    names = [name for name, _ in module.named_modules() if name]
    resolved: dict[str, ParallelStyle] = {}
    unmatched = []
    for pattern, style in plan.items():
        hits = [n for n in names if name_matches(n, pattern)]
        if not hits:
            unmatched.append(pattern)
        for name in hits:
            resolved.setdefault(name, style)  # the first pattern that names a module wins
    if unmatched and require_all:
        raise ValueError(f"tensor-parallel plan pattern(s) {unmatched} match no module of {type(module).__name__}")
    problems = [p for name, style in resolved.items() for p in _divisibility(module, name, style, tp)]
    if problems:
        raise ValueError(f"tensor={tp} does not divide the model: " + "; ".join(problems))
    return resolved


def _divisibility(root: nn.Module, name: str, style: ParallelStyle, tp: int) -> list[str]:
    module = root.get_submodule(name)
    problems = []
    if isinstance(module, nn.Embedding) and isinstance(style, RowwiseParallel):
        dims = {"num_embeddings (vocabulary)": module.num_embeddings}
    elif isinstance(module, nn.Linear) and isinstance(style, ColwiseParallel):
        chunks = getattr(style, "chunks", 1)
        dims = {"out_features": module.out_features // chunks}
        parent = root.get_submodule(name.rpartition(".")[0]) if "." in name else root
        head_dim = getattr(parent, "head_dim", None)
        if head_dim and module.out_features % (head_dim * chunks) == 0:
            dims["heads"] = module.out_features // (head_dim * chunks)
    elif isinstance(module, nn.Linear) and isinstance(style, RowwiseParallel):
        dims = {"in_features": module.in_features}
    else:
        dims = {}
    for what, size in dims.items():
        if size % tp:
            problems.append(f"{name}: {what} {size} is not divisible by tensor={tp}")
    return problems


def apply_tensor_parallel(
    module: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle], require_all: bool = True
) -> dict:
    """Rewrite ``module`` in place with ``plan`` on ``tp_mesh``; returns the resolved plan."""
    resolved = resolve_plan(module, plan, tp_mesh.size(), require_all)
    parallelize_module(module, tp_mesh, resolved)
    return resolved
