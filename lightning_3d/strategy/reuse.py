"""A module fitted by one ``Trainer`` and handed to the next (a second ``fit``, ``test``,
``predict``): what the first run's strategy made of it, kept on the module.

The recipe rewrites a module in place, once: tensor parallelism turns its weights into
``DTensor`` s (``distribute_module`` refuses a second call), FSDP2 wraps its blocks (``fully_shard``
refuses a second call) and a pipeline keeps only this rank's stages (the other stages' modules
are gone, so the module can no longer be split). A later strategy therefore adopts the first
run's :class:`~lightning_3d.strategy.recipe.Parallelized` record, with the mesh its ``DTensor`` s
live on, the objective its pipeline schedule reports to and the telemetry its hooks publish to,
instead of parallelizing again. A later ``Trainer`` must use the same layout: the module's
layers are this rank's part of that layout and no other (after ZeRO 0-2 over data ranks alone,
whose engines leave the layers whole, any layout may follow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from torch import nn

    from lightning_3d.layout import Layout
    from lightning_3d.observe.telemetry import Telemetry
    from lightning_3d.strategy.recipe import Parallelized

# On the LightningModule: the EarlierRun of the strategy that parallelized it.
EARLIER_RUN_ATTR = "_l3d_earlier_run"


@dataclass(eq=False)
class EarlierRun:
    """What a strategy made of a module, for the strategies of later Trainers."""

    parallelized: Parallelized
    layout: Layout
    objective: Any  # the strategy's objective, which the pipeline schedule was built with
    telemetry: Telemetry  # the hub the recipe's hooks and the schedule publish to
    # Unsubscribes the current adopter's relay from ``telemetry`` (the next adopter's replaces it).
    unrelay: Optional[Callable[[], None]] = None

    def relay_to(self, telemetry: Telemetry) -> None:
        """Pass this run's telemetry events on to ``telemetry`` (the current strategy's, which
        the run summary listens to), and no longer to the previous adopter's."""
        if self.unrelay is not None:
            self.unrelay()
        self.unrelay = self.telemetry.subscribe(
            lambda event, fields: telemetry.publish(event, **fields)
        )


def remember(module: nn.Module, run: EarlierRun) -> None:
    """Keep ``run`` on ``module`` for later Trainers."""
    object.__setattr__(module, EARLIER_RUN_ATTR, run)  # a plain attribute, not a submodule


def earlier_run(module: nn.Module, layout: Layout) -> Optional[EarlierRun]:
    """The run that parallelized ``module`` before, if any and for ``layout``; ``ValueError``
    naming both layouts when another layout's recipe rewrote its layers."""
    run: Optional[EarlierRun] = getattr(module, EARLIER_RUN_ATTR, None)
    if run is None or run.layout == layout:
        return run
    if not _rewrites_layers(run.layout):
        return None  # ZeRO 0-2 over data ranks left the layers whole: parallelize anew
    raise ValueError(
        f"{type(module).__name__} was parallelized by an earlier Trainer for {run.layout}, "
        f"and its layers are this rank's part of that layout; this Trainer asks for {layout}. "
        "Use the same layout, or build a new module and load the checkpoint into it"
    )


def _rewrites_layers(layout: Layout) -> bool:
    """Whether the recipe changes the module's layers for ``layout`` (DTensor weights, FSDP2
    wrappers, pipeline stages, attention across context ranks); ZeRO 0-2's engines do not."""
    parallel = (layout.tensor, layout.pipeline, layout.context)
    return any(size > 1 for size in parallel) or layout.zero_stage == 3
