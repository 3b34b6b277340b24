"""A guard against silent divergence: every replica of a parameter must take the same step.

Under tensor parallelism every parameter the plan does not split is replicated on each tensor
rank, and a tied weight split over pipeline stages has one copy per stage. Their replicas must
end every step equal. A plan mistake breaks that silently: a per-head norm whose gradient is not
summed over ``tp`` (each rank sees its own heads only), a replicated module handed a shard of the
sequence, tied copies whose gradients are not added up. The losses barely move; the weights part
ways.

:class:`ReplicaCheck` compares, over each group of replicas, a fingerprint of every replicated
tensor (sum, sum of squares and a position-weighted sum, in float64): the gradients of what the
optimizer steps before the step, and the parameters themselves after it. One all-gather per
group and one all-reduce of the verdict over the world, at the first optimizer step (and every
``every`` steps, or on demand); a mismatch raises :class:`ReplicaMismatch` on every rank,
naming the parameters, the ranks, and the plan entry to change.

Replicas must also *start* equal: :func:`broadcast_start` hands every rank of a stage the first
rank's initial weights, whatever each process was seeded with (:func:`broadcast_initial` says over
which groups, for the recipe).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_3d.compat import all_gather_single
from lightning_3d.layout import MeshAxis, shard_mesh
from lightning_3d.parallel.materialize import has_meta
from lightning_3d.parallel.tensor import local_tensor, plain_parts

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ReplicaOptions:
    """The ``replicas`` group of :class:`~lightning_3d.options.Plan`."""

    check: Union[str, int] = "first"
    """When the replicas of a parameter (tensor ranks, tied copies on pipeline stages) are checked
    to agree (option ``replica_check``): the run's ``"first"`` optimizer step, ``"off"``, or every
    n steps."""

    def problems(self) -> list[str]:
        """What is wrong with these values, in the option names users give (empty: nothing)."""
        ok = self.check in ("first", "off") or (
            isinstance(self.check, int) and not isinstance(self.check, bool) and self.check >= 1
        )
        return (
            []
            if ok
            else [
                f"replica_check={self.check!r} must be 'first', 'off' or a positive number of steps"
            ]
        )

    def due(self, steps_done: int) -> bool:
        """Whether the check runs at this run's optimizer step ``steps_done`` (0: its first)."""
        if self.check == "off":
            return False
        return steps_done == 0 or (isinstance(self.check, int) and steps_done % self.check == 0)


RTOL = 1e-5  # replicas computed alike are equal bit for bit; a plan mistake moves them by O(1)
WEIGHTS = 17  # the weighted sum's period: positions i and i + 17 weigh alike


