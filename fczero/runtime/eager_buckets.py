"""Eager bucketing: one all-gather for several params, and one reduce-scatter for their grads.

[Note: eager buckets]
Compiled graphs get their buckets from a graph pass; an eager forward has no graph, but
from its second step on it has the order in which its params are gathered
(``fczero.runtime.prefetch``), the same on every rank. ``plan`` cuts that order into buckets:
runs of consecutive gathers of up to ``bucket_bytes`` unsharded bytes (at least one
gather each) whose params share a process group and a gathered dtype. A 0-d param, a
tensor-parallel one, one in host memory (``OffloadPolicy(params=True)``) and any gather inside a
selective-checkpointing region stay on their own.

When the prefetcher reaches a bucket it issues it whole (``gather_bucket``), and the
bucket works per bucket, never per member, wherever it can:

    issue:     each shard, cast and padded, copied into one flat input (one op)
               -> one all_gather_into_tensor, left in flight
    hand-off:  the first member asked for waits for the collective and copies every
               member out of the gathered buffer into storage of its own (one
               split_with_sizes_copy), under one autograd node for the bucket whose
               inputs are the members' leaves (or sharded params; no node per member)
    backward:  the members' grads laid out rank-major in the reduce dtype (one cat,
               or one _chunk_cat where rows need padding) -> one reduce_scatter_tensor
               that averages (NCCL; elsewhere divided in place first, then summed; HSDP:
               then one all-reduce) -> each shard's rows, the reduce left in flight
               ([Note: a reduce-scatter left in flight] in
               fczero.comm.collectives)

[Note: a bucket never spans two units]
A unit (``fczero.runtime.units``) asks for all its params when its forward begins. A
bucket that held the last params of one unit and the first of the next would have to be
issued and waited for when the first unit begins, however far ahead the prefetch ran: on
2 x H200 (regime M, 953M model, blocks of 98 MiB in 128 MiB buckets) the eager step took
100.4 ms with such buckets against 74.9 ms gathering on each read. So a bucket ends
where a unit does (``bucket_key``), and a unit's gathers, and its regathers, issue as a
whole.

Over one rank nothing is communicated ([Note: a bucket of one rank]): each member is its
shard, cast, copied once, and in backward each grad is cast once to the reduce dtype, into
storage of its own (no flat buffer to lay out and split again).

[Note: frozen members of a bucket]
The bucket's node outputs require grad as soon as one member's param does, so a frozen
param in a bucket with trainable ones would come out requiring grad, where its own gather
gives a tensor that does not. Autograd would then compute its grad for nothing, and a
checkpointed block would save other tensors in forward than in its recompute, whichever
of the two gathers the other ran (torch raises ``CheckpointError``). A frozen member is
handed out detached.

One wait, one copy-in, one copy-out and one grad layout per bucket: the number of
kernels and Python calls per step follows the buckets, not the params. Autograd runs
the bucket node's backward once the grads of all its outputs are in, so the
reduce-scatter waits for the last of its members' grads: a bucket of one block reduces
when that block's backward is done. A member that is never handed off (the order
changed mid-forward) gets a zero grad here, and its param is gathered on its own
instead, so the sum is still right. Each member has a storage of its own, which the
eager reshard hooks (``fczero.runtime.resharding``) key on.

Backward's regathers of saved params are bucketed the same way (``regather_bucket``,
no autograd): ``plan`` cuts the list of saved params, in the order first saved, and a
regather issues its member's whole bucket; the first member that backward unpacks
copies them all out. These buckets exist from the first step on, and are planned again
only when the saved list changes (``fczero.runtime.resharding.RegatherPlans``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from fczero.comm import collectives
from fczero.comm.buckets import plan_items
from fczero.comm.flat import FlatLayout, copy_in, copy_out
from fczero.core.spec import sharded_grad

if TYPE_CHECKING:
    from fczero.core.spec import ShardSpec


def fits(ahead: int, size: int, window: int) -> bool:
    """Whether a gather of ``size`` bytes may be issued beside ``ahead`` bytes already in
    flight: within ``window``, and always when nothing is in flight (one at least)."""
    return not ahead or ahead + size <= window


def can_bucket(spec: ShardSpec) -> bool:
    """Whether ``spec``'s gather may share a bucket (see the note for what may not)."""
    return not spec.is_scalar and spec.tensor_parallel is None and spec.compute_device is None


