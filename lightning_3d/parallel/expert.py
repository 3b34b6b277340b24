"""Expert parallelism: a mixture-of-experts layer's experts split over the ``ep`` ranks, tokens
sent to the rank that holds their expert and back.

The ``ep`` ranks are a sub-grouping of the data ranks (``layout.build_expert_mesh``): with
``expert=2`` on two data ranks each rank holds half the experts, and every other weight stays
data-parallel. Per MoE layer and step:

1. the router picks each token's experts on the token's own rank; tokens are sorted by expert;
2. :meth:`ExpertRouting.exchange_counts`: one all-to-all of the per-expert counts, then one
   device-to-host read of them (``all_to_all_single`` takes its split sizes as host ints; on a
   GPU that read waits for the router, once per layer, and is the only one);
3. :func:`all_to_all` sends the tokens (variable split sizes), the local experts run on what
   arrives, and the same call with the sizes swapped returns the outputs. The collective is its
   own dual: backward sends the gradients back along the reverse route.

Routing is dropless (every token reaches every expert it chose, whatever the counts), so a
layout computes exactly what one process does.

Gradients. The data-parallel engines average each gradient over the ``G`` data ranks, and the
objective (``objective.py``) makes that average one process's gradient. An expert's gradient
already holds the contributions of every token of its ``ep`` group (they came to it), so it is
summed over the ranks that hold the same expert (``dp_replica``, and ``cp`` under context
parallelism: ``G / ep`` of them, :func:`expert_groups`) and divided by ``G``, not averaged over
ranks holding other experts. Under context parallelism ``G`` is data × context (the data mesh
is ``layout.shard_mesh``: the router's statistics and the capacity line are the global batch's
there too); tensor ranks compute the same experts on the same replicated tokens
(``parallel/plans/moe.py``) and need no reduction. The expert weights are ``DTensor`` s
sharded on ``ep`` (dim 0, the expert), so full state dicts and the global gradient norm count
each expert once. The data-parallel ZeRO 0-2 engine never buckets them (set aside while it
attaches, :func:`set_aside`): ZeRO-0 leaves them to this module's gradient hook; ZeRO 1-2 bucket
them in a second engine over ``dp_replica`` (× ``cp``) on the same optimizer, which
reduce-scatters their gradients there, divides by ``G`` and removes the hook
(``parallel/expert_zero.py``), so their optimizer state is 1/G of theirs per rank. ZeRO-3
shards them over ``dp_replica`` (× ``cp``) too: each experts module an FSDP2 unit there,
whose reduce-scatter sums over the replicas and divides by ``G`` (``parallel/expert_fsdp.py``;
it replaces the parameters, so this hook no longer runs). With
``expert`` = data there is nothing to shard them over: FSDP2's ``ignored_params``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from lightning_3d.compat import all_gather_single

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable split sizes; backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list, in_splits: list, group: Any) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    """Send rows ``in_splits[r]`` of ``x`` (in order) to rank ``r`` of ``group``; receive
    ``out_splits[r]`` rows from each. Differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass(eq=False)
