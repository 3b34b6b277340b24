"""The recipe: what parallelizing a module on a ``("pp", "dp", "tp")`` mesh produced.

:class:`Parallelized` is the public record that the strategy, checkpoints and telemetry read:
the names of the model's state as one process has them, this rank's pipeline stages and
runtime, tied-weight groups, and the ZeRO 0-2 engines attached to the optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from lightning_3d.layout import MeshAxis

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer

    from lightning_3d.parallel.pipeline import PipelineRuntime
    from lightning_3d.parallel.tied import TiedGroups
    from lightning_3d.parallel.zero import ZeroDataParallel


@dataclass(eq=False)
class Parallelized:
    """A module after the recipe, on this rank."""

    module: nn.Module
    mesh: DeviceMesh
    full_names: list[str]  # state_dict names as one process has them (checkpoints use these)
    full_param_names: list[str]  # parameter names as one process has them
    stages: Optional[list] = None  # this rank's pipeline stages (None without a pipeline)
    runtime: Optional[PipelineRuntime] = None  # the pipeline schedule runner
    tied: Optional[TiedGroups] = None  # tied weights with a copy on several pipeline ranks
    engines: list[ZeroDataParallel] = field(default_factory=list)  # ZeRO 0-2, one per optimizer
    _bound: dict[int, ZeroDataParallel] = field(default_factory=dict)  # id(optimizer) -> its engine

    @property
    def pp_group(self) -> Any:
        """The pipeline process group when stages hold different parameters, else ``None``."""
        pp = self.mesh[MeshAxis.PIPELINE.value]
        return pp.get_group() if pp.size() > 1 else None

    def bind(self, optimizer: Optimizer, engine: ZeroDataParallel) -> None:
        """Record that ``engine`` serves ``optimizer`` (the user's, or a wrapper around it)."""
        if engine not in self.engines:
            self.engines.append(engine)
        self._bound[id(optimizer)] = engine

    def engine_for(self, optimizer: Optimizer) -> Optional[ZeroDataParallel]:
        """The ZeRO engine stepping ``optimizer`` (or the one a ``LightningOptimizer`` wraps), if any."""
        raw = getattr(optimizer, "_optimizer", optimizer)
        return self._bound.get(id(raw), self._bound.get(id(optimizer)))

    def clear_engines(self) -> None:
        for engine in self.engines:
            engine.detach()
        self.engines, self._bound = [], {}

    def tied_copies(self) -> list[tuple[Any, Any, bool]]:
        """``(parameter, group, is_first_holder)`` for this rank's copies of tied weights that
        other pipeline ranks hold too."""
        return self.tied.local(self.module) if self.tied else []
