"""The order of the module's hooks when a fit resumes from a checkpoint, under Lightning's
``ddp`` and under ``3d``, recorded on 2 ranks.

``ddp`` restores the module (``on_load_checkpoint``, then its weights) before the strategy's
setup, so before ``configure_optimizers`` and ``on_fit_start``. ``3d`` restores after its setup
(``restore_checkpoint_after_setup``, as Lightning's FSDP, DeepSpeed and ``ModelParallelStrategy``
do): a checkpoint loads into the parallelized module and its sharded optimizer (sharded files
are read shard by shard into ``DTensor`` s; a module built on ``meta`` has no storage until the
recipe has sharded it), so ``on_load_checkpoint`` runs after ``configure_optimizers`` and
``on_fit_start``, still before ``on_train_start`` and the first step. docs/parallelism.md says
so; this test holds both orders to what that page says.
"""

from __future__ import annotations

from typing import Any

import pytest

from tools.harness.world import run_world


def _resume(rank: int, directory: str, layouts: list[str]) -> dict[str, Any]:
    import os

    from support.ddp_parity import loader, module_class, trainer

    class Recording(module_class()):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def setup(self, stage: str) -> None:
            self.calls.append("setup")

        def configure_model(self) -> None:
            self.calls.append("configure_model")
            super().configure_model()

        def configure_optimizers(self) -> Any:
            self.calls.append("configure_optimizers")
            return super().configure_optimizers()

        def on_fit_start(self) -> None:
            self.calls.append("on_fit_start")

        def on_load_checkpoint(self, checkpoint: dict) -> None:
            self.calls.append("on_load_checkpoint")
            super().on_load_checkpoint(checkpoint)

        def on_train_start(self) -> None:
            self.calls.append("on_train_start")

    out = {}
    for layout in layouts:
        path = os.path.join(directory, f"{layout}.ckpt")
        first = trainer(layout)
        first.fit(Recording(), loader(layout))
        first.save_checkpoint(path)
        module = Recording()
        resumed = trainer(layout, steps=3)
        resumed.fit(module, loader(layout), ckpt_path=path)
        out[layout] = {"calls": module.calls, "global_step": resumed.global_step}
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("hook_order"))
    return run_world(_resume, 2, directory, ["ddp", "tp2", "zero3"], timeout=300)


def _before(calls: list[str], first: str, then: str) -> bool:
    return calls.index(first) < calls.index(then)


def test_ddp_loads_the_checkpoint_before_configure_optimizers(world):
    """The reference: under ddp, ``on_load_checkpoint`` precedes ``configure_optimizers`` and
    ``on_fit_start``."""
    for out in world:
        calls = out["ddp"]["calls"]
        assert _before(calls, "on_load_checkpoint", "configure_optimizers"), calls
        assert _before(calls, "on_load_checkpoint", "on_fit_start"), calls
        assert out["ddp"]["global_step"] == 3


@pytest.mark.parametrize("layout", ["tp2", "zero3"])
def test_3d_loads_the_checkpoint_after_setup_as_documented(world, layout):
    """Under 3d, ``on_load_checkpoint`` follows ``configure_optimizers`` and ``on_fit_start``
    (docs/parallelism.md: the checkpoint loads into the parallelized module), and precedes
    ``on_train_start``; the run resumes at the saved step."""
    for out in world:
        calls = out[layout]["calls"]
        assert calls == [
            "setup",
            "configure_model",
            "configure_optimizers",
            "on_fit_start",
            "on_load_checkpoint",
            "on_train_start",
        ], calls
        assert out[layout]["global_step"] == 3
