"""The process layout: how a world of ranks is cut into pipeline × data × tensor groups.

A :class:`Layout` is pure data, validated before any process group exists, so bad input fails
in the launching process with a sentence that names every value involved. :func:`build_mesh`
turns a resolved layout into a ``DeviceMesh`` with axes ``("pp", "dp", "tp")``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class MeshAxis(str, Enum):
    """Mesh axis names, outermost first.

    Tensor parallelism is innermost because it talks on every layer (twice per block), so its
    ranks should be neighbours (same node, fastest links); pipeline is outermost because it only
    sends activations at stage boundaries.
    """

    PIPELINE = "pp"
    DATA = "dp"
    TENSOR = "tp"


MESH_AXES: tuple[str, ...] = tuple(axis.value for axis in MeshAxis)
ZERO_STAGES = (0, 1, 2, 3)

SizeSpec = Union[int, str]


@dataclass(frozen=True)
class Layout:
    """Sizes of the three parallel axes and the ZeRO stage used on the data axis.

    ``data="auto"`` means ``world_size / (tensor * pipeline)``; :meth:`resolve` fills it in.

    Example::

        >>> Layout(tensor=2, pipeline=2).resolve(world_size=8)
        Layout(data=2, tensor=2, pipeline=2, zero_stage=0)
    """

    data: SizeSpec = "auto"
    tensor: int = 1
    pipeline: int = 1
    zero_stage: int = 0

    def __post_init__(self) -> None:
        # Validate what can be validated without knowing the world size.
        problems = []
        for name in ("tensor", "pipeline"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer")
        if self.data != "auto" and (not _is_int(self.data) or self.data < 1):
            problems.append(f"data={self.data!r} must be a positive integer or 'auto'")
        if self.zero_stage not in ZERO_STAGES or not _is_int(self.zero_stage):
            problems.append(f"zero_stage={self.zero_stage!r} must be one of {list(ZERO_STAGES)}")
        if problems:
            raise ValueError("invalid parallel layout: " + "; ".join(problems))

    def resolve(self, world_size: int) -> Layout:
        """Return a copy with ``data`` filled in, checking that the axes tile ``world_size``."""
        model_parallel = self.tensor * self.pipeline
        if self.data == "auto":
            if world_size % model_parallel:
                raise ValueError(
                    f"pipeline({self.pipeline}) * tensor({self.tensor}) = {model_parallel} "
                    f"does not divide world size {world_size}"
                )
            return replace(self, data=world_size // model_parallel)
        product = self.data * model_parallel
        if product != world_size:
            raise ValueError(
                f"pipeline({self.pipeline}) * data({self.data}) * tensor({self.tensor}) = "
                f"{product} does not equal world size {world_size}"
            )
        return self

    @property
    def is_resolved(self) -> bool:
        return self.data != "auto"

    @property
    def world_size(self) -> int:
        if not self.is_resolved:
            raise RuntimeError("Layout.world_size is unknown until the layout is resolved")
        return self.data * self.tensor * self.pipeline

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in ``MESH_AXES`` order: (pipeline, data, tensor)."""
        return (self.pipeline, self.world_size // (self.tensor * self.pipeline), self.tensor)

    def as_dict(self) -> dict:
        return asdict(self)


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """Create the ``("pp", "dp", "tp")`` device mesh for a resolved layout.

    Requires an initialised default process group whose size equals ``layout.world_size``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_AXES)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
