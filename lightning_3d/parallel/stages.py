"""Which blocks each pipeline stage holds, and cutting a model down to this rank's stages.

Three ways to split a model's ``nn.ModuleList`` of blocks into contiguous stages:

* ``"uniform"`` (default): by block count; earlier stages take the remainder.
* ``"params"``: balanced by parameter count, counting the embedding on the first stage and the
  final norm and head on the last, so the heavy ends get fewer blocks.
* explicit split points: the names of the blocks that *start* stages 1, 2, ... (one name per
  stage boundary), e.g. ``["model.blocks.3"]`` for two stages of a 6-block model.

:func:`plan_stages` only reads the model (it works on a ``meta`` model, before any process does
work); :func:`split_stages` then keeps this rank's stages in place, and :func:`split_pipeline`
does both for the recipe, with the process groups of the weights tied across stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

from torch import nn

from lightning_3d.layout import MeshAxis
from lightning_3d.parallel.tied import TiedGroups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

SPLITS = ("uniform", "params")
Split = Union[str, Sequence[str]]


def stage_blocks(num_blocks: int, num_stages: int) -> list[range]:
    """Uniform split by block count: stage s gets a contiguous run; earlier stages get the extra."""
    if num_stages > num_blocks:
        raise ValueError(
            f"{num_stages} pipeline stages for {num_blocks} blocks: need at least one block per stage"
        )
    base, extra = divmod(num_blocks, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def balanced_blocks(
    block_costs: Sequence[int], num_stages: int, first_cost: int = 0, last_cost: int = 0
) -> list[range]:
    """Contiguous runs (at least one block each) minimising the largest stage cost, where the
    first stage also carries ``first_cost`` and the last ``last_cost``. Exact (dynamic program);
    ties go to the earliest boundary."""
    n = len(block_costs)
    stage_blocks(n, num_stages)  # the same "too many stages" error
    prefix = [0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> int:  # stage s holds blocks i..j-1
        return (
            prefix[j]
            - prefix[i]
            + (first_cost if s == 0 else 0)
            + (last_cost if s == num_stages - 1 else 0)
        )

    inf = float("inf")
    # best[s][j]: smallest max-cost for stages 0..s covering blocks 0..j-1; cut[s][j]: start of stage s.
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], cost(s, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [n], n
    for s in range(num_stages - 1, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def explicit_blocks(
    blocks_name: str,
    num_blocks: int,
    points: Sequence[str],
    num_stages: int,
    exists: Callable[[str], bool],
) -> list[range]:
    """Runs from split-point names: each names the block that starts the next stage."""
    if len(points) != num_stages - 1:
        raise ValueError(
            f"{len(points)} split point(s) {list(points)} for {num_stages} pipeline stages: "
            f"give {num_stages - 1} (the first block of each stage after the first)"
        )
    starts = []
    for name in points:
        prefix = f"{blocks_name}."
        index = name[len(prefix) :] if name.startswith(prefix) else ""
        if not index.isdigit() or int(index) >= num_blocks:
            what = (
                "is not a block of" if exists(name) else "names no module in the model; blocks are"
            )
            raise ValueError(
                f"pipeline split point {name!r} {what} {blocks_name!r} "
                f"({blocks_name}.0 ... {blocks_name}.{num_blocks - 1})"
            )
        starts.append(int(index))
    if starts[0] == 0 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(
            f"pipeline split points {list(points)} must be increasing blocks after {blocks_name}.0"
        )
    bounds = [0, *starts, num_blocks]
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def validate_split(split: Any) -> Split:
    """Check the ``split`` option's type before any process exists (names are checked on the model)."""
    if isinstance(split, str):
        if split not in SPLITS:
            raise ValueError(
                f"unknown pipeline split {split!r}; use one of {list(SPLITS)} or a list of block names"
            )
        return split
    if isinstance(split, Sequence) and split and all(isinstance(x, str) for x in split):
        return tuple(split)
    raise ValueError(
        f"pipeline split {split!r} must be one of {list(SPLITS)} or a non-empty list of block names"
    )


def _numel(modules: Sequence[nn.Module]) -> int:
    seen = {id(p): p.numel() for m in modules for p in m.parameters()}
    return sum(seen.values())


