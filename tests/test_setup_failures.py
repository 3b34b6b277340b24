"""An error on some ranks only during setup ends every rank together, within seconds.

Catches: a rank that raised during the strategy's setup (its optimizers, say) left its peers
in the next collective until the process group's timeout (600 s by default); now the ranks
agree at the end of each setup phase that may fail on some ranks only, and every rank raises
with the failing rank and its cause named.
"""

import time

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tools.harness.world import run_world

WIDTH = 8


class TwoPart(L.LightningModule):
    """Two blocks, ``first`` and ``second``: one per stage under ``pipeline=2``.
    ``split_optimizers``: one SGD per block (as a GAN-style module writes it); ``fail_on_rank``:
    ``configure_optimizers`` raises there only."""

    def __init__(self, split_optimizers: bool = False, fail_on_rank: int = -1) -> None:
        super().__init__()
        self.split_optimizers = split_optimizers
        self.fail_on_rank = fail_on_rank
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])

    @property
    def first(self) -> nn.Module:
        return self.blocks[0]

    @property
    def second(self) -> nn.Module:
        return self.blocks[1]

    def pipeline_spec(self):
        from lightning_3d.parallel.pipeline import PipelineSpec

        return PipelineSpec(
            blocks="blocks",
            first=(),
            last=(),
            embed=nn.Identity(),
            head=nn.Identity(),
            loss=F.mse_loss,
        )

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def pipeline_training_step_end(self, loss, batch, batch_idx):
        """Under the pipeline, in place of ``training_step``: nothing to log."""

    def configure_optimizers(self):
        if self.global_rank == self.fail_on_rank:
            raise RuntimeError(f"deliberate failure on rank {self.global_rank}")
        if self.split_optimizers:
            return [
                torch.optim.SGD(self.first.parameters(), lr=0.1),
                torch.optim.SGD(self.second.parameters(), lr=0.1),
            ]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(rank: int, strategy: dict, module_kwargs: dict) -> dict:
    """Fit ``TwoPart(**module_kwargs)`` for 2 steps; the error (if any) and when it came."""
    from lightning_3d import ThreeDStrategy

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, WIDTH), torch.randn(16, WIDTH))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ThreeDStrategy(**strategy),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.monotonic()
    error = None
    try:
        trainer.fit(TwoPart(**module_kwargs), DataLoader(data, batch_size=4))
    except Exception as err:  # every rank must get here, and soon
        error = f"{type(err).__name__}: {err}"
    seconds = time.monotonic() - start
    # A rank that raised stays in the world until every rank has (as a rank still reporting its
    # error does): its peers cannot learn of the failure from its closed connections.
    store = torch.distributed.distributed_c10d._get_default_store()
    store.add("setup_failures/ended", 1)
    deadline = time.monotonic() + 120
    while int(store.add("setup_failures/ended", 0)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    torch.distributed.destroy_process_group()
    return {"error": error, "seconds": seconds}


def test_split_optimizers_under_pipeline_stop_every_rank_with_the_cause():
    """Two optimizers split by block under ``pipeline=2``: on each stage one of them has no
    parameters. Every rank fails within seconds, saying which stage and why."""
    start = time.monotonic()
    results = run_world(_fit, 2, {"pipeline": 2}, {"split_optimizers": True}, timeout=60)
    assert time.monotonic() - start < 30
    for rank, result in enumerate(results):
        assert result["error"] is not None and result["seconds"] < 30, result
        assert f"pipeline stage {rank} of 2" in result["error"], result
        assert "no parameters" in result["error"], result


def test_an_error_on_one_rank_during_setup_ends_every_rank():
    """``configure_optimizers`` raises on rank 1 only: rank 0 used to wait in the next
    collective for the process group's timeout; now it raises too, naming rank 1's error."""
    start = time.monotonic()
    results = run_world(_fit, 2, {"pipeline": 2}, {"fail_on_rank": 1}, timeout=60)
    assert time.monotonic() - start < 30
    assert results[1]["error"] == "RuntimeError: deliberate failure on rank 1", results
    assert results[0]["error"].startswith(
        "PeerSetupError: rank 1 failed during optimizer setup: RuntimeError: deliberate"
    ), results
    assert all(result["seconds"] < 30 for result in results), results
