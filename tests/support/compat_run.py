"""Where a case of ``support/compat_cases.py`` runs: the layout, this rank, its data and its
``Trainer``, and the tiny GPT every case starts from.

Every layout reads the same global batches of :data:`GLOBAL_BATCH` samples: ``ddp`` and the data
ranks of a layout half of each (Lightning's distributed sampler), one data rank the whole batch.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from support.ddp_parity import SEQ, VOCAB, module_class

GLOBAL_BATCH = 8
TRAIN_SAMPLES = 16  # two global batches an epoch; cases that need more pass ``samples``


@dataclass(frozen=True)
class Run:
    """Where a case runs: ``strategy`` is ``"ddp"``, ``"3d"`` or ``ThreeDStrategy`` keywords."""

    layout: str
    strategy: Any
    world: int
    rank: int
    directory: str

    @property
    def data_ranks(self) -> int:
        if isinstance(self.strategy, str):
            return self.world
        copies = 1
        for axis in ("tensor", "context", "pipeline"):
            copies *= self.strategy.get(axis, 1)
        return self.world // copies

    def loader(self, samples: int = TRAIN_SAMPLES, seed: int = 0, shuffle: bool = False) -> Any:
        """``(inputs, targets, sample id)`` batches: each data rank's share of a global batch."""
        from torch.utils.data import DataLoader, TensorDataset

        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=g)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(samples))
        return DataLoader(data, batch_size=GLOBAL_BATCH // self.data_ranks, shuffle=shuffle)

    def trainer(self, **overrides: Any) -> Any:
        import lightning as L

        from lightning_3d import ThreeDStrategy

        strategy = self.strategy
        options = dict(
            accelerator="cpu",
            devices=self.world,
            strategy=strategy if isinstance(strategy, str) else ThreeDStrategy(**strategy),
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        return L.Trainer(**{**options, **overrides})

    def path(self, *names: str) -> str:
        return os.path.join(self.directory, self.layout, *names)


@functools.cache
def base_class() -> type:
    """The tiny GPT of ``support/ddp_parity.py`` with one place for a case's training-step code,
    :meth:`train_extra`, run from ``training_step`` and, under a pipeline (which runs the batch
    in its place), from ``pipeline_training_step_end``."""

    class Compat(module_class()):
        def train_extra(self, batch: Any, batch_idx: int) -> None:
            pass

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.train_extra(batch, batch_idx)
            return super().training_step(batch, batch_idx)

        def pipeline_training_step_end(self, loss: Any, batch: Any, batch_idx: int) -> None:
            self.train_extra(batch, batch_idx)
            super().pipeline_training_step_end(loss, batch, batch_idx)

    return Compat


def synced_metrics(metrics: dict, skip: tuple[str, ...] = ("train_loss",)) -> dict[str, float]:
    """``callback_metrics`` as floats, less the keys logged per rank without ``sync_dist``."""
    return {k: float(v) for k, v in metrics.items() if k not in skip}


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()
