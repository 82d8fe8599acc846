"""Bucketing: one collective per bucket of params instead of one per param.

Gathers of one block (and the same group and dtype) become one all-gather of the
concatenated shards; each param is then copied out of its column of the result:

    before                                   after
    ag1 = all_gather(x1); w1 = wait(ag1)     flat = cat([x1.view(-1), x2.view(-1)])
    ag2 = all_gather(x2); w2 = wait(ag2)     ag = all_gather(flat); w = wait(ag)
                                             m = w.view(world, n1 + n2)
                                             w1 = m[:, :n1].clone().view(shape1)
                                             w2 = m[:, n1:].clone().view(shape2)

[Note: copy-out]
Each rank's rows of a param lie apart in the gathered table, so a param's column is
copied out into storage of its own. A column that is contiguous already (at a world
size of 1 the table is one row) is handed out as a view of the table instead: no copy,
and no second copy of the bucket alive while the pieces are made. The table then lives
until its last member's last use, in a bucket of one block about as long as the copies
would. The choice reads shapes only, so it is the same on every rank.

Reduces of one block become one reduce-scatter of the rank-major concatenation
``cat([g1.view(world, -1), g2.view(world, -1)], dim=1)``, split again after the wait.
Under HSDP the all-reduces of the reduced shards over the replicate group are
bucketed the same way: one all-reduce of ``cat([s1.view(-1), s2.view(-1)])``.
Buckets are formed in program order from whole blocks (``matching.block_key``),
packed while they fit in ``bucket_bytes``; a bucket under ``_MIN_BUCKET`` always takes
the next block. All of it reads shapes and module paths only, so every rank forms
the same buckets.

[Note: one copy-in per bucket]
Inductor writes a grad that one of its own kernels makes (a division by the world size,
a cast to ``reduce_dtype``) straight into a ``cat``'s output, but a grad from an extern
kernel (a matmul's) it copies in with a kernel of its own, launched from the host: 86
of them per step on the 16-block toy of ``bench.host_cost`` at one rank on a GPU
(Triton; the C++ backend fuses such copies into one). So a bucket whose grads come from
matmuls with nothing pointwise after them (one rank: no division) is laid out by one
op, ``fczero::chunk_cat`` (``fczero.comm.flat``: ``torch._chunk_cat``, one kernel on
CUDA), at the same bytes; any other keeps the ``cat``. The choice reads the graph's ops
only, the same on every rank.

[Note: small ends]
The first all-gather of a forward has nothing to overlap with, and neither has the last
reduce-scatter of a backward: their time is exposed. So with three or more blocks the
first and the last block of a graph never share a bucket with a neighbour (whatever
``bucket_bytes`` allows), the middle blocks are packed up to the cap, and a model of
three or more blocks never goes out as one collective.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from fczero.comm.buckets import Unit, plan_buckets
from fczero.comm.flat import chunk_cat
from fczero.comm.graph_ops import op_name
from fczero.core.memory import storage_root
from fczero.passes.graph_utils import (
    aten,
    c10d,
    fake_mode_of,
    insert,
    move_before,
    position,
    recompile,
    stable_topological_sort,
    static_sizes,
)
from fczero.passes.matching import Collective, find_gathers, find_reduces

logger = logging.getLogger("fczero")

_MIN_BUCKET = 1 << 20  # 1 MiB: a lone norm weight is not worth its own collective


def plan_collective_buckets(
    collectives: list[Collective], bucket_bytes: int, itemsize: int | None = None
) -> list[list[Collective]]:
    """Group collectives (in program order) into buckets of whole blocks, with the one
    planner (``fczero.comm.buckets``): a block is a unit, keyed by group and dtype.

    A block's collectives stay together (split only if the block alone exceeds
    ``bucket_bytes``), also when a neighbouring block's collectives come between them
    (backward computes a block's small grads, such as norm weights, late); consecutive
    blocks share a bucket while the total fits in ``bucket_bytes``. Fewer, larger
    collectives cost less CPU time to launch; larger buckets keep more gathered bytes
    alive. Group and dtype never mix.

    With three or more blocks, the first and the last block each get a bucket of their
    own ([Note: small ends]). ``itemsize``: count every collective's elements at that many
    bytes (the gathered ``param_dtype``'s), so that a block's fp32 grads make as many
    reduce-scatters as its bf16 params make all-gathers; None counts their own bytes.
    """
    blocks = _blocks(collectives)
    units = [
        Unit(
            _kind(block[0]),
            tuple(c.bytes_as(itemsize) for c in block),
            joins=not (len(blocks) >= 3 and i in (1, len(blocks) - 1)),  # [Note: small ends]
        )
        for i, block in enumerate(blocks)
    ]
    in_order = [c for block in blocks for c in block]
    planned = plan_buckets(units, bucket_bytes, floor=_MIN_BUCKET)
    return [[in_order[i] for i in bucket] for bucket in planned]


def _blocks(collectives: list[Collective]) -> list[list[Collective]]:
    """Collectives grouped by block key, in program order: a collective joins its block's
    group if that group is one of the last two (so two blocks may interleave), else it
    starts a new group."""
    blocks: list[list[Collective]] = []
    for c in collectives:
        home = next(
            (b for b in blocks[-2:] if b[0].block == c.block and _kind(b[0]) == _kind(c)), None
        )
        if home is not None:
            home.append(c)
        else:
            blocks.append([c])
    return blocks


def _kind(c: Collective) -> tuple:
    return (c.group_name, c.dtype)


def bucket_all_gathers_pass(
    gm: fx.GraphModule, groups: set[str], bucket_bytes: int
) -> fx.GraphModule:
    return bucket_collectives(gm, find_gathers(gm.graph, groups), bucket_bytes, _merge_gathers, "all-gathers")


def bucket_reduce_scatters_pass(
    gm: fx.GraphModule, groups: set[str], bucket_bytes: int, itemsize: int | None = None
) -> fx.GraphModule:
    """``itemsize``: see ``plan_collective_buckets`` (the bytes of an element of ``param_dtype``)."""
    reduces = find_reduces(gm.graph, groups)
    return bucket_collectives(gm, reduces, bucket_bytes, _merge_reduces, "reduce-scatters", itemsize)


def bucket_collectives(
    gm: fx.GraphModule,
    collectives: list[Collective],
    bucket_bytes: int,
    merge,
    what: str,
    itemsize: int | None = None,
) -> fx.GraphModule:
    # ([Note: the passes leave symbolic sizes alone] in fczero.passes.graph_utils)
    collectives = [c for c in collectives if static_sizes(c.input, c.node, c.wait)]
    buckets = [
        b for b in plan_collective_buckets(collectives, bucket_bytes, itemsize) if len(b) > 1
    ]
    if not buckets:
        return gm
    graph = gm.graph
    fake_mode = fake_mode_of(graph)
    for bucket in buckets:
        merge(graph, fake_mode, bucket)
    stable_topological_sort(graph)  # users of early members now follow the merged wait
    graph.lint()
    recompile(gm)
    logger.info("bucket %s: %d -> %d buckets", what, sum(map(len, buckets)), len(buckets))
    return gm


def _merge_gathers(graph: fx.Graph, fake_mode, bucket: list[Collective]) -> None:
    first = bucket[0].node
    # every shard comes from graph inputs alone, so its prep can move up to the first gather
    pos = position(graph)
    for c in bucket:
        move_before([n for n in c.prep if pos[n] > pos[first]], first)
    world, group = bucket[0].group_size, bucket[0].group_name
    with graph.inserting_before(first):
        flat, sizes = flatten_inputs(graph, fake_mode, bucket, like=first)
        ag = insert(
            graph, fake_mode, c10d.all_gather_into_tensor.default, (flat, world, group), like=first
        )
        wait = insert(graph, fake_mode, c10d.wait_tensor.default, (ag,), like=first)
        table = insert(graph, fake_mode, aten.view.default, (wait, [world, sum(sizes)]), like=first)
        pieces, offset = [], 0
        for c, n in zip(bucket, sizes):
            column = insert(
                graph, fake_mode, aten.slice.Tensor, (table, 1, offset, offset + n), like=c.node
            )
            pieces.append(_contiguous(graph, fake_mode, column))  # [Note: copy-out]
            offset += n
        hand_out(graph, fake_mode, bucket, pieces)


def _merge_reduces(graph: fx.Graph, fake_mode, bucket: list[Collective]) -> None:
    pos = position(graph)
    last = max(bucket, key=lambda c: pos[c.node]).node  # every grad is ready here
    world, group = bucket[0].group_size, bucket[0].group_name
    with graph.inserting_before(last):
        grads = [_contiguous(graph, fake_mode, c.input) for c in bucket]
        sizes = [g.meta["val"].numel() // world for g in grads]  # each rank's part
        if _copied_in_one_op(bucket):  # [Note: one copy-in per bucket]
            table = insert(graph, fake_mode, chunk_cat, (grads, world), like=last)
        else:
            rows = [
                insert(graph, fake_mode, aten.view.default, (g, [world, -1]), like=c.node)
                for g, c in zip(grads, bucket)
            ]
            table = insert(graph, fake_mode, aten.cat.default, (rows, 1), like=last)
        flat = insert(graph, fake_mode, aten.view.default, (table, [-1]), like=last)
        rs = insert(
            graph,
            fake_mode,
            c10d.reduce_scatter_tensor.default,
            (flat, "sum", world, group),
            like=last,
        )
        wait = insert(graph, fake_mode, c10d.wait_tensor.default, (rs,), like=last)
        hand_out(graph, fake_mode, bucket, slices(graph, fake_mode, wait, bucket, sizes))


#: Ops Inductor runs as extern kernels (cuBLAS, cuDNN), whose output it copies into a ``cat``.
_EXTERN = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution_backward"})


def _copied_in_one_op(bucket: list[Collective]) -> bool:
    """Whether the bucket's reduce input is laid out by ``fczero::chunk_cat``: some member's
    grad comes from an extern kernel, and none from a pointwise op (a division by the world
    size, a cast to ``reduce_dtype``), which Inductor writes into a ``cat`` in place."""
    producers = [_producer(c.input) for c in bucket]
    return any(op_name(p) in _EXTERN for p in producers) and not any(
        _pointwise(p) for p in producers
    )


def _producer(node: fx.Node) -> fx.Node:
    """The op that computed ``node``'s values: its storage's (through views), and for one
    output of several (``getitem``) the op that made them all."""
    root = storage_root(node)
    return root.args[0] if op_name(root) == "getitem" else root


def _pointwise(node: fx.Node) -> bool:
    target = node.target
    if op_name(node) in ("_to_copy", "convert_element_type", "clone"):
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def flatten_inputs(
    graph: fx.Graph, fake_mode, bucket: list[Collective], like: fx.Node
) -> tuple[fx.Node, list[int]]:
    """One flat tensor of every member's input (for a merged collective), and their sizes."""
    flats = [
        insert(
            graph,
            fake_mode,
            aten.view.default,
            (_contiguous(graph, fake_mode, c.input), [-1]),
            like=c.node,
        )
        for c in bucket
    ]
    sizes = [f.meta["val"].numel() for f in flats]
    return insert(graph, fake_mode, aten.cat.default, (flats, 0), like=like), sizes


def slices(
    graph: fx.Graph, fake_mode, merged: fx.Node, bucket: list[Collective], sizes: list[int]
) -> list[fx.Node]:
    """Each member's consecutive piece of a merged collective's (flat) result."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [
        insert(graph, fake_mode, aten.slice.Tensor, (merged, 0, a, b), like=c.node)
        for c, a, b in zip(bucket, offsets, offsets[1:])
    ]


def hand_out(graph: fx.Graph, fake_mode, bucket: list[Collective], pieces: list[fx.Node]) -> None:
    """Give each member's users its piece of the bucket (viewed to the member's shape),
    then drop the member's own collective and wait."""
    for c, piece in zip(bucket, pieces):
        shape = list(c.wait.meta["val"].shape)
        out = insert(graph, fake_mode, aten.view.default, (piece, shape), like=c.node)
        c.wait.replace_all_uses_with(out)
    for c in bucket:
        graph.erase_node(c.wait)
        graph.erase_node(c.node)


def _contiguous(graph: fx.Graph, fake_mode, x: fx.Node) -> fx.Node:
    val = x.meta["val"]
    if val.is_contiguous():
        return x
    return insert(
        graph,
        fake_mode,
        aten.clone.default,
        (x,),
        {"memory_format": torch.contiguous_format},
        like=x,
    )
