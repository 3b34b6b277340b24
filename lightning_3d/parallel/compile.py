"""``torch.compile`` per transformer block.

Each block (an element of the model's ``nn.ModuleList`` s, as for activation checkpointing and
FSDP2) is compiled on its own with ``nn.Module.compile``, which compiles the module's call in
place: parameter names, state dicts and the hooks other steps attach stay as they were. One
block's graph is reused by every block of the same shape (dynamo caches by code), so a deep
model compiles about once, and a graph break in the head or the loss costs nothing here.

Order in the recipe: after tensor parallelism (the graph sees DTensor layers) and activation
checkpointing (the checkpointed region is traced as one higher-order op), before FSDP2, whose
per-block all-gather and reshard hooks run around the compiled call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from torch import nn

from lightning_3d.parallel.fsdp import find_blocks

if TYPE_CHECKING:
    from lightning_3d.observe.telemetry import Telemetry


@dataclass(frozen=True)
class CompileOptions:
    """The ``compile`` group of :class:`~lightning_3d.options.Plan`."""

    enabled: bool = False
    """``torch.compile`` each transformer block (option ``compile``)."""
    backend: str = "inductor"
    """The ``torch.compile`` backend (option ``compile_backend``); checked against the backends
    dynamo knows only when ``enabled``, so that an unused name costs no dynamo import."""

    def problems(self) -> list[str]:
        """What is wrong with these values, in the option names users give (empty: nothing)."""
        problems = []
        if not isinstance(self.enabled, bool):
            problems.append(f"compile={self.enabled!r} must be True or False")
        if not isinstance(self.backend, str) or not self.backend:
            problems.append(f"compile_backend={self.backend!r} must name a torch.compile backend")
        elif self.enabled is True:
            try:
                check_backend(self.backend)
            except ValueError as error:
                problems.append(str(error))
        return problems


def check_backend(backend: str) -> None:
    """``ValueError`` naming ``backend`` if ``torch.compile`` does not know it."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(
            f"compile_backend={backend!r} is not a torch.compile backend; known: {sorted(known)}"
        )


def compile_blocks(
    module: nn.Module, backend: str = "inductor", telemetry: Optional[Telemetry] = None
) -> int:
    """Compile every block of ``module`` in place; returns how many were compiled (and tells
    ``telemetry`` in a ``"compiled"`` event)."""
    check_backend(backend)
    blocks = find_blocks(module)
    for block in blocks:
        block.compile(backend=backend)
    if telemetry is not None:
        telemetry.publish("compiled", blocks=len(blocks), backend=backend)
    return len(blocks)