def bucket_key(spec: ShardSpec, param: torch.Tensor) -> tuple:
    """Gathers may share a bucket only under equal keys (one group, one gathered dtype,
    one unit: see [Note: a bucket never spans two units])."""
    dtype = spec.param_dtype or param.dtype
    return (spec.group_name, spec.group_size, spec.replicate, dtype, spec.unit_path)


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


def positions(
    entries: list[tuple[ShardSpec, torch.Tensor, bool]], bucket_bytes: int, sizes: list[int]
) -> tuple[dict[int, list[int]], list[int]]:
    """``plan`` as the prefetch windows read it: each position's bucket (positions in
    none are absent), and the bytes that issuing each position puts in flight (``sizes``:
    each entry's unsharded bytes)."""
    bucket_of = {i: bucket for bucket in plan(entries, bucket_bytes) for i in bucket}
    return bucket_of, issue_bytes(sizes, bucket_of)


def issue_bytes(sizes: list[int], bucket_of: dict[int, list[int]]) -> list[int]:
    """Per position, the unsharded bytes that issuing it puts in flight: its whole
    bucket's when it has one (so a prefetch window looks each up once, not per member)."""
    total = list(sizes)
    for bucket in {id(b): b for b in bucket_of.values()}.values():
        nbytes = sum(sizes[i] for i in bucket)
        for i in bucket:
            total[i] = nbytes
    return total


def unit_goes_on(entries: list[tuple[ShardSpec, torch.Tensor, bool]]) -> list[bool]:
    """Per position of the recorded order, whether its gather belongs to the same unit as
    the gather before it ([Note: the next unit goes out whole] in fczero.runtime.prefetch);
    a param in no unit never does."""
    paths = [spec.unit_path for spec, _, _ in entries]
    return [i > 0 and path is not None and path == paths[i - 1] for i, path in enumerate(paths)]


def rank_major(
    grads: tuple[torch.Tensor, ...], layouts: tuple[FlatLayout, ...], world: int, out: torch.Tensor
) -> None:
    """The reduce-scatter input: each grad cut into ``world`` chunks of its rows per rank,
    cast to ``out``'s dtype and laid out rank-major in ``out`` (``[world, sum of numels]``).

    [Note: laying grads out rank-major]
    When no grad needs padding rows, each is viewed as ``[world, numel]``. Of the same
    dtype as ``out``, one ``cat`` along dim 1 lays them out in one kernel. Cast on the way
    (bf16 grads, fp32 reduce: the default), ``cat`` copies each grad on its own into a
    strided ``[world, numel]`` slice, which CUDA's copy does not vectorize; one
    ``_foreach_copy_`` of each rank's contiguous chunk into its contiguous place casts
    them all in one kernel launch. On one H200 (torch 2.11) laying out a decoder block of
    Llama-3.2-3B's shape (nine grads, 2 ranks) took 201 us of GPU time this way against
    363 us with ``cat``, for 223 against 137 us of host time: 4.5 ms less GPU time over
    28 blocks (from that micro-benchmark; the two layouts were not timed side by side in a
    whole step).

    ``_chunk_cat`` pads as well, but its host time is the larger: on one H100 (torch 2.11)
    laying out one block's six bf16 grads of the 953M benchmark model as fp32 took 218-223
    us of host time per call with ``_chunk_cat`` against 59-63 us with ``cat``, and in the
    eager regime-M profile ``_chunk_cat`` was fczero's costliest op on the host (546 us per
    call). It is kept for buckets that need padding."""
    if not all(g.shape[0] == world * layout.rows_per_rank for g, layout in zip(grads, layouts)):
        torch._chunk_cat([g.contiguous() for g in grads], dim=0, num_chunks=world, out=out)
    elif all(g.dtype == out.dtype for g in grads):
        torch.cat([g.reshape(world, -1) for g in grads], dim=1, out=out)
    else:
        numels = [layout.numel for layout in layouts]
        places = [row.split(numels) for row in out.unbind(0)]
        chunks = [g.reshape(world, -1).unbind(0) for g in grads]
        torch._foreach_copy_(
            [place for row in places for place in row],
            [chunks[k][r] for r in range(world) for k in range(len(grads))],
        )


