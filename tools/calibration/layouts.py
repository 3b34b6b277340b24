"""The layouts the planner is calibrated on, and the planner's :class:`Choice` for a run's options.

Shared by the memory calibration (``calibration.py``) and the step-time one
(``time_calibration.py``): each entry is ``name -> (ThreeDStrategy options, world size)``, where
``None`` stands for Lightning's own single-device strategy.
:func:`tiny_facts` is the planner's view of the model the memory calibration trains.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from lightning_3d.parallel.pipeline import MULTI_STAGE
from lightning_3d.planner.choice import Choice
from lightning_3d.planner.facts import ModelFacts

_DATA_PARALLEL: Mapping[str, tuple[Optional[dict[str, Any]], int]] = {
    "single": (None, 1),
    "dp2_z0": ({"zero_stage": 0}, 2),
    "dp2_z1": ({"zero_stage": 1}, 2),
    "dp2_z2": ({"zero_stage": 2}, 2),
    "dp2_z3": ({"zero_stage": 3}, 2),
    "tp2": ({"tensor": 2}, 2),
}
_SEQUENCE_PARALLEL: Mapping[str, tuple[Optional[dict[str, Any]], int]] = {
    "tp2_sp": ({"tensor": 2, "sequence_parallel": True}, 2),
}
_CHECKPOINTING: Mapping[str, tuple[Optional[dict[str, Any]], int]] = {
    "dp2_ac_full": ({"ac_policy": "full"}, 2),
    "dp2_ac_selective": ({"ac_policy": "selective"}, 2),
}
# Memory: one pipeline (its micro-batch count does not change what a rank holds).
LAYOUTS: Mapping[str, tuple[Optional[dict[str, Any]], int]] = {
    **_DATA_PARALLEL,
    **_SEQUENCE_PARALLEL,
    "pp2": ({"pipeline": 2}, 2),
    **_CHECKPOINTING,
}
# Step time: the bubble shrinks with micro-batches, so two of them; simplest first (the planner's tie-break).
TIME_LAYOUTS: Mapping[str, tuple[Optional[dict[str, Any]], int]] = {
    **_DATA_PARALLEL,
    "pp2_m2": ({"pipeline": 2, "micro_batches": 2}, 2),
    "pp2_m4": ({"pipeline": 2, "micro_batches": 4}, 2),
    "pp2_i1f1b_m4": ({"pipeline": 2, "micro_batches": 4, "schedule": "interleaved_1f1b"}, 2),
    "pp2_zb_m4": ({"pipeline": 2, "micro_batches": 4, "schedule": "zero_bubble"}, 2),
    **_CHECKPOINTING,
}


def choice_of(strategy: Optional[dict[str, Any]], world: int, global_batch: int) -> Choice:
    """The planner's :class:`Choice` for a run's strategy options."""
    strategy = strategy or {}
    tp, pp = strategy.get("tensor", 1), strategy.get("pipeline", 1)
    dp = world // (tp * pp)
    m = strategy.get("micro_batches", pp) if pp > 1 else 1
    schedule = strategy.get("schedule", "1f1b")
    virtual = strategy.get("virtual_stages") or (2 if pp > 1 and schedule in MULTI_STAGE else 1)
    offload = strategy.get("offload", "none") + (
        "+params" if strategy.get("offload_params") else ""
    )
    return Choice(
        dp,
        tp,
        pp,
        strategy.get("zero_stage", 0),
        m,
        schedule,
        strategy.get("ac_policy", "none"),
        offload,
        global_batch // dp,
        virtual,
        bool(strategy.get("sequence_parallel", False)),
    )


def tiny_facts(tp_sizes: tuple[int, ...] = (1, 2, 4)) -> ModelFacts:
    """Planner facts of the model the runs train (``TINY_MODEL`` at its block size, fp32)."""
    import torch

    from lightning_3d.models import LitGPT
    from lightning_3d.planner.facts import model_facts
    from tools.harness.runs import TINY_DATA, TINY_MODEL

    with torch.device("meta"):
        module = LitGPT(**TINY_MODEL)
    return model_facts(
        module,
        seq_len=TINY_DATA["block_size"],
        precision="32-true",
        tp_sizes=tp_sizes,
        name="tiny",
        sequence_parallel=True,
    )
