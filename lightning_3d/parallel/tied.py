"""Tied weights: one parameter used by several modules (input embedding and LM head) stays one.

Found on the whole model before anything is rewritten (:func:`find_tied`), a tie is kept in
every layout:

* **Tensor parallelism** shards each module's weight on its own, so the two modules come out
  holding two DTensors made from the same tensor. :func:`retie` points every alias back at the
  first one — legal when both are sharded alike (vocab-parallel embedding and column-parallel
  head both split the vocabulary rows, ``Shard(0)``), a ``ValueError`` otherwise: never a silent
  untie.
* **ZeRO 1/2/3, activation checkpointing, offload** see the module's parameters once
  (``parameters()`` deduplicates), so the one parameter gets one gradient and one update.
* **Pipeline parallelism**: the first stage holds the embedding, the last the head. Each keeps
  its copy of the weight (equal at start: every rank builds the same model), and the copies'
  gradients are summed between the ranks that hold them before the data-parallel reduction, as
  Megatron's embedding group does, so both take the same step. :class:`TiedGroups` builds
  those process groups; the copy on any holder but the first is left out of gradient-norm sums
  so the clip threshold sees the weight once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

# On the LightningModule: {alias parameter name: canonical name} for names that are a tied
# weight's second (third, ...) name, so checkpoints key it by its one-process name on any stage.
TIED_ALIASES_ATTR = "_l3d_tied_aliases"


def find_tied(module: nn.Module) -> list[tuple[str, ...]]:
    """Names of every parameter reachable under more than one name, grouped per tensor; the
    first name of each group is the one ``named_parameters()`` reports in one process."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def record_aliases(module: nn.Module, groups: Sequence[tuple[str, ...]]) -> None:
    setattr(module, TIED_ALIASES_ATTR, {alias: group[0] for group in groups for alias in group[1:]})


def record_ties(module: nn.Module) -> list[tuple[str, ...]]:
    """:func:`find_tied` on the whole model, its aliases recorded on it (:func:`record_aliases`)
    so that checkpoints key a tied weight by its one-process name on any stage."""
    groups = find_tied(module)
    record_aliases(module, groups)
    return groups