def _copy_out(
    gathered: torch.Tensor | list[torch.Tensor],
    world: int,
    layouts: tuple[FlatLayout, ...],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Every member's unsharded param in storage of its own: out of the gathered buffer,
    or, over one rank, out of the shards themselves.

    [Note: a bucket of one rank]
    Over one rank in eager nothing is gathered ([Note: one rank communicates nothing in
    eager]), and each shard is its whole param (no padding rows), so laying the shards end
    to end and splitting them again would copy every byte twice: each shard is copied
    once, cast to the gathered dtype, into storage of its own. That is one kernel per
    member instead of two ops per bucket (a ``cat`` over the members and a
    ``split_with_sizes_copy`` into a new buffer per member), and the bucket's gathered
    bytes are written once instead of twice. Backward mirrors it (``_own_grads``): each
    grad is cast to the reduce dtype once, where the flat layout cost a ``cat`` and, per
    member, a view to lay it out and a slice and a view to take it out again."""
    if isinstance(gathered, list):
        return [shard.to(dtype, copy=True) for shard in gathered]
    return copy_out(gathered, world, layouts)


class _BucketGather(torch.autograd.Function):
    """The autograd node of one bucket: the copy-out in forward (the all-gather ran
    before, outside autograd), the bucket's one reduce-scatter in backward. Its inputs
    are what each member's gather differentiates (``ParamState.differentiated``: the
    plain leaf, whose hook wraps the grad for the param, or the sharded param itself,
    which gets its grad as a DTensor laid out like it, ``sharded_grad``): one node for
    the bucket, not one more per member to take each shard out of its DTensor."""

    @staticmethod
    def forward(ctx, spec0: ShardSpec, layouts: tuple[FlatLayout, ...], dtype, gathered, *params):  # type: ignore[override]
        ctx.meta = (spec0, layouts)
        ctx.specs = tuple(p._spec if isinstance(p, DTensor) else None for p in params)
        return tuple(_copy_out(gathered, spec0.group_size, layouts, dtype))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        spec0, layouts = ctx.meta
        world, replicate = spec0.group_size, spec0.replicate
        reduce_dtype = collectives.reduce_dtype_of(grads[0], spec0.reduce_dtype)
        if collectives.alone(world) and replicate is None:
            pieces = _own_grads(grads, layouts, reduce_dtype)
        else:
            flat = grads[0].new_empty(
                (world, sum(layout.numel for layout in layouts)), dtype=reduce_dtype
            )
            rank_major(grads, layouts, world, flat)
            if replicate is None and not torch.is_grad_enabled():
                reduced = collectives.reduce_scatter_mean_in_flight(
                    flat.view(-1), world, spec0.reduce_group_name
                )
                # ([Note: a reduce-scatter left in flight])
                collectives.hold_in_flight(reduced, spec0.unit_path)
            else:  # (HSDP's all-reduce, and a double backward's grads, need it now)
                collectives.average_(flat, world, replicate)
                reduced = collectives.reduce_scatter_sum(flat.view(-1), world, spec0.reduce_group_name)
                reduced = collectives.over_replicas(reduced, replicate)
            pieces = _shard_rows(reduced, layouts)
        out = [
            sharded_grad(piece, spec) if spec is not None else piece
            for piece, spec in zip(pieces, ctx.specs)
        ]
        return (None, None, None, None, *out)


def _own_grads(
    grads: tuple[torch.Tensor, ...], layouts: tuple[FlatLayout, ...], reduce_dtype: torch.dtype
) -> list[torch.Tensor]:
    """Over one rank (no replicas) each member's grad is its shard's: cast to the reduce
    dtype into storage of its own, then to the shard's dtype (one op per member when the
    two dtypes agree, as they do by default; [Note: a bucket of one rank]). The copy is
    made even where no cast is needed: autograd may hand one tensor to several outputs
    (the grads of ``a + b``, or the caller's own grad tensor), and no two params, nor the
    caller, may share a grad that an optimizer or a clip then changes in place."""
    return [
        collectives.cast_to(grad.to(reduce_dtype, copy=True), layout.shard_dtype)
        for grad, layout in zip(grads, layouts)
    ]


def _shard_rows(reduced: torch.Tensor, layouts: tuple[FlatLayout, ...]) -> list[torch.Tensor]:
    """Each member's rows of this rank's reduced flat shard, in its shard's dtype: one
    split for the bucket, a view per member, a slice only where padding rows follow. A
    cast reads the rows, so a reduce still in flight is waited first."""
    if any(layout.shard_dtype != reduced.dtype for layout in layouts):
        collectives.wait_on(reduced)
    pieces = []
    for piece, layout in zip(reduced.split([layout.numel for layout in layouts]), layouts):
        piece = piece.view(layout.rows_per_rank, *layout.row_shape)
        if layout.local_rows != layout.rows_per_rank:
            piece = piece[: layout.local_rows]
        pieces.append(collectives.cast_to(piece, layout.shard_dtype))
    return pieces


class Bucket:
    """One issued bucket: its all-gather in flight, then its members, all copied out when
    the first is asked for (``member``). Each member is handed out once; the bucket then
    drops it, so a member lives only as long as its consumer keeps it."""

    def __init__(self, members: list[tuple[ShardSpec, torch.Tensor]], *, differentiable: bool) -> None:
        self.spec0 = members[0][0]
        self.layouts = tuple(spec.flat_layout(param.dtype) for spec, param in members)
        shards = [p._local_tensor if isinstance(p, DTensor) else p for _, p in members]
        # the sharded params, when the grads come back through this bucket (``member``)
        self._params: list[torch.Tensor] | None = (
            [p for _, p in members] if differentiable else None
        )
        # members whose params are frozen: handed out detached, as their own gather would
        # be ([Note: frozen members of a bucket])
        self._frozen = [not p.requires_grad for _, p in members] if differentiable else None
        self.dtype = self.spec0.param_dtype or members[0][1].dtype
        self._gathered: torch.Tensor | None = None
        self._shards: list[torch.Tensor] | None = None
        if collectives.alone(self.spec0.group_size):
            self._shards = shards  # copied out one by one ([Note: a bucket of one rank])
        else:
            gathered = collectives.all_gather(
                copy_in(self.dtype, self.layouts, shards),
                self.spec0.group_size,
                self.spec0.group_name,
            )
            # a plain tensor, waited once for the bucket ([Note: plain bucket slices])
            self._gathered = gathered.elem if isinstance(gathered, AsyncCollectiveTensor) else gathered
        self._members: list[torch.Tensor | None] | None = None

    def member(self, k: int) -> torch.Tensor:
        """The k-th member's unsharded param (waits for the bucket the first time)."""
        if self._members is None:
            gathered = self.settle() if self._shards is None else self._shards
            if self._params is not None:
                outs = _BucketGather.apply(
                    self.spec0, self.layouts, self.dtype, gathered, *self._params
                )
            else:
                with torch.no_grad():
                    outs = _copy_out(gathered, self.spec0.group_size, self.layouts, self.dtype)
            self._members, self._gathered, self._shards, self._params = list(outs), None, None, None
        full, self._members[k] = self._members[k], None
        if full is None:
            raise RuntimeError(f"fczero: bucket member {k} was handed out twice (an internal error)")
        if self._frozen is not None and self._frozen[k]:
            return full.detach()
        return full

    def settle(self) -> torch.Tensor | None:
        """Wait for the bucket's all-gather (at most once); returns its plain result, or
        None once the members are out."""
        if self._gathered is not None:
            collectives.wait_on(self._gathered)
        return self._gathered


def gather_bucket(members: list[tuple[ShardSpec, torch.Tensor]]) -> Bucket:
    """Issue one all-gather for ``members`` (``(spec, sharded param)``, one bucket) whose
    grads come back through one reduce-scatter (asynchronous in eager)."""
    return Bucket(members, differentiable=True)


def regather_bucket(members: list[tuple[ShardSpec, torch.Tensor]]) -> Bucket:
    """Backward's regather of a bucket of saved params (no autograd: nothing reduces
    through it)."""
    return Bucket(members, differentiable=False)
