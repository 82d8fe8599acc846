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

    issue:     each shard, cast and padded, as its own input (one _foreach_copy_ for
               the bucket, none where the shards need neither)
               -> one all_gather_into_tensor_coalesced, left in flight; each member
               gathered into a tensor of its own
    hand-off:  the first member asked for waits for the collective, under one autograd
               node for the bucket whose inputs are the members' leaves (or sharded
               params; no node per member); nothing is copied out
    backward:  the members' grads cast to the reduce dtype and padded (one
               _foreach_copy_, none where a grad needs neither)
               -> one reduce_scatter_tensor_coalesced that averages (NCCL; elsewhere
               divided in place first, then summed; HSDP: then one coalesced all-reduce)
               -> each shard's rows, the reduce left in flight ([Note: a reduce-scatter
               left in flight] in fczero.comm.collectives)

[Note: coalesced, not flat]
A bucket once laid its shards end to end in one flat buffer, gathered it with one
all_gather_into_tensor and copied each member out of the result (each rank's rows of a
member lie apart in ``[world, total]``), and in backward laid its grads out rank-major
for one reduce_scatter_tensor. A coalesced collective takes a list: NCCL runs the
members' all-gathers (or reduce-scatters) as one grouped launch, into one output per
member, so each member's gathered rows come out as its whole param and its reduced rows
as its shard's grad, and neither copy is made. On 2 x H200 (torch 2.11, NCCL 2.28.9,
one decoder block of Llama-3.2-3B's shape, fp32 shards gathered in bf16) the gather took
529-531 us of GPU time coalesced against 636-653 us flat, and the fp32 reduce of bf16
grads 1,018 us against 1,023, its host time 176 us against 325 (a micro-benchmark, not
a whole step).

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

One collective, at most one copy-in and one grad layout per bucket, and a wait per
member below autograd (each output of a coalesced collective is registered on its own):
the number of kernels and Python-level ops per step follows the buckets, not the params.
Autograd runs the bucket node's backward once the grads of all its outputs are in, so the
reduce-scatter waits for the last of its members' grads: a bucket of one block reduces
when that block's backward is done. A member that is never handed off (the order
changed mid-forward) gets a zero grad here, and its param is gathered on its own
instead, so the sum is still right. Each member has a storage of its own, which the
eager reshard hooks (``fczero.runtime.resharding``) key on.

