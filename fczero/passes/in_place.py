"""In-place collectives: each all-gather writes this rank's shard straight into its slot of
the output, and a reduce over a group of one rank reduces its input where it lies.

An out-of-place all-gather copies the local input into the output on every rank (at
world size 1, NCCL's whole all-gather is that copy). Written in place, the shard's
prep (its cast, or the bucket's concatenation) lands in this rank's slot of the
output buffer and the collective only fills the other slots:

    before                                   after
    x  = cat([s1, s2])                       out = empty([world * n])
    ag = all_gather_into_tensor(x, w, g)     mine = slice(out, 0, rank * n, (rank + 1) * n)
    y  = wait_tensor(ag)                     x  = copy_(mine, cat([s1, s2]))
                                             ag = all_gather_into_tensor_out(x, w, g, out=out)
                                             y  = wait_tensor(ag)

Inductor fuses the cast, the concatenation and the ``copy_`` into one kernel (which
still writes the concatenation's own buffer, then the slot). The pass runs after
bucketing and scheduling have placed every gather, and it moves nothing: only the slot's
offset depends on the rank, never which collectives run or in what order.

[Note: reducing in place at one rank]
A reduce-scatter's output is one rank's slice of its input. Out of place it is a new
buffer, and for good reason at 2+ ranks: the grads handed out are views of it, so an
in-place output would keep all ``world`` slices of each bucket alive until ``zero_grad``
(docs/passes.md, pass 6). In a group of one rank the slice is the whole input, so the
in-place form keeps no extra byte alive, and out of place NCCL would only copy the
bucket (8 bytes per fp32 element read and written). There the reduce becomes the one
in-place functional collective with the same meaning, an all-reduce over that group:

    before                                       after (group of one rank)
    rs = reduce_scatter_tensor(x, "sum", 1, g)   rs = all_reduce_(x, "sum", g)
    y  = wait_tensor(rs)                         y  = wait_tensor(rs)

The collective is still issued (its host cost is what 2+ ranks pay too); only the copy
goes. The group's size is the same on every rank, so so is the rewrite. A reduce whose
input is a graph input or has other users keeps its out-of-place form.

[Note: a grad reduced where it was summed]
Inductor sums an embedding's grad in fp32 whatever the param's dtype (its
``embedding_dense_backward`` decomposition) and rounds it to the param's bf16; fczero then
casts that back to the fp32 ``reduce_dtype`` and divides it by the world size. Inductor
writes the result of that chain into a second full-size fp32 buffer, so two of them are
alive at once at the end of backward: 2 x 1.47 GiB for Llama-3.2-3B's 394M-param
embedding. torch 2.11's Inductor folds the round trip away (its ``pointless_convert``
pattern; 2.13 keeps a narrowing on purpose) and leaves ``div(y, world)``: still a second
full buffer. Where a reduce's input is a chain of casts and an optional division by a
constant, one of them at least, of a buffer of its own shape, dtype and layout that
nothing else reads, the reduce takes that buffer itself and its result is divided:

    before                                       after
    y  = index_put_accumulate(zeros_f32, ...)    y  = index_put_accumulate(zeros_f32, ...)
    x  = div(to_f32(to_bf16(y)), world)          rs = reduce_scatter_tensor(y, "sum", ...)
    rs = reduce_scatter_tensor(x, "sum", ...)    g  = div(wait_tensor(rs), world)
    g  = wait_tensor(rs)

The grad is reduced without its rounding to bf16 (closer to the exact sum, not further),
and divided on this rank's shard instead of the whole. A matmul's bf16 grad cast up to
fp32 for its reduce takes the same path from the cast (``x = div(to_f32(mm), world)``):
its division moves to the shard. Copying the chain's result back
into ``y`` instead would be wrong: Inductor lowers the accumulation as a scatter into the
zeros, and a later write into that buffer was computed from the zeros, before the scatter
(seen on torch 2.13's CPU backend). Decided from shapes and dtypes, the same on every rank.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from fczero.core.memory import storage_root
from fczero.comm.graph_ops import op_name
from fczero.passes.graph_utils import (
    aten,
    c10d,
    fake_mode_of,
    insert,
    is_cast,
    one_reader,
    recompile,
    static_sizes,
)
from fczero.passes.matching import find_gathers, find_reduces

logger = logging.getLogger("fczero")


def available() -> bool:
    """Whether this torch has the out-variant all-gather (``_c10d_functional``)."""
    return hasattr(c10d, "all_gather_into_tensor_out")


def gathers_in_place_pass(gm: fx.GraphModule, groups: set[str], rank: int) -> fx.GraphModule:
    """Rewrite every matched all-gather on ``groups`` to write in place; ``rank`` is this
    process's rank in those groups (the slot its shard fills)."""
    # ([Note: the passes leave symbolic sizes alone] in fczero.passes.graph_utils)
    found = find_gathers(gm.graph, groups)
    gathers = [g for g in found if not g.in_place and static_sizes(g.input, g.node)]
    if not gathers or not available():
        return gm
    graph = gm.graph
    fake_mode = fake_mode_of(graph)
    for g in gathers:
        x, world, group = g.input, g.group_size, g.group_name
        val, rows = g.node.meta["val"], x.meta["val"].shape[0]
        with graph.inserting_before(g.node):
            out = insert(
                graph,
                fake_mode,
                aten.empty.memory_format,
                (list(val.shape),),
                {"dtype": val.dtype, "device": val.device},
                like=g.node,
            )
            slot = (out, 0, rank * rows, (rank + 1) * rows)
            mine = insert(graph, fake_mode, aten.slice.Tensor, slot, like=g.node)
            filled = insert(graph, fake_mode, aten.copy_.default, (mine, x), like=g.node)
            gathered = insert(
                graph,
                fake_mode,
                c10d.all_gather_into_tensor_out.default,
                (filled, world, group),
                {"out": out},
                like=g.node,
            )
        g.wait.replace_input_with(g.node, gathered)
        graph.erase_node(g.node)
    graph.lint()
    recompile(gm)
    logger.info("gathers_in_place_pass: %d all-gathers write in place", len(gathers))
    return gm


