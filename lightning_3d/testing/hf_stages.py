"""Pipeline stages of a ``transformers`` model run in one process, one after the other: the
split checked against the whole model without processes (tests and the family matrix)."""

from __future__ import annotations

import copy
from typing import Any

import torch


def stages_in_one_process(module: Any, pipeline: int, virtual: int = 1) -> list[Any]:
    """Every stage of ``module`` (a ``LightningModule`` with ``pipeline_spec()``) split for
    ``pipeline`` ranks of ``virtual`` stages each, each rank's from its own copy of the module,
    in stage order."""
    from lightning_3d.parallel.stages import split_stages

    stages = []
    for rank in range(pipeline):
        copied = copy.deepcopy(module)
        stages += split_stages(copied, copied.pipeline_spec(), rank, pipeline, virtual)
    return sorted(stages, key=lambda stage: stage.block_ids[0])


def run_in_turn(stages: list[Any], ids: torch.Tensor) -> torch.Tensor:
    """``ids`` through ``stages`` one after the other: what a pipeline's last stage outputs."""
    x = ids
    for stage in stages:
        x = stage(x)
    return x