@torch.no_grad()
def broadcast_start(
    module: torch.nn.Module, groups: Iterable[Any], frozen_only: bool = False
) -> None:
    """Make the first rank's parameters and buffers everyone's, over each group of ``groups`` in
    turn (the tensor group, then the data group: afterwards the (dp, tp) slab of a pipeline stage
    holds its first rank's). A script that seeds by rank, or not at all, builds other weights on
    every rank; tensor parallelism scatters only the tensors its plan splits, FSDP2 shards each
    rank's own values, so without this each rank would train a part of another model. Call it
    on materialised tensors (a module on ``meta`` is filled alike later), before sharding.
    ``frozen_only``: only the parameters that do not train (ZeRO 0-2's buckets hold the others)."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta"]
    if frozen_only:
        tensors = [
            t for t in module.parameters() if not t.requires_grad and t.device.type != "meta"
        ]
    for group in groups:
        if group is None or dist.get_world_size(group) == 1:
            continue
        src = dist.get_global_rank(group, 0)
        for t in tensors:
            for part in plain_parts(t):  # an NF4Tensor's or a 4-bit Params4bit's codes and scales
                dist.broadcast(part, src=src, group=group)


def broadcast_initial(module: torch.nn.Module, mesh: DeviceMesh, zero_stage: int) -> None:
    """:func:`broadcast_start` over the groups nothing else makes equal, on this rank's stages
    before any sharding: the tensor ranks, and under ZeRO-3 the ranks FSDP2 shards over. ZeRO 0-2's
    buckets broadcast over those ranks themselves, but hold no frozen weight (a LoRA base): those
    are broadcast here. Nothing while a tensor is on ``meta`` (filled alike on every rank later)."""
    if has_meta(module):
        return
    if mesh.get_group(MeshAxis.TENSOR.value).size() > 1 or zero_stage == 3:
        groups = [mesh[MeshAxis.TENSOR.value].get_group()]
        groups += [shard_mesh(mesh).get_group()] if zero_stage == 3 else []
        broadcast_start(module, groups)
    if zero_stage < 3:
        broadcast_start(module, [shard_mesh(mesh).get_group()], frozen_only=True)


class ReplicaMismatch(RuntimeError):
    """Replicas of a parameter disagree (see the module docstring)."""


def fingerprint(t: Tensor) -> Tensor:
    """``(sum, sum of squares, position-weighted sum)`` of ``t`` in float64: equal tensors give
    equal fingerprints; a tensor whose values moved, or moved around, almost surely not."""
    flat = t.detach().reshape(-1).double()
    pad = (-flat.numel()) % WEIGHTS
    rows = torch.cat([flat, flat.new_zeros(pad)]).view(-1, WEIGHTS)
    weights = torch.arange(1, WEIGHTS + 1, dtype=torch.float64, device=flat.device)
    return torch.stack([flat.sum(), (flat * flat).sum(), (rows @ weights).sum()])


def replicated_over(t: Tensor, axis: str) -> bool:
    """Whether ``t`` is whole (not split) on the mesh axis ``axis``: a plain tensor, a DTensor on
    a mesh without that axis, or one placed ``Replicate`` (or partial) on it."""
    if not isinstance(t, DTensor):
        return True
    names = t.device_mesh.mesh_dim_names or ()
    return axis not in names or not t.placements[names.index(axis)].is_shard()


def _whole_local(t: Tensor) -> Tensor:
    """This rank's part of ``t``, with partial sums (a gradient not yet reduced) reduced first."""
    if isinstance(t, DTensor) and any(pl.is_partial() for pl in t.placements):
        t = t.redistribute(
            placements=[Replicate() if pl.is_partial() else pl for pl in t.placements]
        )
    return local_tensor(t)


