"""Telemetry: what the parallel machinery observed during a run, for whoever subscribes.

The strategy owns one :class:`Telemetry`; the pieces of the recipe publish events on it (the
vocab-parallel head its logits' sizes, the pipeline runtime each schedule step's bubble and
activation peaks) and :class:`~lightning_3d.observe.summary.RunSummary` subscribes. Nothing reads
the strategy's or the runtime's internals, and a run nobody observes pays one empty loop.

Events and their fields:

- ``"logits"``: ``local_bytes``, ``dense_bytes`` of one vocab-parallel head output (tensor > 1);
- ``"compiled"``: ``blocks`` compiled on this rank, ``backend``;
- ``"pipeline_step"``: ``bubble_fraction`` (idle share of the schedule step),
  ``activation_peak`` (saved-activation bytes alive at once), ``in_flight_peak`` (micro-batches
  between their forward and backward).
"""

from __future__ import annotations

from typing import Any, Callable

Subscriber = Callable[[str, dict[str, Any]], None]


class Telemetry:
    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call ``subscriber(event, fields)`` for every event from now on; returns the unsubscribe."""
        self._subscribers.append(subscriber)
        return lambda: (
            self._subscribers.remove(subscriber) if subscriber in self._subscribers else None
        )

    def publish(self, event: str, **fields: Any) -> None:
        for subscriber in list(self._subscribers):
            subscriber(event, fields)
