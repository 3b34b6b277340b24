"""``validate=true``: build the planner's choice the way a run would, at its real world size, in
one process, and hold every rank kind against the prediction.

Each representative rank (see :func:`rank_kinds`) is built in a fake world of the layout's full
size (``torch``'s ``"fake"`` backend: groups exist, collectives move nothing) from a fresh
``meta`` model, through the run's own code: :func:`~lightning_3d.layout.build_mesh`,
:func:`~lightning_3d.strategy.recipe.parallelize` (pipeline split, tensor parallelism, activation
checkpointing, FSDP2, the pipeline runtime) and :func:`~lightning_3d.strategy.recipe.attach_optimizers`
(the ZeRO 0-2 engines). Then the gradients are put where a backward leaves them (the engines'
own ``finish_backward`` for ZeRO 0-2; a tensor like each parameter, as autograd or FSDP2's
reduce-scatter leaves it, otherwise) and the optimizer steps once, on ``meta``, so its state
exists with the shapes and shards a run would give it. Nothing is allocated: a 70B model at
1,024 ranks is built in seconds and a few hundred MB.

Checked on each built rank:

* **shapes**: the rank holds exactly the parameters the planner assigns to its pipeline stage
  (:func:`lightning_3d.parallel.stages.stage_blocks`, embeddings first, norm and head last),
  each with the whole model's global shape, and the local shape the planner assumes: the
  parameters the tensor-parallel plan splits divided by ``tensor`` along their sharded dim, the
  rest whole, and under ZeRO-3 dim 0 chunked over ``data`` (``torch.chunk``, as FSDP2 does);
* **placements**: split parameters are ``Shard`` on the ``tp`` axis and the others not;
  ZeRO-3 parameters ``Shard(0)`` on ``dp``; ZeRO 0-2 parameters carry no ``dp`` placement, every
  one sits in exactly one flat bucket, and (stages 1-2) the optimizer steps ``Shard(0)`` slices
  of ``1 / data`` of each bucket;
* **bytes**: parameters, gradients and optimizer state of the rank (each storage once: a bucket
  counts whole, its views not again; a DTensor its local shard) against
  :func:`lightning_3d.planner.memory.predicted_rank`, within ``TOLERANCE``;
* **the activation prediction's premises**: activation bytes cannot be counted on ``meta``
  (every storage has address 0, and nothing runs), and the planner's figure is already the run's
  own meter on one block (:mod:`lightning_3d.planner.activations`). So what is checked is that
  the block it measured has the local shapes of this rank's blocks, and that the blocks are
  checkpointed as the policy says; the predicted peak is printed beside the table.

Models are built with ``device=meta``, which the recipe takes as "shapes only": it skips
materialising the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_3d.layout import MeshAxis
from lightning_3d.parallel.stages import pipeline_spec, plan_stages, stage_blocks, stage_ids
from lightning_3d.parallel.tensor import local_tensor as _local
from lightning_3d.planner.choice import Choice
from lightning_3d.planner.facts import ModelFacts
from lightning_3d.planner.memory import ratio

TOLERANCE = 0.10  # |predicted / built - 1| allowed per quantity
QUANTITIES = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
BUILD_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


@dataclass(frozen=True)
class RankKind:
    """One representative rank: its mesh coordinates and why it stands for others."""

    rank: int
    stage: int
    dp_rank: int
    tp_rank: int
    label: str
    cp_rank: int = 0
    # Index on ZeRO's axis: data x context flattened (``dp_cp``, data outer), or data alone.
    shard_rank: int = 0


@dataclass(frozen=True)
class Built:
    """What the recipe built on one rank: its bytes and what its shapes and placements got wrong."""

    kind: RankKind
    bytes: dict[str, int]
    tensors: int  # parameters checked
    problems: tuple[str, ...]


def rank_kinds(choice: Choice, n_layer: int) -> list[RankKind]:
    """Representative ranks: one per kind of pipeline stage, at both corners of its data x tensor grid.

    Pipeline stages differ in what they hold: the first has the embeddings, the last the norm
    and head, the ones between only blocks; stages with the same block count and the same ends
    are alike, so one of each such kind is built. Within a stage, tensor ranks hold equal shapes
    when every split dim divides by ``tensor`` (the shape check says so where it does not), and
    data ranks differ only at the end of an uneven split: FSDP2 chunks dim 0 with ``torch.chunk``
    (the last ranks get the short or empty chunk), and a ZeRO 0-2 bucket's padding sits in the
    last rank's slice. So each stage kind is built at its first corner (dp 0, tp 0) and at its
    last (dp -1, tp -1). ``torch.chunk``'s chunks never grow with the rank, so every other data
    rank's bytes lie between those of the two corners (a middle rank can hold a third chunk size
    of a small parameter; it is checked by the same rule wherever it is built). Context ranks
    hold the same layers as data ranks and ZeRO shards over both (data outer), so the corners
    are (dp 0, cp 0, tp 0) and (dp -1, cp -1, tp -1) of the mesh ``(pp, dp, cp, tp)``."""
    dp, tp, pp, v = choice.data, choice.tensor, choice.pipeline, choice.virtual_stages
    cp = choice.context
    runs = stage_blocks(n_layer, pp * v)
    kinds, seen = [], set()
    for stage in range(pp):  # a pipeline rank with its virtual stages
        blocks = sum(len(runs[s]) for s in stage_ids(stage, pp, v))
        key = (blocks, stage == 0, stage == pp - 1)
        if key in seen:
            continue
        seen.add(key)
        ends = [
            name for name, here in (("embeddings", stage == 0), ("head", stage == pp - 1)) if here
        ]
        what = f"stage {stage}/{pp}: {blocks} blocks" + "".join(f" + {e}" for e in ends)
        for d, c, t in dict.fromkeys(((0, 0, 0), (dp - 1, cp - 1, tp - 1))):
            rank = ((stage * dp + d) * cp + c) * tp + t  # mesh (pp, dp, cp, tp), tensor innermost
            on_cp = f", cp {c}/{cp}" if cp > 1 else ""
            label = f"{what}, dp {d}/{dp}{on_cp}, tp {t}/{tp}"
            kinds.append(RankKind(rank, stage, d, t, label, c, d * cp + c))
    return kinds


@dataclass(frozen=True)
class Reference:
    """The whole model's parameter shapes and the planner's assumptions about them."""

    shapes: dict[str, tuple[int, ...]]
    stage_names: list[set[str]]  # parameter names the planner puts on each pipeline stage
    split: set[str]  # names the tensor-parallel plan splits (the planner's ``Part.split``)
    # The block activations were measured on, by name in it.
    measured_block: Optional[dict[str, tuple[int, ...]]]


def reference(module: nn.Module, choice: Choice) -> Reference:
    """What one process's whole model (built on ``meta``) says each stage should hold, and the
    local shapes of the block the planner measured activation bytes on (``None``: estimated)."""
    from lightning_3d.parallel.activation_checkpoint import transformer_blocks
    from lightning_3d.planner.activations import local_block
    from lightning_3d.planner.facts import split_dims

    pipeline = choice.pipeline
    dims, columns = split_dims(module)
    split = set(dims)
    name, block = transformer_blocks(module)[0]
    # As lightning_3d.planner.facts measures it.
    local = local_block(block, name, split, columns, choice.tensor)
    measured = (
        {n: tuple(p.shape) for n, p in local.named_parameters()} if local is not None else None
    )
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    if pipeline == 1:
        stages = [set(shapes)]
    else:
        spec = pipeline_spec(module)
        virtual = choice.virtual_stages
        # The uniform split the run (and the planner) uses, its stage s on pipeline rank s % pipeline.
        runs = plan_stages(module, spec, pipeline * virtual, "uniform", virtual)
        stages = []
        for rank in range(pipeline):
            prefixes = []
            for s in stage_ids(rank, pipeline, virtual):
                prefixes += [f"{spec.blocks}.{i}" for i in runs[s]]
                prefixes += list(spec.first) if s == 0 else []
                prefixes += list(spec.last) if s == len(runs) - 1 else []
            stages.append(
                {n for n in shapes if any(n == p or n.startswith(p + ".") for p in prefixes)}
            )
    return Reference(shapes, stages, split, measured)


def check_choice(choice: Choice, precision: str) -> None:
    """``ValueError`` for a choice this validation does not build (before any work starts)."""
    if choice.offload != "none":
        raise ValueError(
            f"validate=true builds layouts without offload, the choice has offload={choice.offload!r}; "
            "pin planner.offloads=[none] to validate"
        )
    if precision not in BUILD_PRECISIONS:
        raise ValueError(
            f"validate=true cannot build precision={precision!r}; one of {list(BUILD_PRECISIONS)}"
        )


def build_rank(
    make_module: Callable[[], nn.Module],
    choice: Choice,
    kind: RankKind,
    ref: Reference,
    precision: str,
) -> Built:
    """Build ``kind``'s rank of ``choice`` in a fake world (see the module docstring) and inspect it."""
    from lightning_3d.layout import build_mesh
    from lightning_3d.options import Plan
    from lightning_3d.parallel.fake_world import fake_world
    from lightning_3d.strategy.recipe import attach_optimizers, parallelize

    world = choice.world_size
    module = make_module()
    if precision == "bf16-true":  # Lightning's precision plugin converts the module before setup
        module = module.to(torch.bfloat16)
    with fake_world(kind.rank, world):
        plan = Plan.from_options(**choice.options()).resolved(world)
        # The device type names the mesh; shapes do not depend on it.
        mesh = build_mesh(plan.layout, "cpu")
        made = parallelize(module, mesh, plan, device=torch.device("meta"), precision=precision)
        optimizers = attach_optimizers(made, _optimizers(module), plan)
        _backward_and_step(made, optimizers)
        tp_local: dict[str, tuple[int, ...]] = {}
        problems = list(_shape_problems(module, choice, kind, ref, tp_local))
        problems += _bucket_problems(made, module, choice)
        problems += _block_problems(module, choice, kind, ref, tp_local)
        nbytes = _rank_bytes(made, module, optimizers)
    return Built(kind, nbytes, sum(1 for _ in module.parameters()), tuple(problems))


