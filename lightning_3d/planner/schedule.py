"""What a pipeline schedule costs: its bubble, its messages, and the micro-batches a rank keeps.

Four schedules (:data:`lightning_3d.parallel.pipeline.SCHEDULES`), ``p`` ranks in the pipeline,
``m`` micro-batches, ``v`` stages per rank (``virtual_stages``; 1 for GPipe and 1F1B). A rank's
``v`` stages are chunks of ``blocks / v`` blocks each (stage ``r + k·p`` on rank ``r``).

**Bubble** (idle share over the compute of a step, Narayanan et al. 2021 and Qi et al. 2024):
GPipe and 1F1B ``(p − 1) / m``; interleaved 1F1B ``(p − 1) / (v·m)`` (each warm-up slot is a
chunk, ``1/v`` of a stage); zero-bubble (torch's ``ScheduleInterleavedZeroBubble``, the ZB1P
schedule) splits each backward into its input and weight halves and fills the idle slots with
weight gradients, leaving ``(T_F + T_B − T_W)`` of ``(T_F + T_B + T_W)`` per slot: with a
matmul's 2 + 2 + 2 FLOPs per weight, a third: ``(p − 1) / (3·v·m)``.

**Messages**: every micro-batch crosses each of a rank's chunk boundaries forward and its
gradient back: ``2·v·m`` sends (and as many receives) per rank.

**In flight** (what bounds activation memory): the forwards a rank has run whose backwards have
not yet run, at the peak, in chunks. GPipe: all ``m``; 1F1B: ``min(m, p − r)`` on rank ``r``
(rank 0 holds the most); the interleaved schedules follow torch's warm-up count
(``torch.distributed.pipelining.schedules._get_warmup_ops``): ``(v − 1)·k + f·(p − 1 − r)``
chunk forwards before the first backward, ``k`` the micro-batches per round (``m`` split into
``max(1, m // p)`` rounds) and ``f`` 2 for interleaved 1F1B, plus the one in steady state, at
most ``v·m``. Zero-bubble keeps a chunk's whole graph until its weight gradients run (torch's
input backward retains the graph for them), and rank ``r`` delays those by ``r`` micro-batches,
so every rank holds what rank 0 does: ``(v − 1)·k + p``, at most ``v·m`` (counted from torch's
own op order, forwards less weight backwards: ``tests/test_planner_search.py``).
"""

from __future__ import annotations

from lightning_3d.parallel.pipeline import MULTI_STAGE, interleaved_rounds

_WARMUP_FACTOR = {"interleaved_1f1b": 2, "zero_bubble": 1}


def bubble_share(schedule: str, pipeline: int, micro_batches: int, virtual: int = 1) -> float:
    """Idle time over compute time of the slowest rank (see the module docstring)."""
    if pipeline <= 1:
        return 0.0
    share = (pipeline - 1) / (micro_batches * virtual)
    return share / 3 if schedule == "zero_bubble" else share


def messages(pipeline: int, micro_batches: int, virtual: int = 1) -> int:
    """Point-to-point sends one rank makes per step (activations forward, gradients back)."""
    return 2 * virtual * micro_batches if pipeline > 1 else 0


def in_flight_chunks(
    schedule: str, pipeline: int, micro_batches: int, rank: int, virtual: int = 1
) -> int:
    """Chunk forwards of ``rank`` whose activations are alive at once, at the peak (chunk: ``1/v``
    of the rank's blocks; without a pipeline the whole model on one micro-batch)."""
    p, m, v = pipeline, micro_batches, virtual
    if p <= 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule not in MULTI_STAGE:
        return min(m, p - rank)
    per_round = m // interleaved_rounds(m, p)
    # Zero-bubble: graphs alive until the weight pass.
    behind = 0 if schedule == "zero_bubble" else rank
    warmup = min((v - 1) * per_round + _WARMUP_FACTOR[schedule] * (p - 1 - behind), v * m)
    return min(warmup + 1, v * m)
