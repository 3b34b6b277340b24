"""What a user's code reads of the model during and after a run is what Lightning's ``ddp``
gives on the same 2 ranks, in every layout: the whole-model gradient norm, the whole weights
and ``predict``'s outputs (plain tensors, whole sequences, in a dict or a tuple).

One world fits the tiny GPT of ``support/ddp_parity.py`` under ``ddp`` and each layout in turn
and predicts with it. Where the sharded view is the point, the whole one is a documented call
(docs/parallelism.md, "Lightning features by layout"): ``strategy.gradient_norm(optimizer)``
for Lightning's ``grad_norm``, ``strategy.full_state_dict()`` for ``state_dict()``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ddp_parity import (
    LAYOUTS,
    RANKS,
    loader,
    module_class,
    predictions,
    trainer,
    whole_state,
)
from tools.harness.parity import weight_mismatches
from tools.harness.world import run_world


def _fit_and_predict(rank: int, layouts: list[str]) -> dict[str, Any]:
    import lightning as L

    out = {}
    for layout in layouts:
        L.seed_everything(0, verbose=False)
        module = module_class()()
        fitted = trainer(layout)
        fitted.fit(module, loader(layout))
        state = whole_state(fitted, module)
        predicted = trainer(layout).predict(module, loader(layout))
        out[layout] = {
            "norms": module.norms,
            "lightning_norms": module.lightning_norms,
            "state": state,
            "predictions": predictions(predicted),
        }
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_fit_and_predict, RANKS, list(LAYOUTS), timeout=500)


LAYOUT_NAMES = [name for name in LAYOUTS if name != "ddp"]


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_gradient_norm_is_the_whole_models(world, layout):
    """Catches a gradient norm of this rank's part: ``strategy.gradient_norm(optimizer)`` is
    ``ddp``'s ``grad_norm(module, 2)`` total at every step, on every rank (Lightning's own
    ``grad_norm`` reads each parameter's ``.grad``: this rank's shard under ZeRO-3 and tensor
    parallelism, nothing under ZeRO 1-2, one stage's parameters under a pipeline)."""
    for rank, out in enumerate(world):
        expected = out["ddp"]["norms"]
        got = out[layout]["norms"]
        assert got == pytest.approx(expected, rel=1e-5), f"rank {rank}: {got} vs ddp {expected}"


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_whole_weights_match_ddp(world, layout):
    """The run itself, seen through ``strategy.full_state_dict()``: every rank's whole weights
    are ddp's."""
    for rank, out in enumerate(world):
        problems = weight_mismatches(out[layout]["state"], out["ddp"]["state"], 1e-5, 1e-6)
        assert problems == [], f"rank {rank}: {problems}"


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_predict_returns_what_ddp_returns(world, layout):
    """Catches ``predict`` outputs that are not ddp's: ``DTensor`` logits under ``tensor=2``
    (a vocab-parallel head's output, sharded on the vocabulary), half of each sequence under
    ``context=2`` when ``predict_step`` returns a dict or a tuple (only a bare tensor was
    gathered). Every sample a rank predicts has ddp's plain, whole-sequence logits."""
    ddp = {}
    for out in world:  # ddp: each rank predicts its half of the samples
        ddp.update(out["ddp"]["predictions"])
    for rank, out in enumerate(world):
        got = out[layout]["predictions"]
        assert got, f"rank {rank} predicted nothing"
        for sample, value in got.items():
            want = ddp[sample]
            assert value["types"] == ["Tensor"], f"rank {rank}, sample {sample}: {value['types']}"
            assert value["logits"].shape == want["logits"].shape, f"rank {rank}, sample {sample}"
            torch.testing.assert_close(value["logits"], want["logits"], rtol=1e-5, atol=1e-5)
            assert torch.equal(value["argmax"], want["argmax"]), f"rank {rank}, sample {sample}"
            assert value["pair_id"] == sample


def test_lightning_grad_norm_under_ddp_is_the_reference(world):
    """The reference itself: under ddp, Lightning's ``grad_norm`` total is what the tests above
    compare with, one per optimizer step."""
    for out in world:
        assert out["ddp"]["lightning_norms"] == pytest.approx(out["ddp"]["norms"], rel=1e-6)
        assert len(out["ddp"]["norms"]) == 2