class ReplicaCheck:
    """Compares replicas over groups: ``[(what, process group, [(name, tensor), ...])]`` (each
    rank of a group lists the same names in the same order; ``what`` says which replicas they
    are: ``"tensor ranks"``, ``"pipeline stages holding the tie"``). ``advice(names)`` is the
    sentence that tells the user what to change for the parameters ``names``. ``device``: where
    the fingerprints travel (the rank's device: an NCCL group takes no host tensor)."""

    def __init__(
        self,
        device: torch.device,
        advice: Callable[[list[str]], str] = lambda names: "",
    ) -> None:
        self.device = device
        self.advice = advice

    def compare(
        self, kind: str, groups: Iterable[tuple[str, Any, list[tuple[str, Tensor]]]]
    ) -> None:
        """Raise :class:`ReplicaMismatch` on every rank if any replicas' ``kind`` (``"gradient"``,
        ``"value"``) differ. A collective over the world: every rank calls it. The verdicts stay
        on the device until one host read of the agreed flag; the names are read only when it
        says some replicas disagree."""
        verdicts = []  # (what, ranks, names, per-name "apart" flags on the device)
        for what, group, named in groups:
            if not named or group is None or dist.get_world_size(group) < 2:
                continue
            verdicts.append(
                (
                    what,
                    tuple(dist.get_process_group_ranks(group)),
                    [name for name, _ in named],
                    self._apart(group, [t for _, t in named]),
                )
            )
        if dist.get_world_size() == 1:
            return  # no replicas anywhere: nothing to agree on
        apart = [flags for *_, flags in verdicts]
        here = torch.cat(apart).any() if apart else torch.zeros((), device=self.device)
        flag = here.to(torch.float32).reshape(1)
        dist.all_reduce(flag)  # every rank stops, not only the groups that saw it
        if not flag.item():  # the check's one host read
            return
        named_apart = {
            (what, ranks): [n for n, bad in zip(names, flags.tolist()) if bad]
            for what, ranks, names, flags in verdicts
        }
        named_apart = {key: names for key, names in named_apart.items() if names}
        if not named_apart:
            raise ReplicaMismatch(
                "replicas disagree on another rank (its error names them); stopping with it"
            )
        raise ReplicaMismatch(
            " ".join(
                self._sentence(kind, what, ranks, names)
                for (what, ranks), names in named_apart.items()
            )
        )

    def _apart(self, group: Any, tensors: list[Optional[Tensor]]) -> Tensor:
        """Per tensor, on the device: whether its fingerprints differ across ``group``'s ranks
        (``None``, no gradient: fingerprinted as zeros)."""
        mine = torch.stack(
            [
                fingerprint(_whole_local(t)).to(self.device)
                if t is not None
                else torch.zeros(3, dtype=torch.float64, device=self.device)
                for t in tensors
            ]
        )
        size = dist.get_world_size(group)
        parts = torch.empty((size * len(tensors), 3), dtype=mine.dtype, device=self.device)
        all_gather_single(parts, mine, group=group)
        parts = parts.view(size, len(tensors), 3)  # (ranks, names, fingerprint)
        scale = parts.abs().amax(dim=(0, 2)) + 1e-30  # (names,)
        spread = (parts - parts[0]).abs().amax(dim=(0, 2))
        return spread > RTOL * scale

    def _sentence(self, kind: str, what: str, ranks: tuple[int, ...], names: list[str]) -> str:
        listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return (
            f"replicas disagree, so the run stops before they part ways: the {kind} of {listed} differs "
            f"across the {what} (global ranks {list(ranks)}).{self.advice(names) if 'tensor' in what else ''}"
        )


def tensor_replicas(
    named: Iterable[tuple[str, Tensor, Tensor]], tp_group: Any
) -> list[tuple[str, Any, list]]:
    """The groups for :meth:`ReplicaCheck.compare`: of ``(name, parameter, tensor)``, the
    tensors (a gradient, or the parameter itself; ``None``: no gradient) of the parameters that
    are whole on the tensor axis (one group: this rank's tensor group). Which parameters those
    are follows from their layout alone, so every tensor rank lists the same ones."""
    return [("tensor ranks", tp_group, [(n, t) for n, p, t in named if replicated_over(p, "tp")])]


def plan_hint(plan: Mapping[str, Any]) -> Callable[[list[str]], str]:
    """The advice for tensor-rank replicas that disagree: the style the plan gave their modules
    (or that it gave none) and the plan entries that would sum their gradients over ``tp``."""

    def advice(names: list[str]) -> str:
        modules = list(dict.fromkeys(n.rpartition(".")[0] for n in names))
        styles = sorted({type(plan[m]).__name__ for m in modules if m in plan})
        said = (
            f"the plan gives them {', '.join(styles)}"
            if styles
            else "no tensor-parallel plan entry splits them"
        )
        patterns = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", m) for m in modules))
        entries = ", ".join(f"'{p}': 'replicated_with_grad_allreduce'" for p in patterns[:3])
        return (
            f" {said.capitalize()}, so every tensor rank keeps all of each; a module that sees only its rank's "
            f"share of an activation (heads, a sequence shard) needs the style that sums its gradient over tp: "
            f"tp_plan={{{entries}, ...}} (or split it with the layers around it)."
        )

    return advice
