"""Eager prefetch: the gather of the next params is in flight while this module computes.

The first eager forward of a parallelized root records the order in which params
are gathered (every rank runs the same code, so every rank records the same order).
Later forwards replay it: when the n-th gather is asked for, the gathers that follow
it are issued too, up to ``window`` bytes of unsharded params ahead; each returns an
``AsyncCollectiveTensor`` at once, so the all-gather runs on the communication
stream while the current module computes, and its wait happens at first use.

If a forward asks for params in another order than recorded (a data-dependent
branch), prefetching stops for that forward and the order is recorded anew.

Gathers inside a selective activation-checkpointing region are never prefetched nor
issue others: selective checkpointing records the ops a region runs in forward and
expects the same ops when backward recomputes it, where nothing is prefetched. Such
gathers are marked in the recorded order and run in place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.utils.checkpoint
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

if TYPE_CHECKING:
    from fczero.sharding import ShardSpec

logger = logging.getLogger("fczero")

Gather = Callable[["ShardSpec", torch.Tensor], torch.Tensor]


class EagerPrefetch:
    """Per-root state: the recorded gather order and one forward's prefetched gathers."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.order: list[tuple[ShardSpec, torch.Tensor]] | None = None
        self.in_place: set[int] = set()  # positions in ``order`` never prefetched
        self._seen: list[tuple[ShardSpec, torch.Tensor]] = []
        self._seen_in_place: set[int] = set()
        self._ready: dict[int, torch.Tensor] = {}
        self._cursor = 0
        self._issued = 0
        self._replaying = False

    def start(self) -> None:
        self._seen, self._ready, self._cursor, self._issued = [], {}, 0, 0
        self._seen_in_place = set()
        self._replaying = self.order is not None and self.window > 0

    def gather(self, spec: ShardSpec, param: torch.Tensor, gather: Gather) -> torch.Tensor:
        n = self._cursor
        self._cursor += 1
        self._seen.append((spec, param))
        if _in_selective_checkpoint():
            self._seen_in_place.add(n)
            return gather(spec, param)  # see the module docstring
        if not self._replaying:
            return gather(spec, param)
        if n >= len(self.order) or self.order[n][1] is not param:
            logger.info(
                "fczero: gather order changed at gather %d; eager prefetch off this step", n
            )
            self._replaying = False  # what was prefetched belongs to other params: never use it
            return gather(spec, param)
        full = self._ready.pop(n, None)
        if full is None:
            full = gather(spec, param)
        self._issue_ahead(n, gather)
        return full

    def _issue_ahead(self, n: int, gather: Gather) -> None:
        """Issue the gathers after the n-th while they fit in the window (at least one)."""
        ahead = sum(self._bytes(i) for i in self._ready if i > n)
        j = max(self._issued, n + 1)
        while j < len(self.order):
            if j in self.in_place:
                j += 1
                continue
            spec, param = self.order[j]
            size = self._bytes(j)
            if ahead and ahead + size > self.window:
                break
            self._ready[j] = gather(spec, param)
            ahead += size
            j += 1
        self._issued = j

    def _bytes(self, i: int) -> int:
        spec, param = self.order[i]
        return spec.unsharded_bytes(param)

    def finish(self) -> None:
        """End of forward: keep the order seen; wait for (and drop) unused prefetches."""
        if self._cursor:
            self.order, self.in_place = self._seen, self._seen_in_place
        for full in self._ready.values():
            if isinstance(full, AsyncCollectiveTensor):
                full.wait()
        self._ready, self._seen, self._replaying = {}, [], False
        self._seen_in_place = set()


def _in_selective_checkpoint() -> bool:
    """True inside the forward of a selective activation-checkpointing region."""
    caching = getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None)
    return caching is not None and any(
        isinstance(mode, caching) for mode in _get_current_dispatch_mode_stack()
    )


active: EagerPrefetch | None = None