def _optimizers(module: nn.Module) -> list[torch.optim.Optimizer]:
    """The module's own optimizers (``configure_optimizers``); a plain AdamW where that needs a
    Trainer (a schedule horizon from ``trainer.estimated_stepping_batches``, say)."""
    try:
        out: Any = module.configure_optimizers()
    except (RuntimeError, AttributeError):
        out = None
    if isinstance(out, dict):
        out = out.get("optimizer")
    if isinstance(out, (list, tuple)):
        out = out[0] if out and isinstance(out[0], (list, tuple)) else out
    if isinstance(out, torch.optim.Optimizer):
        return [out]
    if (
        isinstance(out, (list, tuple))
        and all(isinstance(o, torch.optim.Optimizer) for o in out)
        and out
    ):
        return list(out)
    return [torch.optim.AdamW([p for p in module.parameters() if p.requires_grad])]


@torch.no_grad()
def _backward_and_step(made: Any, optimizers: list[torch.optim.Optimizer]) -> None:
    """Gradients where one backward leaves them, then one optimizer step (state on ``meta``)."""
    for engine in made.engines:
        engine.prepare_backward(sync=True)
    bucketed = {id(p) for engine in made.engines for b in engine.buckets for p in b.params}
    for p in made.module.parameters():
        if p.requires_grad and id(p) not in bucketed:  # autograd's (or FSDP2's sharded) gradient
            p.grad = torch.zeros_like(p)
    for engine in made.engines:
        engine.finish_backward()  # ZeRO 0-2: reduce the buckets, hand the optimizer its gradients
    for optimizer in optimizers:
        optimizer.step()


