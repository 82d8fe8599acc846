"""The one bucket planner: which consecutive collectives go out as one.

Eager buckets (``fczero.runtime.eager_buckets``), the stage-1 reducer, the refresh of
stage 1/2 whole copies and the compile passes' bucketing (``fczero.passes.bucketing``)
all cut their sequence of collectives here. The sequence is made of *units*, runs of
items meant to stay together: one item each in eager, a block's collectives in a graph.

    a unit joins the open bucket, whole, when its key equals the bucket's, it may join
      (``joins``), and the bucket's bytes plus its own stay within ``cap`` (or the
      bucket is still under ``floor``);
    otherwise it opens a new bucket, and its items fill buckets in order, each within
      ``cap`` (an item larger than ``cap`` gets a bucket of its own).

A ``None`` key never shares a bucket. Every input is the same on every rank (shapes,
dtypes, module paths, program or registration order), so every rank plans the same
buckets and issues the same collectives.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    """Items that join a bucket together: their bytes in order, and what they may share with."""

    key: Hashable | None  # units share a bucket only under equal keys; None never shares
    sizes: tuple[int, ...]
    joins: bool = True  # False: open a new bucket even where the open one has room


def plan_buckets(units: Sequence[Unit], cap: int, floor: int = 0) -> list[list[int]]:
    """Every item's position (counted over all units, in order) cut into buckets."""
    buckets: list[list[int]] = []
    key, size, position = None, 0, 0
    for unit in units:
        total = sum(unit.sizes)
        same = unit.key is not None and unit.key == key
        if buckets and unit.joins and same and (size + total <= cap or size < floor):
            buckets[-1].extend(range(position, position + len(unit.sizes)))
            size += total
        else:
            key, size = unit.key, 0
            buckets.append([])
            for offset, nbytes in enumerate(unit.sizes):
                if buckets[-1] and size + nbytes > cap:
                    buckets.append([])
                    size = 0
                buckets[-1].append(position + offset)
                size += nbytes
        position += len(unit.sizes)
    return buckets


def plan_items(items: Sequence[tuple[Hashable | None, int]], cap: int) -> list[list[int]]:
    """``plan_buckets`` with one item per unit: ``items`` are (key, bytes) in issue order;
    consecutive items with equal keys share a bucket while its bytes stay within ``cap``."""
    return plan_buckets([Unit(key, (nbytes,)) for key, nbytes in items], cap)