def plan_stages(
    root: nn.Module, spec: Any, num_stages: int, split: Split = "uniform", virtual: int = 1
) -> list[range]:
    """Block runs of every stage of ``root`` (read-only; works on a ``meta`` model).

    Raises ``ValueError`` for a blocks name that is not an ``nn.ModuleList``, first/last module
    names that do not exist, more stages than blocks and bad split points. A block count the
    stages do not divide is split unevenly, also under the interleaved schedules (``virtual >
    1``): torch's schedules only need every stage to pass on the same activation shape, which a
    block keeps, so a rank's chunks may differ by a block. Tied weights across stages are fine
    (see :func:`tied_stages`)."""
    blocks = root.get_submodule(spec.blocks)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(
            f"pipeline blocks {spec.blocks!r} must name an nn.ModuleList, found {type(blocks).__name__}"
        )
    first = [_module(root, n, "first") for n in spec.first]
    last = [_module(root, n, "last") for n in spec.last]
    if split == "uniform":
        runs = stage_blocks(len(blocks), num_stages)  # first: "more stages than blocks"
    elif split == "params":
        runs = balanced_blocks(
            [_numel([b]) for b in blocks], num_stages, _numel(first), _numel(last)
        )
    else:
        runs = explicit_blocks(
            spec.blocks, len(blocks), list(split), num_stages, lambda n: _exists(root, n)
        )
    return runs


def _module(root: nn.Module, name: str, where: str) -> nn.Module:
    if not _exists(root, name):
        raise ValueError(
            f"pipeline spec: {where}-stage module {name!r} names no module of {type(root).__name__}"
        )
    return root.get_submodule(name)


def _exists(root: nn.Module, name: str) -> bool:
    try:
        root.get_submodule(name)
    except AttributeError:
        return False
    return True


def tied_stages(root: nn.Module, spec: Any, runs: list[range]) -> dict[str, set[int]]:
    """For each parameter used on more than one stage (e.g. an input embedding tied to the
    output head), its name in ``root`` and the stages that use it. Each such stage keeps a copy;
    the strategy sums their gradients (``parallel/tied.py``)."""
    blocks = root.get_submodule(spec.blocks)
    name_of = {id(p): n for n, p in root.named_parameters()}
    named: list[tuple[int, nn.Module]] = [(0, root.get_submodule(n)) for n in spec.first]
    named += [(s, blocks[i]) for s, run in enumerate(runs) for i in run]
    named += [(len(runs) - 1, root.get_submodule(n)) for n in spec.last]
    used: dict[int, set[int]] = {}
    for stage, module in named:
        for p in module.parameters():
            used.setdefault(id(p), set()).add(stage)
    return {name_of[key]: stages for key, stages in used.items() if len(stages) > 1}


def tied_holders(
    root: nn.Module, spec: Any, pp_size: int, virtual: int, split: Split = "uniform"
) -> dict[str, list[int]]:
    """:func:`tied_stages` as pipeline ranks (looped placement: stage s is on rank s mod pp)."""
    runs = plan_stages(root, spec, pp_size * virtual, split, virtual)
    return {
        name: sorted({s % pp_size for s in stages})
        for name, stages in tied_stages(root, spec, runs).items()
    }


def stage_ids(pp_rank: int, pp_size: int, virtual: int) -> list[int]:
    """Stages held by ``pp_rank``: looped placement, rank r holds r, r + pp, r + 2pp, ..."""
    return [pp_rank + v * pp_size for v in range(virtual)]


class StageModule(nn.Module):
    """One pipeline stage: (embed) -> its blocks -> (head), or the spec's ``stage_forward``.
    Registers every module it runs, so FSDP2 and ``parameters()`` see exactly this stage's
    parameters. ``block_ids`` are its blocks' indices in the model's block list; under sequence
    parallelism ``sequence_shards`` is the tensor size (its input holds that share of the sequence)."""

    def __init__(
        self,
        blocks: list[nn.Module],
        first: list[nn.Module],
        last: list[nn.Module],
        embed: Optional[Callable],
        head: Optional[Callable],
        block_forward: Optional[Callable[[nn.Module, Any], Any]] = None,
        *,
        block_ids: Sequence[int] = (),
        is_first: bool = False,
        is_last: bool = False,
        stage_forward: Optional[Callable[["StageModule", Any], Any]] = None,
        sequence_shards: int = 1,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.first = nn.ModuleList(first)
        self.last = nn.ModuleList(last)
        self._embed, self._head = embed, head
        self._block_forward = block_forward
        self._stage_forward = stage_forward
        self.block_ids = tuple(block_ids)
        self.is_first, self.is_last = is_first, is_last
        self.sequence_shards = sequence_shards

    def forward(self, x: Any, *carried: Any) -> Any:
        # carried: what a stage_forward returned beside its activations (a tuple), sent along.
        if self._stage_forward is not None:
            return self._stage_forward(self, x, *carried)
        if self._embed is not None:
            x = self._embed(x)
        for block in self.blocks:
            x = block(x) if self._block_forward is None else self._block_forward(block, x)
        if self._head is not None:
            x = self._head(x)
        return x


def _set_submodule(root: nn.Module, name: str, value: Optional[nn.Module]) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, value)


