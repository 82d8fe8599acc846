"""Eager bucketing: one all-gather for several params, and one reduce-scatter for their grads.

[Note: eager buckets]
Compiled graphs get their buckets from a graph pass; an eager forward has no graph, but
from its second step on it has the order in which its params are gathered
(``fczero.runtime.prefetch``), the same on every rank. ``plan`` cuts that order into buckets:
runs of consecutive gathers of up to ``bucket_bytes`` unsharded bytes (at least one
gather each) whose params share a process group and a gathered dtype. A 0-d param, a
tensor-parallel one, one in host memory (``OffloadPolicy(params=True)``) and any gather inside a
selective-checkpointing region stay on their own.

When the prefetcher reaches a bucket it issues it whole, through ``gather_bucket``:

    forward:  pad and cast each shard -> concatenate -> one all_gather_into_tensor
              -> per member, a [world, rows per rank x row size] view of the result
    hand-off: the member's view -> its unsharded shape (a copy: each rank's rows are
              apart in the gathered buffer) -> the module
    backward: every member's grad, rank-major -> concatenate -> average -> one
              reduce_scatter_tensor (HSDP: then one all-reduce) -> each shard's rows

Autograd runs a node's backward once the grads of all its outputs are in, so the
reduce-scatter waits for the last of its members' grads: a bucket of one block reduces
when that block's backward is done. A member that is never handed off (the order
changed mid-forward) receives a zero grad here, and its param is gathered on its own
instead, so the sum is still right. The copy at hand-off gives every member its own
storage, which the eager reshard hooks (``fczero.runtime.resharding``) key on.

Backward's regathers of saved params are bucketed the same way (``regather_bucket``,
no autograd): ``plan`` cuts the list of saved params, in the order first saved, and a
regather issues its member's whole bucket; each member is copied out (``unsharded``)
when backward unpacks it. These buckets exist from the first step on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from fczero.comm import collectives
from fczero.comm.buckets import plan_items
from fczero.core.spec import eager_local

if TYPE_CHECKING:
    from fczero.core.spec import ShardSpec


@dataclass(frozen=True)
class _Layout:
    """What the bucket's backward needs of one member."""

    rows_per_rank: int
    local_rows: int
    row_shape: tuple[int, ...]  # dims after the first
    shard_dtype: torch.dtype

    @property
    def numel(self) -> int:  # one rank's padded rows, flattened
        return self.rows_per_rank * math.prod(self.row_shape)


def fits(ahead: int, size: int, window: int) -> bool:
    """Whether a gather of ``size`` bytes may be issued beside ``ahead`` bytes already in
    flight: within ``window``, and always when nothing is in flight (one at least)."""
    return not ahead or ahead + size <= window


def can_bucket(spec: ShardSpec) -> bool:
    """Whether ``spec``'s gather may share a bucket (see the note for what may not)."""
    return not spec.is_scalar and spec.tensor_parallel is None and spec.compute_device is None


def bucket_key(spec: ShardSpec, param: torch.Tensor) -> tuple:
    """Gathers may share a bucket only under equal keys (one group, one gathered dtype)."""
    dtype = spec.param_dtype or param.dtype
    return (spec.group_name, spec.group_size, spec.replicate, dtype)


def plan(entries: list[tuple[ShardSpec, torch.Tensor, bool]], bucket_bytes: int) -> list[list[int]]:
    """Buckets (lists of positions in ``entries``, the recorded gather order) of two or
    more consecutive gathers; positions in no bucket are gathered on their own."""
    items = [
        (
            bucket_key(spec, param) if not in_place and can_bucket(spec) else None,
            spec.unsharded_bytes(param),
        )
        for spec, param, in_place in entries
    ]
    return [b for b in plan_items(items, bucket_bytes) if len(b) > 1]


def _gather_flat(
    spec0: ShardSpec, layouts: tuple[_Layout, ...], shards: list[torch.Tensor]
) -> list[torch.Tensor]:
    """One all-gather of the bucket's shards; per member, its ``[world, numel]`` view of
    the result (asynchronous in eager)."""
    rows = [layout.rows_per_rank for layout in layouts]
    return collectives.all_gather_flat(
        shards, rows, spec0.param_dtype, spec0.group_size, spec0.group_name
    )


def _layouts(members: list[tuple[ShardSpec, torch.Tensor]]) -> tuple[_Layout, ...]:
    return tuple(
        _Layout(spec.rows_per_rank, spec.local_rows, tuple(spec.shape[1:]), param.dtype)
        for spec, param in members
    )


class _GatherBucket(torch.autograd.Function):
    """All-gather of a bucket's shards in forward, reduce-scatter of their grads in backward."""

    @staticmethod
    def forward(ctx, spec0: ShardSpec, layouts: tuple[_Layout, ...], *shards):  # type: ignore[override]
        ctx.meta = (spec0, layouts)
        return tuple(_gather_flat(spec0, layouts, list(shards)))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        spec0, layouts = ctx.meta
        dtype = spec0.reduce_dtype or grads[0].dtype
        world = spec0.group_size
        flat = torch.cat([g.to(dtype).reshape(world, -1) for g in grads], dim=1)
        flat = collectives._average(flat, world, spec0.replicate)
        reduced = collectives.reduce_scatter_sum(flat.reshape(-1), world, spec0.group_name)
        reduced = collectives._over_replicas(reduced, spec0.replicate)
        out, offset = [], 0
        for layout in layouts:
            piece = reduced[offset : offset + layout.numel]
            offset += layout.numel
            piece = piece.view(layout.rows_per_rank, *layout.row_shape)[: layout.local_rows]
            out.append(collectives._to(piece, layout.shard_dtype))
        return (None, None, *out)


def gather_bucket(members: list[tuple[ShardSpec, torch.Tensor]]) -> list[torch.Tensor]:
    """Issue one all-gather for ``members`` (``(spec, sharded param)``, one bucket); per
    member, its slice of the result, to pass to ``hand_off`` (asynchronous in eager)."""
    shards = [eager_local(p) for _, p in members]
    return list(_GatherBucket.apply(members[0][0], _layouts(members), *shards))


@torch.no_grad()
def regather_bucket(members: list[tuple[ShardSpec, torch.Tensor]]) -> list[torch.Tensor]:
    """Backward's regather of a bucket of saved params (no autograd: nothing reduces
    through it); per member, its slice, to pass to ``unsharded``."""
    shards = [p.to_local() if isinstance(p, DTensor) else p for _, p in members]
    return _gather_flat(members[0][0], _layouts(members), shards)


def unsharded(spec: ShardSpec, piece: torch.Tensor) -> torch.Tensor:
    """A member's slice of its bucket -> the unsharded param, in storage of its own
    (waits for the bucket). The reshape usually copies (each rank's rows lie apart in the
    bucket), but with one rank, or one row per rank, it is a view of the whole bucket:
    then it is copied here, since the reshard hooks key gathered params by storage."""
    collectives.wait_on(piece)  # [Note: plain bucket slices]
    full = piece.reshape(spec.group_size * spec.rows_per_rank, *spec.shape[1:])
    if full.untyped_storage().nbytes() != full.numel() * full.element_size():
        full = full.clone()
    if full.shape[0] != spec.shape[0]:
        full = full.narrow(0, 0, spec.shape[0])
    return full