Backward's regathers of saved params are bucketed the same way (``regather_bucket``,
no autograd): ``plan`` cuts the list of saved params, in the order first saved, and a
regather issues its member's whole bucket; the first member that backward unpacks
hands them all out. These buckets exist from the first step on, and are planned again
only when the saved list changes (``fczero.runtime.resharding.RegatherPlans``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from fczero.comm import collectives
from fczero.comm.buckets import plan_items
from fczero.comm.flat import FlatLayout
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


def _wholes(
    gathered: list[torch.Tensor],
    layouts: tuple[FlatLayout, ...],
    dtype: torch.dtype,
    alone: bool,
) -> list[torch.Tensor]:
    """Every member's unsharded param, each in storage of its own: the gathered rows
    without their padding, or, over one rank, the shards themselves, copied.

    [Note: a bucket of one rank]
    Over one rank in eager nothing is gathered ([Note: one rank communicates nothing in
    eager]), and each shard is its whole param (no padding rows): each is copied once,
    cast to the gathered dtype, into storage of its own (the reshard hooks key members by
    storage, and a module must not write into a shard). Backward mirrors it
    (``_own_grads``): each grad is cast to the reduce dtype once."""
    if alone:
        return [shard.to(dtype, copy=True) for shard in gathered]
    return [
        out if out.shape[0] == layout.whole_rows else out.narrow(0, 0, layout.whole_rows)
        for out, layout in zip(gathered, layouts)
    ]


class _BucketGather(torch.autograd.Function):
    """The autograd node of one bucket: the hand-off in forward (the all-gather ran
    before, outside autograd), the bucket's one reduce-scatter in backward. Its inputs
    are what each member's gather differentiates (``ParamState.differentiated``: the
    plain leaf, whose hook wraps the grad for the param, or the sharded param itself,
    which gets its grad as a DTensor laid out like it, ``sharded_grad``): one node for
    the bucket, not one more per member to take each shard out of its DTensor."""

    @staticmethod
    def forward(ctx, spec0: ShardSpec, layouts: tuple[FlatLayout, ...], dtype, gathered, alone, *params):  # type: ignore[override]
        ctx.meta = (spec0, layouts)
        ctx.specs = tuple(p._spec if isinstance(p, DTensor) else None for p in params)
        return tuple(_wholes(gathered, layouts, dtype, alone))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        spec0, layouts = ctx.meta
        world, replicate = spec0.group_size, spec0.replicate
        reduce_dtype = collectives.reduce_dtype_of(grads[0], spec0.reduce_dtype)
        if collectives.alone(world) and replicate is None:
            pieces = _own_grads(grads, layouts, reduce_dtype)
        else:
            # (a double backward's grads are read at once: not left in flight)
            in_flight = not torch.is_grad_enabled()
            reduced = collectives.reduce_scatter_mean_coalesced(
                grads, layouts, reduce_dtype, world, spec0.reduce_group_name, replicate,
                in_flight=in_flight,
            )
            if in_flight and replicate is None:
                # ([Note: a reduce-scatter left in flight])
                collectives.hold_in_flight(reduced, spec0.unit_path)
            pieces = _shard_rows(reduced, layouts)
        out = [
            sharded_grad(piece, spec) if spec is not None else piece
            for piece, spec in zip(pieces, ctx.specs)
        ]
        return (None, None, None, None, None, *out)


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


def _shard_rows(reduced: list[torch.Tensor], layouts: tuple[FlatLayout, ...]) -> list[torch.Tensor]:
    """Each member's rows of its reduced shard, in its shard's dtype: a view of the
    output, sliced only where padding rows follow. A cast reads the rows, so a reduce
    still in flight is waited first.

    A view, not the output itself, even where it covers the whole output: the reduce left
    in flight holds the output, and a leaf's ``AccumulateGrad`` takes a grad as the
    leaf's own only when nothing else refers to it; otherwise it copies it, a kernel per
    member."""
    pieces = []
    for piece, layout in zip(reduced, layouts):
        if layout.shard_dtype != piece.dtype:
            piece = collectives.wait_on(piece).to(layout.shard_dtype)
        pieces.append(piece[: layout.local_rows])
    return pieces


class Bucket:
    """One issued bucket: its all-gather in flight, then its members, all handed to one
    autograd node when the first is asked for (``member``). Each member is handed out
    once; the bucket then drops it, so a member lives only as long as its consumer keeps
    it."""

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
        self._alone = collectives.alone(self.spec0.group_size)
        # the shards over one rank (copied out one by one: [Note: a bucket of one rank]);
        # otherwise each member's gathered rows, plain tensors waited once ([Note: plain
        # bucket slices])
        self._gathered: list[torch.Tensor] | None = shards
        self._waited = self._alone
        if not self._alone:
            self._gathered = collectives.all_gather_coalesced(
                shards, self.layouts, self.dtype, self.spec0.group_size, self.spec0.group_name
            )
        self._members: list[torch.Tensor | None] | None = None

    def member(self, k: int) -> torch.Tensor:
        """The k-th member's unsharded param (waits for the bucket the first time)."""
        if self._members is None:
            gathered = self.settle()
            if self._params is not None:
                outs = _BucketGather.apply(
                    self.spec0, self.layouts, self.dtype, gathered, self._alone, *self._params
                )
            else:
                with torch.no_grad():
                    outs = _wholes(gathered, self.layouts, self.dtype, self._alone)
            self._members, self._gathered, self._params = list(outs), None, None
        full, self._members[k] = self._members[k], None
        if full is None:
            raise RuntimeError(f"fczero: bucket member {k} was handed out twice (an internal error)")
        if self._frozen is not None and self._frozen[k]:
            return full.detach()
        return full

    def settle(self) -> list[torch.Tensor] | None:
        """Wait for the bucket's all-gather (at most once); returns what the members come
        from, or None once they are out."""
        if not self._waited and self._gathered is not None:
            collectives.wait_all(self._gathered)
            self._waited = True
        return self._gathered


def gather_bucket(members: list[tuple[ShardSpec, torch.Tensor]]) -> Bucket:
    """Issue one all-gather for ``members`` (``(spec, sharded param)``, one bucket) whose
    grads come back through one reduce-scatter (asynchronous in eager)."""
    return Bucket(members, differentiable=True)


def regather_bucket(members: list[tuple[ShardSpec, torch.Tensor]]) -> Bucket:
    """Backward's regather of a bucket of saved params (no autograd: nothing reduces
    through it)."""
    return Bucket(members, differentiable=False)
