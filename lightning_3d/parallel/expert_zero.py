"""ZeRO 1-2 for expert weights: their optimizer state (fp32 masters under ``bf16-true``, and at
stage 2 their gradients) split over the ranks that hold the same experts, by a second flat-bucket
engine (``zero.py``) on the same optimizer.

Expert parallelism (``expert.py``) leaves each rank the whole ``ep`` slice of every expert weight
(a ``DTensor`` sharded on ``ep``), and the data-parallel engine leaves those weights alone: they
are set aside while it attaches, because their gradient is not the data mean the engine takes
(it is summed over the replica group, ``dp_replica`` × ``cp``, and divided by the data size
``G``: the tokens of the whole ``ep`` group reached the expert already). Stepped whole, each rank
would keep AdamW's 8 bytes per element of its ``ep`` slice: ``Ψ_e / ep`` elements, not
``Ψ_e / G`` (and under ``bf16-true`` no fp32 masters at all). Why a second engine:

- **The reduction is the engine's own, over another group.** Its buckets hold the experts' local
  (``ep``-slice) tensors and its mesh is (replica, ``ep``) (:func:`build_expert_zero_mesh`, a
  mesh of its own: the flattened replica axis cannot be sliced off the expert mesh beside
  ``ep``): it reduce-scatters over the replica group and divides by ``G`` (``divide``), instead
  of the tensor hook that all-reduced and divided (``_sum_over_replicas``, removed here: one
  reduction, not two). Stage 1 keeps full-size
  gradient buckets and reduces once per step, stage 2 reduce-scatters every backward; the stepped
  slices are all-gathered back into the ``ep``-local weights after the step.
- **One optimizer.** Its param groups end up holding both engines' slices; an expert slice is a
  ``DTensor`` sharded on both axes of (replica, ``ep``), so clipping by the global norm counts
  every expert element once (``clip.py`` reduces over each mesh dimension a gradient is sharded
  on), and LR schedulers keep steering the same groups.
- **Every per-step call reaches it.** The strategy calls ``prepare_backward`` / ``finish_backward``
  on every engine of the record (it is listed there after the data-parallel engine); the
  data-parallel engine's ``after_step`` calls its ``after_step``; checkpoints read its slices
  through the data-parallel engine's ``experts`` (``checkpoint/consolidated.py``,
  ``checkpoint/sharded.py``); fp32 masters are saved and loaded like the other engines'.

With ``expert`` = data (a replica group of one rank) there is nothing to split: the experts keep
their hook and are stepped whole, as at ZeRO-0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lightning_3d.parallel.expert import set_aside
from lightning_3d.parallel.zero import ZeroDataParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def build_expert_zero_mesh(mesh: DeviceMesh, expert: int) -> Optional[DeviceMesh]:
    """The 2-D (replica, ``ep``) mesh the experts' engine shards over, or ``None`` where the
    replica group is one rank (nothing to split). ``mesh``: the ``build_mesh`` mesh. Replica
    first (``dp_replica``, flattened with ``cp`` when the context axis is used; the engine shards
    over its first axis), then ``ep``; ranks as ``layout.build_expert_mesh`` places them.

    A collective: every rank builds it, with or without expert weights of its own (a pipeline
    stage may hold none). A mesh of its own, over every rank (pp and tp outermost, unused), not a
    slice of the ``ep`` weights' mesh: the flattened replica axis interleaves with ``ep`` there,
    which slicing cannot express."""
    from torch.distributed.device_mesh import DeviceMesh

    pp, dp, cp, tp = mesh.mesh.shape
    replicas = dp // expert * cp
    if expert == 1 or replicas == 1:
        return None
    ranks = mesh.mesh.reshape(pp, dp // expert, expert, cp, tp)  # build_expert_mesh's placement
    ranks = ranks.permute(0, 4, 1, 3, 2).reshape(pp, tp, replicas, expert)
    name = "dp_replica" if cp == 1 else "dp_replica_cp"
    built = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("pp", "tp", name, "ep"))
    return built[name, "ep"]


def attach_expert_zero(
    optimizer: torch.optim.Optimizer,
    engine: ZeroDataParallel,
    experts: list[nn.Parameter],
    mesh: Optional[DeviceMesh],
    **engine_kwargs: Any,
) -> Optional[ZeroDataParallel]:
    """Bucket ``optimizer``'s expert weights (of ``experts``, ``apply_expert_parallel``'s) over
    ``mesh`` (:func:`build_expert_zero_mesh`), in a second engine of ``engine``'s stage, after
    ``engine`` has attached with them set aside. Returns that engine (also ``engine.experts``),
    or ``None`` where the experts stay whole: ZeRO-0, no mesh (a replica group of one rank), or
    no expert weight in this optimizer. ``engine_kwargs``: the data-parallel engine's bucket size
    and master options. The summed gradient is divided by ``engine``'s data size, as every other
    gradient is."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    mine = [p for p in experts if id(p) in stepped and p.requires_grad]
    if engine.stage == 0 or mesh is None or not mine:
        return None
    expert_engine = ZeroDataParallel(mesh, engine.stage, divide=engine.size, **engine_kwargs)
    wanted = {id(p) for p in mine}
    others = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in wanted]
    # Within the block each param group holds its expert weights only; afterwards their slices
    # come first, then the data-parallel engine's.
    with set_aside(optimizer, others):
        expert_engine.attach(optimizer)
    for p in mine:  # the engine reduces them now (the module's docstring)
        p.replica_sum.remove()
    engine.experts = expert_engine
    return expert_engine
