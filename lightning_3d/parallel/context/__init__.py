"""Context parallelism: every sequence split over the ``cp`` ranks, attention run across them.

Each rank holds ``2`` of the ``2 × cp`` equal chunks of a sequence, ``r`` and ``2 cp - 1 - r``
(:mod:`.chunks`), so causal attention costs every rank the same. Everything but attention is
local to the tokens a rank holds; attention runs by one of two schemes:

- ``"ring"`` (:mod:`.ring`): k/v chunks go round the ring, each rank merging the partial results
  with an online softmax (log-sum-exp); the backward sends the k/v gradients round after them.
- ``"alltoall"`` (:mod:`.ulysses`, DeepSpeed-Ulysses): an all-to-all turns q/k/v from
  sequence-sharded to head-sharded, attention runs on the whole sequence for ``heads / cp``
  heads, and a second all-to-all turns the output back.

:func:`.apply.apply_context_parallel` routes a model's attention through them; the strategy
splits each batch (:func:`.chunks.shard_sequence`) and averages the loss over ``cp``.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("ring", "alltoall")


@dataclass(frozen=True)
class ContextParallelOptions:
    """Context parallelism's options (the ``cp`` group of :class:`~lightning_3d.options.Plan`;
    the ``context`` size is part of the :class:`~lightning_3d.layout.Layout`)."""

    scheme: str = "ring"
    """Attention across the cp ranks: ``"ring"`` (k/v passed round) or ``"alltoall"``
    (Ulysses); checked by :func:`scheme_problems`."""


def scheme_problems(scheme: object) -> list[str]:
    """The ``context_scheme`` option's problems (none when it is one of :data:`SCHEMES`)."""
    if scheme in SCHEMES:
        return []
    return [f"context_scheme={scheme!r} must be one of {list(SCHEMES)}"]