def split_stages(
    root: nn.Module,
    spec: Any,
    pp_rank: int,
    pp_size: int,
    virtual: int,
    split: Split = "uniform",
    sequence_shards: int = 1,
) -> list[StageModule]:
    """Keep this rank's stages of ``root`` in place; return their stage modules (in order)."""
    num_stages = pp_size * virtual
    runs = plan_stages(root, spec, num_stages, split, virtual)
    blocks = root.get_submodule(spec.blocks)
    mine = stage_ids(pp_rank, pp_size, virtual)
    first = [root.get_submodule(n) for n in spec.first] if 0 in mine else []
    last = [root.get_submodule(n) for n in spec.last] if num_stages - 1 in mine else []
    stages = [
        StageModule(
            [blocks[i] for i in runs[s]],
            first if s == 0 else [],
            last if s == num_stages - 1 else [],
            spec.embed if s == 0 else None,
            spec.head if s == num_stages - 1 else None,
            getattr(spec, "block_forward", None),
            block_ids=runs[s],
            is_first=s == 0,
            is_last=s == num_stages - 1,
            stage_forward=getattr(spec, "stage_forward", None),
            sequence_shards=sequence_shards,
        )
        for s in mine
    ]
    # Drop what other ranks own. Placeholders keep block indices, so names stay as in one process.
    placeholder = getattr(spec, "placeholder", None)
    owned = {i for s in mine for i in runs[s]}
    for i in range(len(blocks)):
        if i not in owned:
            blocks[i] = placeholder(blocks[i]) if placeholder is not None else nn.Identity()
    dropped = ([] if 0 in mine else list(spec.first)) + (
        [] if num_stages - 1 in mine else list(spec.last)
    )
    for name in dropped:
        _set_submodule(
            root, name, placeholder(root.get_submodule(name)) if placeholder is not None else None
        )
    return stages


def pipeline_spec(module: nn.Module) -> Any:
    """The module's :class:`~lightning_3d.PipelineSpec`; ``ValueError`` if it has none."""
    if not callable(getattr(module, "pipeline_spec", None)):
        raise ValueError(
            f"{type(module).__name__} cannot be split into pipeline stages: define "
            "pipeline_spec() returning a lightning_3d.PipelineSpec (see docs/parallelism.md)"
        )
    return module.pipeline_spec()


def split_pipeline(
    root: nn.Module,
    mesh: DeviceMesh,
    virtual: int,
    split: Split = "uniform",
    sequence_parallel: bool = False,
) -> tuple[Any, Optional[list[StageModule]], Optional[TiedGroups]]:
    """Keep this rank's stages of ``root`` in place, by its pipeline coordinate on ``mesh``;
    returns the model's spec, this rank's stage modules and the weights tied across the pipeline
    ranks (their gradient groups), or three ``None`` when the mesh has no pipeline. Under
    ``sequence_parallel`` a stage's input holds the tensor ranks' share of the sequence."""
    if mesh.get_group(MeshAxis.PIPELINE.value).size() == 1:
        return None, None, None
    spec, pp_mesh = pipeline_spec(root), mesh[MeshAxis.PIPELINE.value]
    # Found before the split, while every stage's modules are still here.
    tied = TiedGroups(mesh, tied_holders(root, spec, pp_mesh.size(), virtual, split))
    shards = mesh.get_group(MeshAxis.TENSOR.value).size() if sequence_parallel else 1
    stages = split_stages(
        root, spec, pp_mesh.get_local_rank(), pp_mesh.size(), virtual, split, shards
    )
    return spec, stages, tied