class ExpertRouting:
    """The process groups one MoE layer talks over, set on it by :func:`apply_expert_parallel`.

    ``ep_group``: the ranks splitting the experts (``None``: every expert here). ``data_group``:
    the ranks whose gradients are averaged, over which the router's load statistics are summed
    so the auxiliary loss is the global batch's."""

    ep_group: Optional[Any]
    ep_size: int
    ep_rank: int
    data_group: Optional[Any]
    data_size: int

    def exchange_counts(self, counts: Tensor) -> tuple[list[int], list[int]]:
        """``counts``: (experts,) tokens this rank sends to each expert, on the device. Returns
        this rank's counts and the received ones as host ints: ``received[s * local + j]`` tokens
        come from rank ``s`` for local expert ``j``. The layer's one device-to-host read."""
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)
        host = torch.cat([counts, received]).tolist()
        return host[: counts.numel()], host[counts.numel() :]

    def splits(self, sent: list[int], received: list[int]) -> tuple[list[int], list[int]]:
        """``(in_splits, out_splits)`` of the token exchange: rows this rank sends to each ep
        rank and receives from each, from :meth:`exchange_counts`'s per-expert counts."""
        ep, local = self.ep_size, len(sent) // self.ep_size
        in_splits = [sum(sent[r * local : (r + 1) * local]) for r in range(ep)]
        out_splits = [sum(received[s * local : (s + 1) * local]) for s in range(ep)]
        return in_splits, out_splits

    def dispatch(self, routed: Tensor, counts: Tensor, run_local: Any) -> Tensor:
        """``routed``: (n, C) token rows sorted by expert, ``counts`` their per-expert counts;
        rows after the first ``counts.sum()`` stay here. Sends each row to its expert's rank, runs
        ``run_local(rows, per_local_expert_counts)`` there on rows grouped by local expert, and
        returns the outputs in ``routed``'s order (the counted rows only)."""
        sent, received = self.exchange_counts(counts)
        # Rows past the counted ones (token slots dropped over capacity) are sent nowhere.
        routed = routed[: sum(sent)]
        ep, local = self.ep_size, counts.numel() // self.ep_size
        in_splits, out_splits = self.splits(sent, received)
        arrived = all_to_all(routed, out_splits, in_splits, self.ep_group)  # by source, expert
        pieces = arrived.split(received)
        # Regroup by local expert (the order the grouped weights take), then back by source.
        by_expert = [s * local + j for j in range(local) for s in range(ep)]
        rows = torch.cat([pieces[i] for i in by_expert])
        per_expert = [sum(received[s * local + j] for s in range(ep)) for j in range(local)]
        done = run_local(rows, per_expert).split([received[i] for i in by_expert])
        by_source = sorted(range(len(by_expert)), key=by_expert.__getitem__)
        back = torch.cat([done[i] for i in by_source])
        return all_to_all(back, in_splits, out_splits, self.ep_group)

    def gather(self, rows: Tensor) -> Tensor:
        """``rows`` of every data rank, stacked on dim 0 in data-rank order (no gradient; every
        rank must pass the same shape)."""
        rows = rows.detach().contiguous()
        if self.data_group is None or self.data_size == 1:
            return rows
        out = rows.new_empty((self.data_size * rows.shape[0], *rows.shape[1:]))
        all_gather_single(out, rows, group=self.data_group)
        return out

    def global_sum(self, stats: Tensor) -> Tensor:
        """``stats`` summed over the data ranks (a copy; no gradient)."""
        total = stats.detach().clone()
        if self.data_group is not None and self.data_size > 1:
            dist.all_reduce(total, group=self.data_group)
        return total


def is_moe_layer(module: nn.Module) -> bool:
    """A layer this module parallelises: it has ``routing`` (``None`` until set), ``n_experts``
    and an ``experts`` submodule whose every parameter has the expert as dim 0."""
    return (
        hasattr(module, "routing") and hasattr(module, "n_experts") and hasattr(module, "experts")
    )


def moe_layers(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if is_moe_layer(m)]


def expert_problems(module: nn.Module, expert: int) -> list[str]:
    """What stops ``expert`` ranks from splitting ``module``'s experts (empty: nothing)."""
    if expert == 1:
        return []
    layers = moe_layers(module)
    if not layers:
        name = type(module).__name__
        return [f"expert={expert} needs a mixture-of-experts model; {name} has no MoE layer"]
    counts = sorted({layer.n_experts for layer in layers})
    bad = [n for n in counts if n % expert]
    if bad:
        return [f"expert={expert} does not divide n_experts={bad[0]}"]
    return []


def apply_expert_parallel(
    module: nn.Module, mesh: DeviceMesh, data_mesh: DeviceMesh, expert: int
) -> list[nn.Parameter]:
    """Give every MoE layer of ``module`` its :class:`ExpertRouting`; with ``expert`` > 1 keep
    this rank's experts only, as ``DTensor`` s sharded on ``ep``, whose gradients are summed over
    ``dp_replica`` and divided by the data size (see the module's docstring). ``mesh``: the
    ``build_mesh`` mesh; ``data_mesh``: the ranks whose gradients are averaged. Returns the
    expert parameters, which the ZeRO engines must leave alone. In place; call it while every
    rank holds the same full weights (after the initial broadcast)."""
    layers = moe_layers(module)
    data_group, data_size = data_mesh.get_group(), data_mesh.size()
    if expert == 1:
        for layer in layers:
            layer.routing = ExpertRouting(None, 1, 0, data_group, data_size)
        return []
    ep_mesh, replicas = expert_groups(mesh, expert)
    ep_group, ep_rank = ep_mesh.get_group(), ep_mesh.get_local_rank()
    params: list[nn.Parameter] = []
    for layer in layers:
        layer.routing = ExpertRouting(ep_group, expert, ep_rank, data_group, data_size)
        for name, full in list(layer.experts.named_parameters(recurse=False)):
            param = shard_expert_weight(full, ep_mesh, replicas, data_group, data_size)
            setattr(layer.experts, name, param)
            params.append(param)
    return params


