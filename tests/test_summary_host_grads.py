"""The run summary's gradient bytes under ZeRO-Offload's split (``offload/split.py``).

Under ``precision="bf16-true"`` with ``offload="cpu"`` at ZeRO 0-2 the engine keeps fp32 masters
and their fp32 gradient accumulators in host memory and the device no gradient between steps
(a bucket or two of staging during backward, freed by the step). ``summary.json``'s
``grad_bytes`` is the device's, as the planner's (``MemorySplit.grads``); the accumulators are
``host_grad_bytes``.
"""

from __future__ import annotations

import pytest

from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world


def test_the_splits_host_accumulators_are_host_bytes_not_device_gradients():
    """A Trainer run at data=2 ZeRO-1 with the split: every rank reports its fp32 host
    accumulators (4 bytes a parameter over 2 ranks: the split's formula) as ``host_grad_bytes``
    and no device gradient, as the planner predicts for the layout. Catches the accumulators
    counted as ``grad_bytes`` (2Ψ on a device the planner says holds none: seen failing)."""
    import torch

    from lightning_3d.models import LitGPT
    from lightning_3d.offload.split import split_formula
    from lightning_3d.planner.choice import Choice
    from lightning_3d.planner.facts import model_facts
    from lightning_3d.planner.memory import model_state, stage_parts
    from tools.harness.runs import TINY_MODEL

    run = Run(
        strategy={"zero_stage": 1, "offload": "cpu"},
        devices=2,
        steps=1,
        trainer={"precision": "bf16-true"},
        initial_state=False,
    )
    with torch.device("meta"):
        module = LitGPT(**TINY_MODEL)
    facts = model_facts(module, precision="bf16-true", policies=("none",))
    choice = Choice(2, 1, 1, 1, offload="cpu")
    _, grads, _, _, _ = model_state(facts, choice, stage_parts(facts, 1)[0][0])
    assert grads == 0  # the planner's device gradients under the split
    for rank, out in enumerate(run_world(fit_gpt, 2, run)):
        summary = out["summary"]
        held = summary["ranks"][rank]
        formula = split_formula(summary["num_params"], 1, 2)["host_grads"]
        got = (held["grad_bytes"], held["host_grad_bytes"])
        assert got == (grads, pytest.approx(formula, rel=0.01)), (rank, got, formula)
