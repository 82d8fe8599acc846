"""Selective unsharding: which unsharded params stay alive from forward to backward.

[Note: selective unsharding]
Stage 3 frees every unsharded param after forward and gathers it again in backward.
The first regathers of backward are the most expensive ones: backward starts with the
blocks that forward ran last, and nothing is computing yet that their all-gather could
hide behind. Keeping those params from forward to backward removes both the exposed
wait and a quarter of a step's traffic (forward gather, backward gather, reduce),
at the cost of their unsharded bytes for the length of the step.

``plan_kept_params`` spends ``unsharded_budget`` bytes on whole blocks (``layers.15``,
or a module outside indexed containers, such as ``model.output``, on its own), starting
from the block registered last (forward reaches it last in sequential models) and
walking back. A block that does not fit ends the walk, so what is
kept is always a suffix of the model. Shapes, dtypes and module names are the same on
every rank, so every rank keeps the same params and issues the same collectives.

A kept param is gathered in forward as with ``reshard_after_forward=False``: under
``torch.compile`` its gather is not tagged for recomputation, so AOT autograd saves the
gathered param for backward; in eager mode the reshard scope leaves it out.

While gradients accumulate (``fczero.no_sync``), a kept param is gathered once per
accumulation, eager and compiled: the micro-batches after the first reuse that gather,
up to the synced micro-batch (``fczero.stages.ParamState.reused``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from fczero.sharding import ShardSpec

logger = logging.getLogger("fczero")

_INDEXED = re.compile(r"^(.*?\.\d+)(\.|$)")


def block_of(path: str) -> str:
    """The model block a module path belongs to: ``layers.3`` for ``layers.3.attn.wq``;
    the top-level child (``embed``) for a path outside indexed containers."""
    match = _INDEXED.match(path)
    if match:
        return match.group(1)
    return path.split(".")[0]


def plan_kept_params(
    params: Sequence[tuple[str, torch.Tensor, ShardSpec]], budget: int
) -> set[int]:
    """``id`` of every param to keep unsharded, given ``(module path, param, spec)`` in
    registration order (a param shared by several modules appears once, under its first
    owner). Whole blocks are kept from the last one back while they fit in ``budget``."""
    if budget <= 0:
        return set()
    blocks: dict[str, list[tuple[torch.Tensor, ShardSpec]]] = {}
    for path, param, spec in params:
        # a module outside indexed containers is a unit of its own: the head of
        # ``model.output`` must not share a unit with ``model.embed``
        unit = block_of(path) if _INDEXED.match(path) else path
        blocks.setdefault(unit, []).append((param, spec))
    kept: set[int] = set()
    spent = 0
    names = []
    for name, members in reversed(blocks.items()):
        size = sum(spec.unsharded_bytes(param) for param, spec in members)
        if spent + size > budget:
            break
        spent += size
        kept.update(id(param) for param, _ in members)
        names.append(name)
    logger.info(
        "selective unsharding: keeping %d blocks (%s) unsharded from forward to backward, "
        "%.1f MiB of unsharded_budget=%.1f MiB",
        len(names),
        ", ".join(reversed(names)) or "none",
        spent / 2**20,
        budget / 2**20,
    )
    return kept
