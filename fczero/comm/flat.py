"""Several shards gathered together: where each lies, and the copies in and out.

An eager bucket (``fczero.runtime.eager_buckets``) gathers and reduces its members with one
coalesced collective each way, each member in a tensor of its own:

    padded(ranks=1):      each shard cast and padded to its rows per rank (itself where
                          it needs neither; the others one _foreach_copy_ into one buffer)
    gather:               one all_gather_into_tensor_coalesced -> each member's
                          [world * rows per rank, ...], its padding rows a narrow away
    padded(ranks=world):  each grad cast and padded to world * rows per rank (same rule)
    reduce:               one reduce_scatter_tensor_coalesced -> each member's rows per rank

The refresh of stage 1/2's whole copies (``fczero.runtime.param_states``) gathers one flat
buffer instead, and copies each param out of it:

    copy_in:  each shard, cast and padded to its rows per rank, laid end to end (one op)
    gather:   one all_gather_into_tensor -> [world, sum of padded numels]; shard k of
              rank r lies at [r, offset_k : offset_k + numel_k]
    copy_out: each param's rows of every rank into storage of its own (one
              split_with_sizes_copy), its padding rows dropped

A compiled bucket of reduces (``fczero.passes.bucketing``) lays its grads out with
``fczero::chunk_cat``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class FlatLayout:
    """Where one shard lies in the flat buffer (and its param in the whole)."""

    rows_per_rank: int
    local_rows: int
    whole_rows: int  # the unsharded param's dim 0
    row_shape: tuple[int, ...]  # dims after the first
    shard_dtype: torch.dtype
    numel: int = field(init=False)  # one rank's padded rows, flattened (read on every step)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", self.rows_per_rank * math.prod(self.row_shape))


@torch.no_grad()
def copy_in(dtype: torch.dtype, layouts: tuple[FlatLayout, ...], shards: list[torch.Tensor]) -> torch.Tensor:
    """The all-gather input: every shard cast to ``dtype`` and padded with zero rows to
    its rows per rank, laid end to end (one op when no shard needs padding)."""
    flat = shards[0].new_empty(sum(layout.numel for layout in layouts), dtype=dtype)
    if all(layout.local_rows == layout.rows_per_rank for layout in layouts):
        return torch.cat([shard.reshape(-1) for shard in shards], out=flat)
    targets, sources, offset = [], [], 0
    for shard, layout in zip(shards, layouts):
        rows = flat[offset : offset + layout.numel].view(layout.rows_per_rank, *layout.row_shape)
        offset += layout.numel
        rows[layout.local_rows :].zero_()
        if layout.local_rows:
            targets.append(rows[: layout.local_rows])
            sources.append(shard)
    if targets:  # (none where this rank holds no rows of any member: uneven shards)
        torch._foreach_copy_(targets, sources)
    return flat


@torch.no_grad()
def padded(
    sources: list[torch.Tensor] | tuple[torch.Tensor, ...],
    layouts: tuple[FlatLayout, ...],
    dtype: torch.dtype,
    *,
    ranks: int,
    reuse: bool,
) -> list[torch.Tensor]:
    """Each source as a contiguous ``[ranks * rows_per_rank, *row_shape]`` tensor in
    ``dtype``, its rows past the source's zero: the inputs of a coalesced collective (an
    all-gather's shards: ``ranks=1``; a reduce-scatter's grads: ``ranks`` = the group's).

    [Note: one copy for a bucket's collective inputs]
    A source that needs no cast and no padding rows is its own input when ``reuse`` is
    set: the collective only reads it (an all-gather reads a shard, an averaging
    reduce-scatter a grad). Every other source is copied into its place in one buffer
    for all of them, by one ``_foreach_copy_``, which casts on the way: one kernel
    launch for the bucket where ``torch.cat`` launches one copy per member once it
    casts. A source that a collective may change in place (the division before a summing
    reduce-scatter) is never reused."""
    own = [
        reuse
        and src.dtype == dtype
        and src.shape[0] == ranks * layout.rows_per_rank
        and src.is_contiguous()
        for src, layout in zip(sources, layouts)
    ]
    if all(own):
        return list(sources)
    flat = sources[0].new_empty(
        ranks * sum(layout.numel for layout, o in zip(layouts, own) if not o), dtype=dtype
    )
    inputs, targets, copied, offset = [], [], [], 0
    for src, layout, o in zip(sources, layouts, own):
        if o:
            inputs.append(src)
            continue
        rows = ranks * layout.rows_per_rank
        place = flat[offset : offset + ranks * layout.numel].view(rows, *layout.row_shape)
        offset += ranks * layout.numel
        inputs.append(place)
        if src.shape[0] < rows:
            place[src.shape[0] :].zero_()
        if src.shape[0]:
            targets.append(place[: src.shape[0]])
            copied.append(src)
    if targets:
        torch._foreach_copy_(targets, copied)
    return inputs


def copy_out(gathered: torch.Tensor, world: int, layouts: tuple[FlatLayout, ...]) -> list[torch.Tensor]:
    """Every shard's whole param out of the gathered buffer, each in storage of its own,
    without its padding rows (one copy for all: each rank's rows of a param lie apart in
    the buffer)."""
    outs = [
        gathered.new_empty((world * layout.rows_per_rank, *layout.row_shape)) for layout in layouts
    ]
    torch.split_with_sizes_copy(
        gathered.view(world, -1),
        [layout.numel for layout in layouts],
        dim=1,
        out=[out.view(world, layout.numel) for out, layout in zip(outs, layouts)],
    )
    return [
        out if out.shape[0] == layout.whole_rows else out.narrow(0, 0, layout.whole_rows)
        for out, layout in zip(outs, layouts)
    ]


#: The ``fczero`` ops defined without ``torch.library.custom_op``: such an op has no
#: Python autograd layer to pass through on each call ([Note: a bare op]).
_LIBRARY = torch.library.Library("fczero", "FRAGMENT")
_LIBRARY.define("chunk_cat(Tensor[] grads, int world) -> Tensor")


def _chunk_cat(grads: list[torch.Tensor], world: int) -> torch.Tensor:
    """The input of a compiled bucket's reduce-scatter, in one op: ``[world, n]`` whose row
    ``r`` is rank ``r``'s rows of every grad, grad after grad (each grad's dim 0 divides by
    ``world``). ``torch._chunk_cat`` does it in one kernel on CUDA; Inductor would lower it
    to a ``cat``, which copies each grad an extern kernel made (a matmul's) in a kernel of
    its own ([Note: one copy-in per bucket] in ``fczero.passes.bucketing``).

    [Note: a bare op]
    The op runs only inside compiled backward graphs, on grads that need no grad of their
    own, so it is defined with ``torch.library.Library`` and one kernel for every backend
    (``CompositeExplicitAutograd``), not with ``torch.library.custom_op``: the latter
    routes each call through its Python autograd wrapper, which took 17.2 us a call on the
    CPU against 8.4 us for this definition (2-core VM, torch 2.13, nine (32, 32) grads,
    2026-11-26). Called on tensors that require grad, it warns that it has no autograd
    formula (torch's fallback for such ops)."""
    return torch._chunk_cat(grads, 0, world)


_LIBRARY.impl("chunk_cat", _chunk_cat, "CompositeExplicitAutograd")


@torch.library.register_fake("fczero::chunk_cat")
def _(grads: list[torch.Tensor], world: int) -> torch.Tensor:
    return grads[0].new_empty((world, sum(g.numel() // world for g in grads)))


chunk_cat = torch.ops.fczero.chunk_cat.default  # (the op overload graph passes insert)
