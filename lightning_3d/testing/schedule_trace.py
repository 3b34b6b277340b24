"""What a pipeline schedule actually runs on one rank, recorded without starting processes.

One process plays ``rank`` of a fake world (no communication: received activations and
gradients are whatever the buffers hold), builds that rank's stages with static shapes and the
named schedule exactly as the strategy does, runs one training step, and records every
computation the schedule asks the stages for, in order: ``(kind, stage, micro_batch)`` with kind
``"F"`` (forward), ``"B"`` (backward; input gradients only when ``W`` follows) or ``"W"`` (weight
gradients, zero-bubble).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_3d.compat import static_stage_shapes
from lightning_3d.parallel.pipeline import make_schedule
from lightning_3d.parallel.stages import stage_ids
from lightning_3d.parallel.fake_world import fake_world

WIDTH, ROWS = 4, 2  # per micro-batch: ROWS x WIDTH activations


def trace_rank(
    schedule: str, pp_size: int, virtual: int, micro_batches: int, rank: int
) -> list[tuple[str, int, int]]:
    """The sequence of computations ``rank`` runs in one training step of ``schedule``."""
    actions: list[tuple[str, int, int]] = []
    num_stages = pp_size * virtual
    example = torch.zeros(ROWS, WIDTH)
    with fake_world(rank, pp_size):
        stages = []
        for index in stage_ids(rank, pp_size, virtual):
            stages.append(
                _RecordingStage(
                    nn.Linear(WIDTH, WIDTH),
                    index,
                    num_stages,
                    torch.device("cpu"),
                    group=dist.group.WORLD,
                    **static_stage_shapes((example,), (example,)),
                    actions=actions,
                )
            )
        runner = make_schedule(schedule, stages, micro_batches, lambda out, target: out.sum())
        batch = torch.randn(ROWS * micro_batches, WIDTH)
        holds_first = any(s.is_first for s in stages)
        holds_last = any(s.is_last for s in stages)
        runner.step(*((batch,) if holds_first else ()), target=batch if holds_last else None)
    return actions


class _RecordingStage(PipelineStage):
    """A stage that records each chunk it runs, and answers the static-shape vote itself."""

    def __init__(self, *args: Any, actions: list, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._actions = actions

    def forward_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> Any:
        self._actions.append(("F", self.stage_index, chunk))
        return super().forward_one_chunk(chunk, *args, **kwargs)

    def backward_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> Any:
        self._actions.append(("B", self.stage_index, chunk))
        return super().backward_one_chunk(chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> Any:
        self._actions.append(("W", self.stage_index, chunk))
        return super().backward_weight_one_chunk(chunk, *args, **kwargs)

    # Stages agree on static shapes (given above) by a vote over send/recv; in a fake world
    # nothing arrives, so answer the vote here. (Private torch API: kept to this one helper.)
    def _warmup_forward_vote(self, *_: Any, **__: Any) -> torch.Tensor:
        return torch.ones(1, dtype=torch.int32)

    def _warmup_backward_result(self, *_: Any, **__: Any) -> torch.Tensor:
        return torch.ones(1, dtype=torch.int32)


def simulate(
    orders: dict[int, list[tuple[str, int, int]]], backward_cost: int = 2
) -> dict[str, Any]:
    """Run every rank's recorded sequence against the pipeline's data dependencies.

    Costs: forward 1; full backward ``backward_cost``; when a schedule splits backward (``W``
    actions exist), input-gradient and weight-gradient halves ``backward_cost / 2`` each.
    Dependencies: F(s, m) after F(s-1, m); B(s, m) after F(s, m) and B(s+1, m); W(s, m) after
    B(s, m). Ranks run their own actions in order, each as soon as its inputs exist.
    Returns ``makespan``, per-rank ``busy`` time and ``bubble`` (idle share), or raises
    ``RuntimeError`` if the ranks' orders deadlock.
    """
    split = any(kind == "W" for order in orders.values() for kind, _, _ in order)
    cost = {"F": 1.0, "B": backward_cost / 2 if split else backward_cost, "W": backward_cost / 2}
    last = max(stage for order in orders.values() for _, stage, _ in order)
    done: dict[tuple[str, int, int], float] = {}
    clock = {rank: 0.0 for rank in orders}
    position = {rank: 0 for rank in orders}

    def ready(kind: str, stage: int, mb: int) -> Any:
        needs = {
            "F": [("F", stage - 1, mb)] if stage > 0 else [],
            "B": [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < last else []),
            "W": [("B", stage, mb)],
        }[kind]
        if any(n not in done for n in needs):
            return None
        return max([done[n] for n in needs], default=0.0)

    while any(position[r] < len(orders[r]) for r in orders):
        progressed = False
        for rank, order in orders.items():
            if position[rank] == len(order):
                continue
            action = order[position[rank]]
            at = ready(*action)
            if at is None:
                continue
            clock[rank] = max(clock[rank], at) + cost[action[0]]
            done[action] = clock[rank]
            position[rank] += 1
            progressed = True
        if not progressed:
            stuck = {
                r: order[position[r]] for r, order in orders.items() if position[r] < len(order)
            }
            raise RuntimeError(f"pipeline order deadlocks; ranks wait at {stuck}")
    makespan = max(clock.values())
    busy = {r: sum(cost[k] for k, _, _ in order) for r, order in orders.items()}
    return {
        "makespan": makespan,
        "busy": busy,
        "bubble": {r: 1 - b / makespan for r, b in busy.items()},
    }


def in_flight_peak(order: list[tuple[str, int, int]]) -> int:
    """Most micro-batch stage-chunks whose forward ran and whose (input) backward has not."""
    live = peak = 0
    for kind, _, _ in order:
        live += {"F": 1, "B": -1}.get(kind, 0)
        peak = max(peak, live)
    return peak