def reduces_in_place_pass(gm: fx.GraphModule, groups: set[str]) -> fx.GraphModule:
    """Rewrite every matched reduce-scatter over a group of one rank on ``groups`` into an
    in-place all-reduce ([Note: reducing in place at one rank])."""
    graph = gm.graph
    reduces = [r for r in find_reduces(graph, groups) if r.group_size == 1 and _owned(r.input)]
    if not reduces:
        return gm
    fake_mode = fake_mode_of(graph)
    for r in reduces:
        x, op = r.input, r.node.args[1]
        with graph.inserting_before(r.node):
            reduced = insert(
                graph, fake_mode, c10d.all_reduce_.default, (x, op, r.group_name), like=r.node
            )
        r.wait.replace_input_with(r.node, reduced)
        graph.erase_node(r.node)
    graph.lint()
    recompile(gm)
    logger.info(
        "reduces_in_place_pass: %d reduce-scatters over one rank reduce in place", len(reduces)
    )
    return gm


def reduce_where_summed_pass(gm: fx.GraphModule, groups: set[str]) -> fx.GraphModule:
    """Each reduce of a grad that was summed in the reduce's dtype and rounded on its way
    reduces the sum itself, and divides after ([Note: a grad reduced where it was summed])."""
    graph = gm.graph
    matches = [(r, m) for r in find_reduces(graph, groups) if (m := _summed_source(r.input))]
    if not matches:
        return gm
    fake_mode = fake_mode_of(graph)
    for r, (source, divisor, chain) in matches:
        r.node.replace_input_with(r.input, source)
        if divisor is not None:
            with graph.inserting_after(r.wait):
                scaled = insert(graph, fake_mode, aten.div.Tensor, (r.wait, divisor), like=r.wait)
            r.wait.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        for node in chain:  # the round trip, read by nothing now (nearest the reduce first)
            if not node.users:
                graph.erase_node(node)
    graph.lint()
    recompile(gm)
    logger.info("reduce_where_summed_pass: %d reduces read the sum itself", len(matches))
    return gm


def _summed_source(x: fx.Node) -> tuple[fx.Node, float | None, list[fx.Node]] | None:
    """``x = div(casts(source), k)``, where ``casts`` is a chain of dtype casts (a round
    trip through fewer bits, or none left: torch 2.11 folds the round trip away) and the
    ``div`` is optional but one of the two is there, ``source`` holds what ``x`` holds
    (shape, dtype, strides) in storage of its own and each link has one reader:
    ``(source, k or None, [div, casts nearest x first])``. The deepest such ``source``."""
    chain: list[fx.Node] = []
    divisor = None
    node = x
    if one_reader(node) and op_name(node) == "div" and isinstance(node.args[1], (int, float)):
        divisor, node = node.args[1], node.args[0]
        chain.append(x)
    found: tuple[fx.Node, list[fx.Node]] | None = None
    links: list[fx.Node] = []
    while isinstance(node, fx.Node):
        if node is not x and _holds_like(node, x):
            found = (node, list(links))
        if not (is_cast(node) and one_reader(node)):
            break
        links.append(node)
        node = node.args[0]
    if found is None:
        return None
    source, casts = found
    return source, divisor, [*chain, *casts]


def _holds_like(node: fx.Node, x: fx.Node) -> bool:
    """``node`` owns its storage, only one op reads it, and it is laid out as ``x``."""
    if not one_reader(node) or storage_root(node) is not node:
        return False
    want, have = x.meta.get("val"), node.meta.get("val")
    if not isinstance(want, torch.Tensor) or not isinstance(have, torch.Tensor):
        return False
    same = (have.shape, have.dtype, have.stride()) == (want.shape, want.dtype, want.stride())
    return same and have.is_contiguous()


def _owned(x: fx.Node) -> bool:
    """Whether ``x`` is an intermediate that only the reduce reads. (A sum over one rank
    changes no value anyway; this keeps graph inputs and shared buffers unmutated.)"""
    return len(x.users) == 1 and storage_root(x).op == "call_function"
