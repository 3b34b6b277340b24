"""ZeRO-3 for expert weights: each experts module an FSDP2 unit over the ranks that hold the
same experts, so its weights, gradients and optimizer state are split ``G`` ways, not ``ep``.

Expert parallelism (``parallel/expert.py``) leaves every rank with the whole ``ep`` slice of
each expert weight (a ``DTensor`` sharded on ``ep``). The ``G / ep`` ranks of its replica group
(``dp_replica``, × ``cp`` under context parallelism) hold that same slice and sum its gradient.
At ZeRO-3 the slice is split further over them, as torchtitan shards its MoE experts over the
data mesh "modulo ep": ``fully_shard`` of each experts module on the replica mesh. The expert
weight then is a 2-D ``DTensor`` on (replica, ``ep``); fp32 AdamW holds 16 Ψ_e / G bytes of it
per rank, like every other weight. Why these choices:

- **The reduction.** FSDP2 would average the gradient over the replica mesh; the experts need
  the sum over the replicas divided by the data size ``G`` (``expert.py``'s docstring: the
  tokens of the whole ``ep`` group reached the expert already). ``set_gradient_divide_factor(G)``
  asks for exactly that. Sums are forced for the collective itself (the division comes after,
  on this rank's shard): gloo has no pre-multiplied sum, and one code path serves both backends.
  FSDP2 replaces the parameter objects, so the tensor hook that reduced them before
  (``_sum_over_replicas``, on the old objects) no longer runs: one reduction, not two.
- **Where the split falls.** Dim 0 (the expert) when this rank's experts divide evenly over
  the replicas: FSDP2 records it as a strided shard inside the ``ep`` shard, and each rank
  holds whole experts. Otherwise dim 1 (torchtitan's choice when there are more ranks than
  experts): no padding of whole experts, no rank without one.
- **The unit.** The experts module alone, made before its block's unit (FSDP2 units are built
  inside out: the block's then leaves the experts' parameters to it). It regathers for backward
  like every block (``reshard_after_forward=True``), under the blocks' precision policy, and on
  gloo through the same point-to-point exchanges. Lightning's gradient accumulation, FSDP2's
  ``requires_gradient_sync`` and activation checkpointing reach it as a unit inside the block.
- **When there is nothing to split.** With ``expert`` = data (replica group of one rank) the
  experts keep their own hook and FSDP2 ignores them, as before.

Checkpoints: the weights and their optimizer state are ``DTensor`` s on the 2-D mesh; DCP writes
each rank's piece and ``full_tensor`` consolidates them, so a checkpoint saved here resumes at
other expert layouts (``tests/test_expert_zero3_sharding.py``: at ``expert`` = 1, and at
``expert`` = 2 on 2 and on 4 ranks, consolidated and sharded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import DTensor, Shard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def replica_mesh(weight: DTensor) -> DeviceMesh:
    """The ranks holding the same experts as this rank (``dp_replica``, flattened with ``cp``
    when the context axis is used), sliced from the root of ``weight``'s ``ep`` mesh (the
    ``layout.EXPERT_AXES`` mesh :func:`~lightning_3d.parallel.expert.expert_groups` built): FSDP2
    joins the two into the weight's 2-D mesh, which needs one root and makes no new group."""
    from lightning_3d.layout import EXPERT_AXES

    root = weight.device_mesh._get_root_mesh()
    if root.size(EXPERT_AXES.index("cp")) == 1:
        return root["dp_replica"]
    # expert_groups flattened it already on this root: the same mesh and group again.
    return root["dp_replica", "cp"]._flatten("dp_replica_cp")


def experts_owners(module: nn.Module, experts: list[nn.Parameter]) -> list[nn.Module]:
    """The modules that hold ``experts`` as their own parameters, in module order."""
    wanted = {id(p) for p in experts}
    return [
        owner
        for owner in module.modules()
        if any(id(p) in wanted for p in owner.parameters(recurse=False))
    ]


def shard_placement(param: nn.Parameter, replicas: int) -> Shard:
    """Where the replicas split one expert weight (this rank's ``ep`` slice, expert first): the
    expert dim when its experts divide evenly over them, else dim 1 (module docstring)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return Shard(0) if local.shape[0] % replicas == 0 else Shard(1)


def apply_expert_zero3(
    module: nn.Module,
    experts: list[nn.Parameter],
    data_size: int,
    scatter: str = "auto",
    **fsdp_kwargs: Any,
) -> list[nn.Parameter]:
    """Make each module holding ``experts`` (``apply_expert_parallel``'s ep-sharded weights) an
    FSDP2 unit over its replica group; call it before the blocks' units (:func:`~lightning_3d.
    parallel.fsdp.apply_zero3`). ``data_size``: ``G``, the
    ranks the other gradients are averaged over; ``fsdp_kwargs``: the blocks' precision policy.
    Returns the expert weights left to their own gradient hook, which the blocks' units must
    ignore: none once sharded, all of them where the replica group is one rank."""
    from torch.distributed.fsdp import fully_shard

    from lightning_3d.parallel.point_to_point import (
        GatherInPlace,
        ScatterToOwners,
        use_point_to_point,
    )

    if not experts:  # expert = 1: no expert weight of its own
        return []
    replicas = replica_mesh(experts[0])
    if replicas.size() == 1:
        return list(experts)
    point_to_point = use_point_to_point(replicas.get_group(), scatter)
    for owner in experts_owners(module, experts):
        placements = {id(p): shard_placement(p, replicas.size()) for p in owner.parameters()}
        fully_shard(
            owner,
            mesh=replicas,
            reshard_after_forward=True,
            shard_placement_fn=lambda p, placements=placements: placements[id(p)],
            **fsdp_kwargs,
        )
        # Sum over the replicas, then / G: the expert's share of one process's gradient.
        owner.set_gradient_divide_factor(float(data_size))
        owner.set_force_sum_reduction_for_comms(True)
        if point_to_point:
            owner.set_custom_all_gather(GatherInPlace())
            owner.set_custom_reduce_scatter(ScatterToOwners())
    return []
