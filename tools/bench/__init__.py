"""Benchmarks that print figures (never timed tests). ``python -m tools.bench.zero_memory``."""

from typing import Any


def cell(value: Any, spec: str) -> str:
    """A table cell: ``value`` formatted by ``spec``, or ``n/a`` where there is no figure."""
    return "n/a" if value is None else format(value, spec)
