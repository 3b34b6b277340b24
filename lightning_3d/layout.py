"""The process layout: how a world of ranks is cut into pipeline × data × context × tensor
groups.

A :class:`Layout` is pure data, validated before any process group exists, so bad input fails
in the launching process with a sentence that names every value involved. :func:`build_mesh`
turns a resolved layout into a ``DeviceMesh`` with axes ``("pp", "dp", "cp", "tp")`` (the
context axis has size 1 unless ``context`` > 1). With ``expert`` > 1, :func:`build_expert_mesh`
cuts the data axis once more into the ranks that exchange tokens (``ep``) and the ranks that
replicate the same experts (``dp_replica``).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class MeshAxis(str, Enum):
    """Mesh axis names, outermost first.

    Tensor parallelism is innermost because it talks on every layer (twice per block), so its
    ranks should be neighbours (same node, fastest links); context parallelism next, since it
    talks once per attention (k/v blocks or an all-to-all); pipeline is outermost because it only
    sends activations at stage boundaries.
    """

    PIPELINE = "pp"
    DATA = "dp"
    CONTEXT = "cp"
    TENSOR = "tp"


MESH_AXES: tuple[str, ...] = tuple(axis.value for axis in MeshAxis)
ZERO_STAGES = (0, 1, 2, 3)

SizeSpec = Union[int, str]


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel axes and the ZeRO stage used on the data axis.

    ``data="auto"`` means ``world_size / (tensor * pipeline * context)``; :meth:`resolve` fills
    it in. ``context`` splits every sequence over that many ranks (context parallelism); ZeRO
    then shards over data × context, the ranks that hold the same layers. ``expert`` is carved
    from the data axis, not added to the world (torchtitan's choice): each group of ``expert``
    neighbouring data ranks splits a mixture-of-experts model's experts between them, every
    other weight stays data-parallel, so it must divide ``data``.

    Example::

        >>> Layout(tensor=2, pipeline=2).resolve(world_size=8)
        Layout(data=2, tensor=2, pipeline=2, zero_stage=0)
    """

    data: SizeSpec = "auto"
    tensor: int = 1
    pipeline: int = 1
    zero_stage: int = 0
    context: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        # Validate what can be validated without knowing the world size.
        problems = []
        for name in ("tensor", "pipeline", "context", "expert"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer")
        if self.data != "auto" and (not _is_int(self.data) or self.data < 1):
            problems.append(f"data={self.data!r} must be a positive integer or 'auto'")
        if self.zero_stage not in ZERO_STAGES or not _is_int(self.zero_stage):
            problems.append(f"zero_stage={self.zero_stage!r} must be one of {list(ZERO_STAGES)}")
        if problems:
            raise ValueError("invalid parallel layout: " + "; ".join(problems))

    def __repr__(self) -> str:
        # Failure reports name the layout: context only where it is used.
        names = ("data", "tensor", "pipeline", "zero_stage")
        names += ("context",) if self.context != 1 else ()
        names += ("expert",) if self.expert != 1 else ()
        return f"Layout({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    def resolve(self, world_size: int) -> Layout:
        """Return a copy with ``data`` filled in, checking that the axes tile ``world_size``."""
        model_parallel = self.tensor * self.pipeline * self.context
        if self.data == "auto":
            if world_size % model_parallel:
                raise ValueError(
                    f"{self._product(False)} = {model_parallel} "
                    f"does not divide world size {world_size}"
                )
            return replace(self, data=world_size // model_parallel)._check_expert()
        product = self.data * model_parallel
        if product != world_size:
            raise ValueError(
                f"{self._product(True)} = {product} does not equal world size {world_size}"
            )
        return self._check_expert()

    def _check_expert(self) -> Layout:
        # The expert axis is a sub-grouping of the data ranks: it cannot be larger than them.
        if self.data % self.expert:
            raise ValueError(f"expert={self.expert} does not divide data={self.data}")
        return self

    def _product(self, with_data: bool) -> str:
        """``pipeline(2) * data(2) * context(2) * tensor(2)``: the axes in mesh order (context
        only when it is used)."""
        sizes = [("pipeline", self.pipeline)]
        sizes += [("data", self.data)] if with_data else []
        sizes += [("context", self.context)] if self.context != 1 else []
        sizes += [("tensor", self.tensor)]
        return " * ".join(f"{name}({size})" for name, size in sizes)

    @property
    def is_resolved(self) -> bool:
        return self.data != "auto"

    @property
    def world_size(self) -> int:
        if not self.is_resolved:
            raise RuntimeError("Layout.world_size is unknown until the layout is resolved")
        return self.data * self.tensor * self.pipeline * self.context

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Mesh shape in ``MESH_AXES`` order: (pipeline, data, context, tensor)."""
        if not self.is_resolved:
            raise RuntimeError("Layout.shape is unknown until the layout is resolved")
        return (self.pipeline, self.data, self.context, self.tensor)

    def as_dict(self) -> dict:
        return asdict(self)


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """Create the ``("pp", "dp", "cp", "tp")`` device mesh for a resolved layout.

    Requires an initialised default process group whose size equals ``layout.world_size``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_AXES)


EXPERT_AXES = ("pp", "dp_replica", "ep", "cp", "tp")
"""The expert mesh's axes: the data axis cut into (ranks holding the same experts, ranks that
split the experts), the ``ep`` ranks neighbours on the data axis."""


def build_expert_mesh(mesh: DeviceMesh, expert: int) -> DeviceMesh:
    """The ``EXPERT_AXES`` mesh over the same ranks as ``mesh`` (a :func:`build_mesh` mesh):
    data rank ``d`` is expert rank ``d % expert`` of replica group ``d // expert``, so the
    ranks that exchange tokens are adjacent (same node first). A collective: every rank builds
    it. ``expert`` must divide the data size (:meth:`Layout.resolve` checks it)."""
    from torch.distributed.device_mesh import DeviceMesh

    pp, dp, cp, tp = mesh.mesh.shape
    ranks = mesh.mesh.reshape(pp, dp // expert, expert, cp, tp)
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=EXPERT_AXES)


def shard_mesh(mesh: DeviceMesh, tensor: bool = False) -> DeviceMesh:
    """The ranks that hold the same layers and split the batch between them, which ZeRO shards
    over and gradients are averaged over: the data axis, or data × context flattened into one
    axis ``"dp_cp"`` when the context axis is used (torchtitan's ``dp_shard_cp``: context ranks
    see different tokens of the same samples, so their gradients are summed like the data
    axis's). ``tensor=True``: that axis with the tensor axis after it, 2-D (ZeRO 0-2 buckets)."""
    data, context, tensor_axis = MeshAxis.DATA.value, MeshAxis.CONTEXT.value, MeshAxis.TENSOR.value
    if mesh.get_group(context).size() == 1:
        return mesh[data, tensor_axis] if tensor else mesh[data]
    flat = mesh[data, context]._flatten(f"{data}_{context}")  # cached: the same mesh each time
    if not tensor:
        return flat
    with warnings.catch_warnings():  # slicing a flattened axis off the root: what it is for here
        warnings.simplefilter("ignore", UserWarning)
        return mesh[f"{data}_{context}", tensor_axis]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
