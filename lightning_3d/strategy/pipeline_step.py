"""What of a module's training step runs under a pipeline, and what is refused before training.

A pipeline schedule runs forward and backward of every micro-batch itself
(:class:`~lightning_3d.parallel.pipeline_runtime.PipelineRuntime`), so the module's
``training_step`` is never called: its logging, metric updates, a loss it changes or an error it
raises would be skipped without a word. A module therefore declares how its pipeline step ends,
with :data:`STEP_END_HOOK`::

    def pipeline_training_step_end(self, loss, batch, batch_idx) -> None:
        self.log("train_loss", loss, prog_bar=True)

It runs on every rank once the schedule has run the batch, with the batch's mean loss (the
same value on every stage) and the batch as ``training_step`` gets it; ``self.log`` and metric
updates work there as in ``training_step``. The strategy logs nothing of its own: a key appears
only if the module logs it. ``LitGPT`` and ``HFCausalLM``, whose ``training_step`` is the loss
and ``self.log("train_loss", ...)``, log the same in their hook.

A module that has no hook, or whose ``training_step`` overrides the class that defines the hook
(a subclass of ``LitGPT`` overriding ``training_step`` only, say), is refused before training:
its own step would not run. So is a module that overrides ``LightningModule.backward``, which the
schedule's own backward would skip.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import LightningModule

from lightning_3d.layout import Layout

STEP_END_HOOK = "pipeline_training_step_end"


def _defining_index(module: Any, name: str) -> Optional[int]:
    """Where in ``module``'s MRO the first class whose body defines ``name`` stands."""
    mro = type(module).__mro__
    return next((i for i, cls in enumerate(mro) if name in vars(cls)), None)


def _refuse_unrun_backward(module: Any, layout: Layout) -> None:
    """``ValueError`` for a module that overrides ``LightningModule.backward``: the schedule runs
    the backward of every micro-batch itself, so the override would be skipped unseen."""
    owner = type(module).__mro__[_defining_index(module, "backward")]
    if owner is LightningModule:
        return
    raise ValueError(
        f"{owner.__name__}.backward does not run under pipeline={layout.pipeline} (the schedule "
        "runs the backward of every micro-batch itself): remove the override (on_before_backward "
        "and on_after_backward run as under ddp), or use pipeline=1"
    )


def refuse_unrun_training_step(module: Any, layout: Layout) -> None:
    """``ValueError`` under ``pipeline > 1`` for a module whose ``training_step`` would be
    skipped unseen: no :data:`STEP_END_HOOK`, or one from a class that comes after the one that
    defines ``training_step`` in the MRO (a base class whose step a subclass overrides); also one
    that overrides ``backward``. Manual optimization is refused on its own, and a module without a
    ``training_step`` by Lightning."""
    if layout.pipeline <= 1 or not getattr(module, "automatic_optimization", True):
        return
    _refuse_unrun_backward(module, layout)
    step, end = _defining_index(module, "training_step"), _defining_index(module, STEP_END_HOOK)
    mro = type(module).__mro__
    # The hook must override at least what training_step does: defined in the class that
    # defines training_step, or in one that comes before it in the MRO (a subclass, a mixin).
    # LightningModule's own training_step: no step of the module's (Lightning refuses it).
    if step is None or mro[step] is LightningModule or (end is not None and end <= step):
        return
    owner, name = mro[step].__name__, type(module).__name__
    raise ValueError(
        f"{owner}.training_step does not run under pipeline={layout.pipeline} (the "
        "schedule runs forward and backward of the batch itself), so its logging, metric "
        f"updates and loss would be skipped: define {STEP_END_HOOK}(self, loss, batch, "
        f"batch_idx) in {name} (it runs on every stage after the schedule, with the batch's mean "
        "loss, for self.log and metric updates), or use pipeline=1"
    )
