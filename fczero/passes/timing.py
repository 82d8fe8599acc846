"""Seconds this process has spent in fczero's passes, for compile-time accounting.

``run_passes`` adds each call's wall time here: two clock reads per graph, no sync, no
logging. Torch's own accounting
(``torch._dynamo.utils.calculate_time_spent``) times Dynamo, AOT autograd and Inductor
but sees fczero's passes only as part of Inductor's post-grad passes;
``bench.compile_time`` subtracts this total to show them apart::

    before = timing.total()
    step(tokens)                       # the first step: compiles, runs fczero's passes
    spent = timing.total() - before    # PassTime(seconds=..., graphs=...)

The total covers every graph handed to ``run_passes`` (forward and backward, any
backend), the cross-rank graph check included; a graph Inductor loads from its FX graph
cache is not passed again, so a warm start adds nothing. It is never reset by fczero.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class PassTime:
    """Wall seconds in ``run_passes`` and the number of graphs it was called on."""

    seconds: float = 0.0
    graphs: int = 0

    def __sub__(self, other: PassTime) -> PassTime:
        return PassTime(self.seconds - other.seconds, self.graphs - other.graphs)


_total = PassTime()


def total() -> PassTime:
    """What this process has spent in fczero's passes so far."""
    return _total


@contextmanager
def timed() -> Iterator[None]:
    """Add the time of the block to the process's total, as one graph."""
    global _total
    start = time.perf_counter()
    try:
        yield
    finally:
        _total = PassTime(_total.seconds + time.perf_counter() - start, _total.graphs + 1)


__all__ = ["PassTime", "timed", "total"]