def param_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` with each tied weight under its one-process (canonical) name,
    whichever of its modules this rank still holds."""
    aliases = getattr(module, TIED_ALIASES_ATTR, {})
    return {id(p): aliases.get(name, name) for name, p in module.named_parameters()}


def _owner(root: nn.Module, name: str) -> tuple[Optional[nn.Module], str]:
    path, _, leaf = name.rpartition(".")
    try:
        return (root.get_submodule(path) if path else root), leaf
    except AttributeError:  # the module is another pipeline stage's
        return None, leaf


def _layout(p: Tensor) -> str:
    if isinstance(p, DTensor):
        return f"DTensor{tuple(p.placements)} on mesh {p.device_mesh.mesh_dim_names}"
    return "a plain tensor"


def retie(root: nn.Module, groups: Sequence[tuple[str, ...]]) -> None:
    """After tensor parallelism: make every name of a tie hold the first name's parameter again.

    Raises ``ValueError`` naming both parameters and their layouts when they were sharded
    differently (one parameter cannot be both)."""
    for group in groups:
        present = [(name, *_owner(root, name)) for name in group]
        present = [(name, owner, leaf) for name, owner, leaf in present if owner is not None]
        if len(present) < 2:
            continue
        first_name, first_owner, first_leaf = present[0]
        keep = first_owner._parameters[first_leaf]
        for name, owner, leaf in present[1:]:
            other = owner._parameters[leaf]
            if other is keep:
                continue
            same = isinstance(keep, DTensor) == isinstance(other, DTensor) and (
                not isinstance(keep, DTensor)
                or (keep.placements == other.placements and keep.device_mesh == other.device_mesh)
            )
            if not same or tuple(keep.shape) != tuple(other.shape):
                raise ValueError(
                    f"tied parameters {first_name} ({_layout(keep)}) and {name} ({_layout(other)}) were "
                    "sharded differently by the tensor-parallel plan, so they cannot stay one parameter: "
                    "give both modules styles that split the shared dimension alike (e.g. 'vocab' for the "
                    "embedding and 'head' for the LM head), or untie them"
                )
            owner.register_parameter(leaf, keep)


def _weight_dim(module: nn.Module, style: Any) -> Optional[int]:
    """The weight dimension a built-in style shards (``-1``: replicated, ``None``: unknown).
    ``nn.Linear`` weights are (out, in), ``nn.Embedding`` weights (vocabulary, dim)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style is None:
        return -1
    column = isinstance(style, ColwiseParallel)
    if not column and not isinstance(style, RowwiseParallel):
        return None
    if type(module) is nn.Linear:
        return 0 if column else 1
    if type(module) is nn.Embedding:
        return 1 if column else 0
    return None


def check_tied_styles(
    root: nn.Module, resolved: dict[str, Any], groups: Sequence[tuple[str, ...]]
) -> None:
    """Before tensor parallelism runs (on the ``meta`` model too): a ``ValueError`` when a plan
    would shard the modules of one tied weight along different dimensions (see :func:`retie`)."""
    for group in groups:
        dims = {}
        for name in group:
            path = name.rpartition(".")[0]
            owner, _ = _owner(root, name)
            if owner is not None:
                dims[name] = _weight_dim(owner, resolved.get(path))
        known = {n: d for n, d in dims.items() if d is not None}
        if len(set(known.values())) > 1:
            said = ", ".join(
                f"{n} ({'replicated' if d < 0 else f'split on dim {d}'})" for n, d in known.items()
            )
            raise ValueError(
                f"tied parameters {said} would be sharded differently by the tensor-parallel plan, so they "
                "cannot stay one parameter: give both modules styles that split the shared dimension alike "
                "(e.g. 'vocab' for the embedding and 'head' for the LM head), or untie them"
            )


class TiedGroups:
    """Process groups that sum a tied weight's gradient over the pipeline ranks holding a copy.

    ``holders``: for each tie (by canonical name), the pipeline ranks whose stages use it. Every
    rank must construct this with the same ``holders`` (``dist.new_group`` is collective); a
    rank keeps the groups it belongs to, one per coordinate of the mesh's other axes.
    """

    def __init__(self, mesh: Any, holders: dict[str, Sequence[int]]) -> None:
        self.groups: dict[str, Any] = {}  # canonical name -> process group (this rank's)
        self.first: dict[str, bool] = {}  # canonical name -> this rank is the first holder
        # Global ranks by pipeline rank, then every other coordinate of the mesh (dp, cp, tp:
        # whatever axes follow the pipeline's), one column per group of copies.
        ranks = mesh.mesh.reshape(mesh.mesh.shape[0], -1)
        me = dist.get_rank()
        pp_rank = mesh.get_coordinate()[0]
        made: dict[tuple[int, ...], Any] = {}
        for name, pp_ranks in sorted(holders.items()):
            pp_ranks = tuple(sorted(set(pp_ranks)))
            if len(pp_ranks) < 2:
                continue
            for column in range(ranks.shape[1]):
                members = tuple(int(ranks[s, column]) for s in pp_ranks)
                if members not in made:
                    made[members] = dist.new_group(list(members))
                if me in members:
                    self.groups[name] = made[members]
                    self.first[name] = pp_rank == pp_ranks[0]

    def __bool__(self) -> bool:
        return bool(self.groups)

    def local(self, module: nn.Module) -> list[tuple[nn.Parameter, Any, bool]]:
        """``(parameter, group, is_first_holder)`` for the tied weights this rank holds."""
        names = param_names(module)
        return [
            (p, self.groups[names[id(p)]], self.first[names[id(p)]])
            for p in module.parameters()
            if names[id(p)] in self.groups
        ]
