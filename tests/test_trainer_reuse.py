"""A module fitted by one ``Trainer`` is used by the next, as under Lightning's ``ddp``: a
second ``fit`` continues from the first one's weights, then ``test`` and ``predict`` run on
them, each with a new ``Trainer``, in every layout.

Catches the recipe run a second time on a module it had rewritten in place: under ZeRO-3
FSDP2 refused (``fully_shard has already been applied``), under ``tensor=2``
``distribute_module`` refused (``should only be called once``), under ``pipeline=2`` the split
found only this rank's stages (``first-stage module 'model.tok_emb' names no module``). One
world runs ddp and each layout in turn (``support/ddp_parity.py``); every rank's whole weights
after the second fit, its test loss and its predictions are ddp's, and the second strategy
hears the telemetry of the run it took over.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ddp_parity import (
    RANKS,
    loader,
    module_class,
    predictions,
    trainer,
    whole_state,
)
from tools.harness.parity import weight_mismatches
from tools.harness.world import run_world

REUSED = ["ddp", "zero1", "zero3", "tp2", "cp2", "pp2"]


def _listen(trainer: Any) -> list[str]:
    """The names of the telemetry events ``trainer``'s strategy publishes (ddp: none)."""
    names: list[str] = []
    telemetry = getattr(trainer.strategy, "telemetry", None)
    if telemetry is not None:
        telemetry.subscribe(lambda event, fields: names.append(event))
    return names


def _fit_twice_test_predict(rank: int, layouts: list[str]) -> dict[str, Any]:
    import lightning as L

    out: dict[str, Any] = {}
    for layout in layouts:
        L.seed_everything(0, verbose=False)
        module = module_class()()
        first, second = trainer(layout), trainer(layout)  # the second: new data, new Trainer
        events = _listen(first), _listen(second)
        first.fit(module, loader(layout))
        second.fit(module, loader(layout, seed=1))
        state = whole_state(second, module)
        tested = trainer(layout).test(module, loader(layout, seed=2), verbose=False)
        predicted = trainer(layout).predict(module, loader(layout, seed=2))
        out[layout] = {
            "state": state,
            "test_loss": tested[0]["test_loss"],
            "predictions": predictions(predicted),
            "events": [sorted(set(names)) for names in events],
        }
    # Another layout for the module last parallelized (for pipeline=2): refused, naming both.
    try:
        trainer("zero3").fit(module, loader("zero3"))
        out["other layout"] = "accepted"
    except ValueError as error:
        out["other layout"] = str(error)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_fit_twice_test_predict, RANKS, REUSED, timeout=500)


@pytest.mark.parametrize("layout", [name for name in REUSED if name != "ddp"])
def test_a_second_trainer_continues_as_under_ddp(world, layout):
    """fit -> new Trainer fit -> new Trainer test -> new Trainer predict: ddp's weights, test
    loss and predictions on every rank."""
    ddp = {}
    for out in world:
        ddp.update(out["ddp"]["predictions"])
    for rank, out in enumerate(world):
        ours = out[layout]
        problems = weight_mismatches(ours["state"], out["ddp"]["state"], 1e-5, 1e-6)
        assert problems == [], f"rank {rank}: {problems}"
        assert ours["test_loss"] == pytest.approx(out["ddp"]["test_loss"], rel=1e-5)
        assert ours["predictions"], f"rank {rank} predicted nothing"
        for sample, value in ours["predictions"].items():
            torch.testing.assert_close(value["logits"], ddp[sample]["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_second_trainers_telemetry_hears_the_run(world, layout):
    """The recipe's hooks and the pipeline schedule publish to the telemetry of the strategy
    that parallelized the module; a later strategy's run summary hears them too (the logits'
    sizes under tensor parallelism, the schedule's timings under a pipeline)."""
    for out in world:
        first, second = out[layout]["events"]
        assert first and second == first, (first, second)


def test_a_second_trainer_of_another_layout_is_refused(world):
    """A module whose layers are this rank's part of one layout cannot run in another: a
    ``ValueError`` naming both layouts, not an error from deep inside torch."""
    for out in world:
        message = out["other layout"]
        assert "pipeline=2" in message and "zero_stage=3" in message, message


def test_which_earlier_layouts_a_new_layout_may_follow():
    """Plain: the same layout reuses the earlier run; after ZeRO 0-2 over data ranks alone (the
    layers left whole) any layout parallelizes anew; after a layout that rewrote the layers,
    another is refused naming both."""
    from torch import nn

    from lightning_3d.layout import Layout
    from lightning_3d.observe.telemetry import Telemetry
    from lightning_3d.strategy.reuse import EarlierRun, earlier_run, remember

    def fitted(layout: Layout) -> nn.Module:
        module = nn.Linear(2, 2)
        remember(module, EarlierRun(None, layout, None, Telemetry()))  # type: ignore[arg-type]
        return module

    data = Layout(data=2, tensor=1, pipeline=1, zero_stage=2)
    tensor = Layout(data=1, tensor=2, pipeline=1, zero_stage=0)
    assert earlier_run(nn.Linear(2, 2), tensor) is None
    assert earlier_run(fitted(tensor), tensor).layout == tensor
    assert earlier_run(fitted(data), tensor) is None
    with pytest.raises(ValueError, match=r"tensor=2.*\n?.*zero_stage=2"):
        earlier_run(fitted(tensor), data)