def _axis_placements(p: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return {}
    return dict(zip(p.device_mesh.mesh_dim_names or (), p.placements))


def _shard_axis(choice: Choice) -> str:
    """The mesh axis ZeRO shards over (:func:`lightning_3d.layout.shard_mesh`): data, or data x
    context flattened into ``dp_cp`` when the layout splits sequences."""
    data = MeshAxis.DATA.value
    return f"{data}_{MeshAxis.CONTEXT.value}" if choice.context > 1 else data


def _shard_dim(placement: Any) -> Optional[int]:
    """The tensor dim a placement shards (``Shard`` or FSDP2's ``_StridedShard`` over a tensor-parallel
    shard of the same dim); ``None`` for none, ``Replicate`` or ``Partial``."""
    if placement is None or placement.is_replicate() or placement.is_partial():
        return None
    return getattr(placement, "dim", None)


def _shape_problems(
    module: nn.Module,
    choice: Choice,
    kind: RankKind,
    ref: Reference,
    tp_local: dict[str, tuple[int, ...]],
) -> Iterator[str]:
    """Names, global and local shapes, and tensor / ZeRO-3 placements against the planner's
    assumptions; ``tp_local`` receives each parameter's shape on its tensor rank (before ZeRO-3)."""
    where = f"rank {kind.rank} ({kind.label})"
    expected = ref.stage_names[kind.stage]
    names = {n for n, _ in module.named_parameters()}
    missing, extra = sorted(expected - names), sorted(names - expected)
    if missing or extra:
        yield (
            f"{where} holds other parameters than the planner's stage {kind.stage}: missing {missing[:3]}"
            f"{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}"
        )
    tp_axis, dp_axis = MeshAxis.TENSOR.value, _shard_axis(choice)
    experts = _expert_params(module, choice)
    for name, p in module.named_parameters():
        if name not in ref.shapes:
            continue
        full, placements = ref.shapes[name], _axis_placements(p)
        if tuple(p.shape) != full:
            yield f"{where}: {name} has global shape {tuple(p.shape)}, the model's is {full}"
            continue
        if id(p) in experts:
            # The activations were measured on the whole block: the expert axis moves token
            # rows between ranks, not the bytes a rank keeps of them (an even router).
            tp_local[name] = full
            yield from _expert_problems(where, name, p, full, choice, kind)
            continue
        local = list(full)
        on_tp = placements.get(tp_axis)
        if name in ref.split and choice.tensor > 1:
            if _shard_dim(on_tp) is None:
                yield f"{where}: {name} is split by the tensor-parallel plan but placed {on_tp} on tp"
                continue
            dim = on_tp.dim
            if full[dim] % choice.tensor:
                yield f"{where}: {name} dim {dim} ({full[dim]}) does not divide by tensor={choice.tensor}"
                continue
            local[dim] //= choice.tensor
        elif on_tp is not None and not on_tp.is_replicate():
            yield f"{where}: {name} is not split by the plan but placed {on_tp} on tp"
            continue
        tp_local[name] = tuple(local)
        on_dp = placements.get(dp_axis)
        if choice.zero_stage == 3:
            if _shard_dim(on_dp) != 0:
                yield f"{where}: {name} under ZeRO-3 is placed {on_dp} on {dp_axis}, not sharded on dim 0"
                continue
            chunk = math.ceil(local[0] / (choice.data * choice.context))
            local[0] = max(0, min(chunk, local[0] - kind.shard_rank * chunk))
        elif on_dp is not None:
            yield (
                f"{where}: {name} under ZeRO {choice.zero_stage} is placed {on_dp} on {dp_axis} "
                "(parameters stay whole)"
            )
            continue
        if tuple(_local(p).shape) != tuple(local):
            yield f"{where}: {name} has local shape {tuple(_local(p).shape)}, the planner assumes {tuple(local)}"


def _expert_params(module: nn.Module, choice: Choice) -> set[int]:
    """Ids of the expert weights an expert axis splits (none at ``expert`` = 1)."""
    from lightning_3d.parallel.expert import moe_layers

    if choice.expert == 1:
        return set()
    return {id(p) for layer in moe_layers(module) for p in layer.experts.parameters()}


def _expert_problems(
    where: str, name: str, p: torch.Tensor, full: tuple, choice: Choice, kind: RankKind
) -> Iterator[str]:
    """An expert weight against ``planner/expert_memory.py``: dim 0 (the expert) split over
    ``ep``, never over the tensor ranks, and at ZeRO-3, where the planner's rule shards the
    experts over their replica group, chunked over it as FSDP2 chunks it (dim 0 where this
    rank's experts divide over the replicas, else dim 1: ``parallel/expert_fsdp.py``)."""
    from lightning_3d.planner.expert_memory import replica_rank, replica_size, resolve

    on_ep = _axis_placements(p).get("ep")
    if _shard_dim(on_ep) != 0:
        yield f"{where}: {name} is an expert weight placed {on_ep} on ep, not sharded on dim 0"
        return
    local = [full[0] // choice.expert, *full[1:]]
    replicas = replica_size(choice)
    if choice.zero_stage == 3 and resolve(None, 3) and replicas > 1:
        dim = 0 if local[0] % replicas == 0 else 1
        chunk = math.ceil(local[dim] / replicas)
        at = replica_rank(choice, kind.shard_rank) * chunk
        local[dim] = max(0, min(chunk, local[dim] - at))
    if tuple(_local(p).shape) != tuple(local):
        yield f"{where}: {name} has local shape {tuple(_local(p).shape)}, the planner assumes {tuple(local)}"


def _block_problems(
    module: nn.Module,
    choice: Choice,
    kind: RankKind,
    ref: Reference,
    tp_local: dict[str, tuple[int, ...]],
) -> list[str]:
    """The premises of the activation prediction: this rank's blocks recompute (or not) as the
    policy says, and its first block has the local shapes the activation bytes were measured on."""
    from lightning_3d.parallel.activation_checkpoint import is_checkpointed, transformer_blocks

    blocks = transformer_blocks(module)
    where = f"rank {kind.rank} ({kind.label})"
    wanted = choice.ac_policy != "none"
    out = [
        f"{where}: block {name} is {'' if is_checkpointed(b) else 'not '}checkpointed under "
        f"ac_policy={choice.ac_policy!r}"
        for name, b in blocks
        if is_checkpointed(b) != wanted
    ]
    if blocks and ref.measured_block is not None:
        name, block = blocks[0]
        built = {n: tp_local.get(f"{name}.{n}") for n, _ in block.named_parameters()}
        if built != ref.measured_block:
            out.append(
                f"{where}: block {name} has local shapes {built}, activation bytes were measured on "
                f"{ref.measured_block}"
            )
    return out


def _bucket_problems(made: Any, module: nn.Module, choice: Choice) -> list[str]:
    """ZeRO 0-2: every trained parameter in one bucket; stages 1-2 step ``1 / data`` slices on dp."""
    if choice.zero_stage == 3 or not made.engines:
        return []
    engines = made.engines
    # One rank per dp x tp group, nothing shared: no buckets.
    if all(e.passthrough for e in engines):
        return []
    count: dict[int, int] = {}
    out = []
    # The expert weights' engines (parallel/expert_zero.py) shard over the experts' replicas.
    of_experts = {id(e.experts) for e in engines if e.experts is not None}
    for engine in engines:
        axis, shards = _shard_axis(choice), choice.data * choice.context
        if id(engine) in of_experts:
            axis, shards = engine.mesh.mesh_dim_names[0], engine.size
        for b in engine.buckets:
            for p in b.params:
                count[id(p)] = count.get(id(p), 0) + 1
            if choice.zero_stage >= 1:
                on_dp = _axis_placements(b.slice).get(axis)
                if _shard_dim(on_dp) != 0:
                    out.append(
                        f"a ZeRO-{choice.zero_stage} slice is placed {on_dp} on {axis}, not Shard(0)"
                    )
                if _local(b.slice).numel() * shards != b.flat.numel():
                    out.append(
                        f"a ZeRO-{choice.zero_stage} slice holds {_local(b.slice).numel()} of "
                        f"{b.flat.numel()} elements, not 1/{shards}"
                    )
    experts = _expert_params(module, choice)  # stepped by the expert axis's own engines
    for name, p in module.named_parameters():
        if p.requires_grad and count.get(id(p), 0) != 1 and id(p) not in experts:
            out.append(f"{name} is in {count.get(id(p), 0)} ZeRO buckets, not 1")
    return out


def _nbytes(tensors: Any, seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        local = _local(t)
        total += local.numel() * local.element_size()
    return total


def _rank_bytes(
    made: Any, module: nn.Module, optimizers: list[torch.optim.Optimizer]
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank keeps between steps.

    ``meta`` storages have no addresses, so storages are identified by what owns them: a ZeRO 0-2
    bucket counts its flat buffer (padding included) for its parameters and its gradient buffer
    (stages 0-1: full, stage 2: this rank's shard) for their gradients, whose views are not
    counted again; any other parameter or gradient counts its local tensor; the optimizer's
    state counts every tensor it holds."""
    buckets = [b for engine in made.engines for b in engine.buckets]
    bucketed = {id(p) for b in buckets for p in b.params}
    params = [p for p in module.parameters() if id(p) not in bucketed]
    grads = [p.grad for p in params]
    seen: set[int] = set()
    param_bytes = _nbytes(params, seen) + _nbytes((b.flat for b in buckets), seen)
    grad_bytes = _nbytes(grads, seen) + _nbytes(
        (b.grad if b.grad is not None else b.shard_grad for b in buckets), seen
    )
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values()]
    # ZeRO 0-2's fp32 masters of a bf16 module are optimizer state (the planner's 12 bytes).
    state += [b.master for b in buckets if b.master is not None]
    return {
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_state_bytes": _nbytes(state, seen),
        # Beside the model state, not held against the prediction (predicted_rank's docstring).
        "buffer_bytes": _nbytes(module.buffers(), seen),
    }


@dataclass(frozen=True)
class Row:
    kind: RankKind
    quantity: str
    predicted: float
    built: int

    @property
    def ratio(self) -> float:
        """predicted / built, as the calibration table prints it."""
        return ratio(self.predicted, self.built)

    @property
    def off(self) -> bool:
        return abs(self.ratio - 1) > TOLERANCE


def compare(facts: ModelFacts, choice: Choice, built: list[Built]) -> list[Row]:
    """One row per rank kind and quantity: the planner's per-rank prediction next to what was built."""
    from lightning_3d.planner.memory import predicted_rank

    rows = []
    for b in built:
        predicted = predicted_rank(facts, choice, b.kind.rank)
        rows += [Row(b.kind, q, predicted[q], b.bytes[q]) for q in QUANTITIES]
    return rows


def predicted_activations(
    facts: ModelFacts, choice: Choice, kinds: list[RankKind]
) -> dict[int, float]:
    """rank -> the planner's peak activation bytes for that rank's stage (not built: see the module docstring)."""
    from lightning_3d.planner.memory import activation_bytes, stage_parts

    parts = stage_parts(facts, choice.pipeline, choice.virtual_stages)
    return {k.rank: activation_bytes(facts, choice, k.stage, parts[k.stage][1]) for k in kinds}


def table(rows: list[Row], activations: Optional[dict[int, float]] = None) -> str:
    """Markdown: one line per rank kind and quantity (bytes in powers of 1000); then, if given,
    the predicted peak activations, whose premises (block shapes, checkpointing) were checked."""
    from lightning_3d.planner.memory import human

    lines = [
        "| rank | rank kind | quantity | predicted | built | predicted/built |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        flag = " ✗" if r.off else ""
        lines.append(
            f"| {r.kind.rank} | {r.kind.label} | {r.quantity} | {human(r.predicted)} | "
            f"{human(r.built)} | {r.ratio:.3f}{flag} |"
        )
    labels = {r.kind.rank: r.kind.label for r in rows}
    for rank, value in (activations or {}).items():
        lines.append(
            f"| {rank} | {labels.get(rank, '')} | activation_bytes (peak) | {human(value)} | "
            "not built (block shapes and checkpointing checked) | – |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Validation:
    kinds: list[RankKind]
    built: list[Built]
    rows: list[Row]
    activations: dict[int, float]  # rank -> predicted peak activation bytes

    @property
    def problems(self) -> list[str]:
        out = [p for b in self.built for p in b.problems]
        for r in self.rows:
            if r.off:
                out.append(
                    f"rank {r.kind.rank} ({r.kind.label}): {r.quantity} predicted {r.predicted:,.0f} B, "
                    f"built {r.built:,} B (ratio {r.ratio:.3f}, outside 1 ± {TOLERANCE:g})"
                )
        return out


def validate_layout(
    make_module: Callable[[], nn.Module], facts: ModelFacts, choice: Choice, precision: str
) -> Validation:
    """Build every rank kind of ``choice`` (``make_module()``: a fresh model on ``meta`` each
    call; the recipe rewrites it in place) and compare it with the planner's prediction. Raises
    nothing for a mismatch: :attr:`Validation.problems` lists them. ``ValueError`` for a choice
    it cannot build.

    Example::

        v = validate_layout(lambda: model_on_meta(cfg.model), facts, candidates[0].choice, "bf16-mixed")
        print(table(v.rows, v.activations)); assert not v.problems
    """
    check_choice(choice, precision)
    ref = reference(make_module(), choice)
    kinds = rank_kinds(choice, facts.n_layer)
    built = [build_rank(make_module, choice, kind, ref, precision) for kind in kinds]
    return Validation(
        kinds, built, compare(facts, choice, built), predicted_activations(facts, choice, kinds)
    )