def expert_groups(mesh: DeviceMesh, expert: int) -> tuple[DeviceMesh, Any]:
    """``(ep mesh, replica group)`` of this rank (a collective: every rank calls it).

    The ``ep`` ranks exchange tokens: neighbours on the data axis at this rank's context and
    tensor coordinates. The replica group holds the same experts and sums their gradients:
    ``dp_replica`` × ``cp``, since context ranks see other tokens of the same samples (their
    gradients add up like the data ranks'). Tensor ranks are in neither: each computes the same
    experts on the same (replicated) tokens, so their gradients are already equal."""
    from lightning_3d.layout import EXPERT_AXES, build_expert_mesh

    expert_mesh = build_expert_mesh(mesh, expert)
    if expert_mesh.size(EXPERT_AXES.index("cp")) == 1:
        return expert_mesh["ep"], expert_mesh["dp_replica"].get_group()
    # Flattened once per call; the mesh keeps it (every rank flattens alike).
    replicas = expert_mesh["dp_replica", "cp"]._flatten("dp_replica_cp")
    return expert_mesh["ep"], replicas.get_group()


def shard_expert_weight(
    full: Tensor, ep_mesh: DeviceMesh, replica_group: Any, data_group: Any, data_size: int
) -> nn.Parameter:
    """This rank's slice (dim 0, the expert) of the grouped weight ``full``, as a ``DTensor``
    parameter sharded on ``ep_mesh`` whose gradient is summed over ``replica_group`` and divided
    by ``data_size`` (the module's docstring). The first data rank's ``full`` is everyone's,
    whatever each rank was seeded with (a broadcast over ``data_group``)."""
    with torch.no_grad():
        dist.broadcast(full.data, src=dist.get_global_rank(data_group, 0), group=data_group)
    local = full.detach().chunk(ep_mesh.size(), dim=0)[ep_mesh.get_local_rank()].clone()
    param = nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False))
    # Kept on the parameter: a ZeRO 1-2 engine that buckets it over the replica group takes the
    # reduction over and removes the hook (parallel/expert_zero.py).
    param.replica_sum = param.register_hook(_sum_over_replicas(replica_group, data_size))
    return param


def _sum_over_replicas(group: Any, data_size: int) -> Any:
    """The gradient hook of an expert weight: sum over the ranks holding the same experts, then
    divide by the data size (the engines' average, which leaves these weights alone). A tensor
    hook, not a post-accumulate one: it sees each backward's own gradient, so accumulated
    micro-batches are each reduced once."""

    def hook(grad: Tensor) -> Tensor:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local = local.clone()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(local, group=group)
        local.div_(data_size)
        if isinstance(grad, DTensor):
            return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return local

    return hook


@contextmanager
def set_aside(
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    recorded: Optional[list[list[nn.Parameter]]] = None,
) -> Iterator[None]:
    """Within the block, ``optimizer``'s param groups lack ``params`` (so a ZeRO 0-2 engine
    attached here never buckets them); afterwards each is back at the end of its group.
    ``recorded``: the engine's ``original_groups``, whose entries for these groups (the last
    ones, recorded in the block) get the groups as the user built them back, so consolidated
    checkpoints index the optimizer state as one process does."""
    aside = {id(p) for p in params}
    before = [list(group["params"]) for group in optimizer.param_groups]
    removed = []
    for group in optimizer.param_groups:
        removed.append([p for p in group["params"] if id(p) in aside])
        group["params"] = [p for p in group["params"] if id(p) not in aside]
    try:
        yield
    finally:
        for group, back in zip(optimizer.param_groups, removed):
            group["params"] = list(group["params"]) + back
        if recorded is not None and params:
            recorded[len(recorded) - len(before) :] = before
