"""An embedding's rows: looked up in the shards and its grad reduced as the rows the batch
touched, not through the whole table.

[Note: a lookup from the shards]
An embedding's forward reads one row per token, yet the gather brings the whole table
first, at the very start of the step where nothing can run beside it: Llama-3.2-3B's
128256 x 3072 table is 788 MB in bf16, 1.5 ms of exposed all-gather on two H200s. Each
rank holds a block of rows, so the ranks can answer the lookup together: every rank
gathers every rank's ids, looks up those in its block (zero rows for the others') and a
reduce-scatter sums the answers, each rank keeping its own tokens' rows:

    before                                  after
    t  = wait_tensor(all_gather(cast(s)))   aids = wait_tensor(all_gather(ids))      # (W*N,)
    x  = embedding(slice(t, 0, 0, V), ids)  local = aids - rank * S; inside = 0 <= local < S
                                            r  = where(inside, cast(embedding(s, local * inside)), 0)
                                            x  = wait_tensor(reduce_scatter(r, "sum"))  # (N, D)

Each row is one rank's and zeros elsewhere, so the sum is exact. The table's gather stays
for whatever else reads it (a tied head, at the forward's end), and later passes move it
there and prefetch it like any other; with nothing else reading it, it goes.

[Note: a grad reduced as its touched rows]
An embedding's backward adds each token's output grad into the row of that token's id,
into a table of zeros. fczero's reduce then reduce-scatters the whole table, zeros and
all (1.58 GB in fp32 for the table above), last in the backward, when nothing is left to
compute beside it. Every rank sends what it scattered instead, the ids and their rows,
and each rank adds up the rows that fall in its own shard:

    before                                        after
    z  = full([V, D], 0)                          ids = where(mask, wrap(idx), -1)   # (N,)
    y  = index_put_accumulate(z, mask, [idx], g)  ag  = all_gather_into_tensor(ids)
    x  = div(casts(pad(y)), k)                    aids = wait_tensor(ag)             # (W*N,)
    rs = reduce_scatter_tensor(x, "sum", W)       ag2 = all_gather_into_tensor(g16)  # g's source
    s  = wait_tensor(rs)                          rows = to(wait_tensor(ag2), y's dtype)
                                                  local = aids - rank * S; inside = 0 <= local < S
                                                  s0 = index_put_accumulate(full([S, D], 0),
                                                           inside, [local], rows)
                                                  s  = div(to(s0, x's dtype), k)

``S`` is the shard's rows (the table padded to ``W * S``), ``k`` the optional division that
averages over ranks, and ``g16`` the output grad before its cast up, where it had one (the
cast is exact, so the rows travel at half the bytes). The sum is the same sum in ``y``'s
dtype: only the order of the additions changes, and the cast round trip that the
chain may hold (``[Note: a grad reduced where it was summed]`` in ``in_place.py``) is
not taken, as that pass would not take it either.

[Note: when the touched rows are cheaper]
Either rewrite is taken where the ids and rows it moves are at most a quarter of the bytes
of the table it replaces: ``W * N * (D * itemsize + 8) <= bytes / 4``. Regime R (2 ranks,
4096 tokens, 3072 wide) moves 50 MB each way instead of 788 MB and 1.58 GB; at 32 ranks or
with the whole vocabulary in every batch the table is cheaper and stays. The decision
reads only shapes and dtypes, which are the same on every rank, so every rank makes the
same collectives; only the shard's offset (``rank * S``) differs.

Both passes run first, before bucketing, so what they replace is never bucketed; the
collectives they add carry ``NOT_A_PARAM_COLLECTIVE``, so the gather and reduce passes
leave them where they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx as fx

from fczero.comm.graph_ops import op_name
from fczero.core.memory import nbytes
from fczero.passes.graph_utils import (
    fake_mode_of,
    insert,
    is_cast,
    one_reader,
    recompile,
    static_sizes,
)
from fczero.passes.matching import NOT_A_PARAM_COLLECTIVE, Collective, find_gathers, find_reduces

logger = logging.getLogger("fczero")

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

#: The gathered ids and rows may be at most this share of the table's bytes.
MAX_SHARE = 0.25

_ACCUMULATES = ("_unsafe_masked_index_put_accumulate", "_unsafe_index_put", "index_put")


@dataclass
class _Scatter:
    """A reduce whose input is a table of zeros with rows added at ids, and what it takes."""

    reduce: Collective
    table: fx.Node  # the index_put's result, [V, D]
    ids: fx.Node  # the ids, any shape
    rows: fx.Node  # what is added at each id, ids.shape + (D,)
    keep: fx.Node | None  # a bool mask, one entry per id: the rows added (or None)
    drop: fx.Node | None  # a bool mask, one entry per id: the rows left out (or None)
    divisor: float | None
    chain: list[fx.Node]  # the reduce's input back to the table, erased with it


def reduce_touched_rows_pass(gm: fx.GraphModule, groups: set[str], rank: int) -> fx.GraphModule:
    """Each reduce of an embedding-style grad (zeros with rows added at ids) becomes an
    all-gather of the ids and of the rows where that moves fewer bytes ([Note: when the
    touched rows are cheaper]); ``rank`` is this rank's place in the reduce's group."""
    graph = gm.graph
    found = [s for r in find_reduces(graph, groups) if (s := _match(r)) and _cheaper(s)]
    if not found:
        return gm
    fake_mode = fake_mode_of(graph)
    for s in found:
        _rewrite(graph, fake_mode, s, rank)
    graph.lint()
    recompile(gm)
    logger.info("reduce_touched_rows_pass: %d reduces send the touched rows only", len(found))
    return gm


def look_up_touched_rows_pass(
    gm: fx.GraphModule, groups: set[str], rank: int
) -> fx.GraphModule:
    """Each embedding lookup in a gathered table reads its rows from the shards instead: an
    all-gather of the ids and a reduce-scatter of the rows found ([Note: a lookup from the
    shards]); a gather that nothing else reads goes."""
    graph = gm.graph
    gathers = find_gathers(graph, groups)
    found = [(g, e) for g in gathers for e in _lookups(g) if _cheap_lookup(g, e)]
    if not found:
        return gm
    fake_mode = fake_mode_of(graph)
    for gather, lookup in found:
        _look_up(graph, fake_mode, gather, lookup, rank)
    for gather in {g.node: g for g, _ in found}.values():
        unpadded = reversed(_unpad_slices(gather))
        _erase_if_unread([*unpadded, gather.wait, gather.node, *reversed(gather.prep)])
    graph.lint()
    recompile(gm)
    logger.info("look_up_touched_rows_pass: %d lookups read the shards", len(found))
    return gm


def _unpad_slices(g: Collective) -> list[fx.Node]:
    return [u for u in g.wait.users if op_name(u) == "slice" and tuple(u.args[1:3]) == (0, 0)]


def _lookups(g: Collective) -> list[fx.Node]:
    """The ``embedding`` nodes that read ``g``'s table: its wait, or the wait's rows unpadded
    (``slice(wait, 0, 0, rows)``), where each rank's shard is a 2-d block of those rows."""
    source, table = g.input.meta["val"], g.wait.meta["val"]
    if g.in_place or source.dim() != 2 or table.dim() != 2 or g.group_size < 2:
        return []
    if not static_sizes(g.input, g.wait):  # ([Note: the passes leave symbolic sizes alone])
        return []
    if source.shape[0] * g.group_size != table.shape[0]:
        return []
    tables = [g.wait, *(s for s in _unpad_slices(g) if (s.args[4] if len(s.args) > 4 else 1) == 1)]
    return [
        u
        for t in tables
        for u in t.users
        if op_name(u) == "embedding" and u.args[0] is t and static_sizes(u.args[1], u)
    ]


def _cheap_lookup(g: Collective, lookup: fx.Node) -> bool:
    """[Note: when the touched rows are cheaper], for a lookup: the ids gathered and the
    rows reduce-scattered against the table gathered."""
    n = lookup.args[1].meta["val"].numel()
    row = g.wait.meta["val"].shape[1] * g.wait.meta["val"].element_size()
    return g.group_size * n * (row + 8) <= MAX_SHARE * nbytes(g.wait)


def _look_up(graph: fx.Graph, fake_mode, g: Collective, lookup: fx.Node, rank: int) -> None:
    ids = lookup.args[1]
    shape = list(ids.meta["val"].shape)
    n = ids.meta["val"].numel()
    shard = _shard_input(g)
    shard_rows, width = shard.meta["val"].shape
    dtype = g.wait.meta["val"].dtype

    def add(target, *args, **kwargs) -> fx.Node:
        return insert(graph, fake_mode, target, args, kwargs, like=lookup)

    with graph.inserting_before(lookup):
        flat = add(aten.reshape.default, ids, [n])
        flat = add(prims.convert_element_type.default, flat, torch.int64)
        every_id = _gathered(add, flat, g.group_size, g.group_name)
        local, inside = _in_shard(add, every_id, rank * shard_rows, shard_rows)
        ones = add(prims.convert_element_type.default, inside, torch.int64)
        local = add(aten.mul.Tensor, local, ones)
        found = add(aten.embedding.default, shard, local)  # row 0 where the id is another rank's
        if found.meta["val"].dtype != dtype:
            found = add(prims.convert_element_type.default, found, dtype)  # as the gather casts
        zero = add(aten.full.default, [], 0, dtype=dtype, device=g.wait.meta["val"].device)
        # (where, not a product with the mask: row 0 may hold an inf, and inf * 0 is nan)
        found = add(aten.where.self, add(aten.unsqueeze.default, inside, -1), found, zero)
        summed = add(c10d.reduce_scatter_tensor.default, found, "sum", g.group_size, g.group_name)
        summed.meta[NOT_A_PARAM_COLLECTIVE] = True
        rows = add(aten.reshape.default, add(c10d.wait_tensor.default, summed), [*shape, width])
    lookup.replace_all_uses_with(rows)
    graph.erase_node(lookup)


def _shard_input(g: Collective) -> fx.Node:
    """This rank's rows of the table: the graph input that the gather casts, where it has the
    shard's 2-d shape and device, so the lookup does not read the gather's own prep (which would pin
    that prep, and so the gather, to the graph's start); else what the gather sends."""
    sent = g.input.meta["val"]
    node = g.input
    while is_cast(node):
        node = node.args[0]
    val = node.meta.get("val")
    # (same device: with params offloaded the graph input is the shard in host memory)
    same = isinstance(val, torch.Tensor) and (val.shape, val.device) == (sent.shape, sent.device)
    return node if node.op == "placeholder" and same else g.input


def _erase_if_unread(nodes: list[fx.Node]) -> None:
    """Erase each of ``nodes`` (readers before what they read) that nothing reads."""
    for node in nodes:
        if not node.users and node.op == "call_function":
            node.graph.erase_node(node)


def _match(r: Collective) -> _Scatter | None:
    """``r``'s input as a chain of one-reader casts, a division by a constant and a pad of
    trailing rows, down to an index_put with accumulation into zeros."""
    if r.group_size < 2:
        return None
    chain: list[fx.Node] = []
    divisor = None
    node = r.input
    while one_reader(node):
        name = op_name(node)
        if name in _ACCUMULATES:
            return _scatter_of(node, r, divisor, chain)
        if name == "div" and isinstance(node.args[1], (int, float)) and divisor is None:
            divisor = node.args[1]
        elif not (is_cast(node) and _is_float(node.args[0]) or _pads_rows(node)):
            return None
        chain.append(node)
        node = node.args[1] if name == "slice_scatter" else node.args[0]
    return None


def _scatter_of(node: fx.Node, r: Collective, divisor, chain: list[fx.Node]) -> _Scatter | None:
    name = op_name(node)
    if name == "_unsafe_masked_index_put_accumulate":
        zeros, keep, indices, rows = node.args[:4]
    elif _accumulates(node):
        zeros, indices, rows = node.args[:3]
        keep = None
    else:
        return None
    fresh = one_reader(zeros) and _zeros(zeros)
    if not (fresh and len(indices) == 1 and isinstance(indices[0], fx.Node)):
        return None
    if not static_sizes(node, indices[0], rows, r.node, *([keep] if keep is not None else [])):
        return None  # ([Note: the passes leave symbolic sizes alone])
    table, ids = node.meta["val"], indices[0].meta["val"]
    if table.dim() != 2 or tuple(rows.meta["val"].shape) != (*ids.shape, table.shape[1]):
        return None
    if keep is not None and keep.meta["val"].numel() != ids.numel():
        return None
    drop = None
    if keep is None and op_name(rows) == "masked_fill" and _fills_rows_with_zero(rows, ids):
        drop, rows = rows.args[1], rows.args[0]  # torch 2.11's decomposition
    return _Scatter(r, node, indices[0], rows, keep, drop, divisor, chain)


def _cheaper(s: _Scatter) -> bool:
    """[Note: when the touched rows are cheaper]"""
    source = _narrow_source(s)
    n = s.ids.meta["val"].numel()
    width = s.table.meta["val"].shape[1]
    gathered = s.reduce.group_size * n * (width * source.meta["val"].element_size() + 8)
    return gathered <= MAX_SHARE * nbytes(s.reduce.input)


def _rewrite(graph: fx.Graph, fake_mode, s: _Scatter, rank: int) -> None:
    r = s.reduce
    world, name = r.group_size, r.group_name
    table = s.table.meta["val"]
    shard_rows = r.node.meta["val"].shape[0]
    first = rank * shard_rows
    n = s.ids.meta["val"].numel()
    width = table.shape[1]

    def add(target, *args, **kwargs) -> fx.Node:
        return insert(graph, fake_mode, target, args, kwargs, like=r.node)

    with graph.inserting_before(r.node):
        ids = add(aten.reshape.default, s.ids, [n])
        ids = add(prims.convert_element_type.default, ids, torch.int64)
        ids = add(aten.remainder.Scalar, ids, table.shape[0])  # negative ids count from the end
        kept = None
        if s.keep is not None:
            kept = add(aten.reshape.default, s.keep, [n])
        if s.drop is not None:
            kept = add(aten.bitwise_not.default, add(aten.reshape.default, s.drop, [n]))
        if kept is not None:  # a row left out travels with id -1: (id + 1) * kept - 1
            kept = add(prims.convert_element_type.default, kept, torch.int64)
            ids = add(aten.sub.Tensor, add(aten.mul.Tensor, add(aten.add.Tensor, ids, 1), kept), 1)
        source = _narrow_source(s)
        rows = add(aten.reshape.default, source, [n, width])
        every_id = _gathered(add, ids, world, name)
        every_row = _gathered(add, rows, world, name)
        if source.meta["val"].dtype != table.dtype:
            every_row = add(prims.convert_element_type.default, every_row, table.dtype)
        local, inside = _in_shard(add, every_id, first, shard_rows)
        zeros = add(
            aten.full.default, [shard_rows, width], 0,
            dtype=table.dtype, device=table.device, pin_memory=False,
        )  # fmt: skip
        inside = add(aten.unsqueeze.default, inside, -1)
        accumulate = aten._unsafe_masked_index_put_accumulate.default
        shard = add(accumulate, zeros, inside, [local], every_row)
        if r.dtype != table.dtype:
            shard = add(prims.convert_element_type.default, shard, r.dtype)
        if s.divisor is not None:
            shard = add(aten.div.Tensor, shard, s.divisor)
    r.wait.replace_all_uses_with(shard)
    zeros, old_rows = s.table.args[0], s.table.args[3 if s.keep is not None else 2]
    # (the old rows go where the narrower source was gathered instead)
    replaced = [r.wait, r.node, *s.chain, s.table, zeros, old_rows, s.rows]
    _erase_if_unread(list(dict.fromkeys(replaced)))


def _in_shard(add, ids: fx.Node, first: int, rows: int) -> tuple[fx.Node, fx.Node]:
    """``ids`` counted from this rank's ``first`` row, and whether each falls in its ``rows``."""
    local = add(aten.sub.Tensor, ids, first) if first else ids
    inside = add(
        aten.bitwise_and.Tensor, add(aten.ge.Scalar, local, 0), add(aten.lt.Scalar, local, rows)
    )
    return local, inside


def _gathered(add, x: fx.Node, world: int, group: str) -> fx.Node:
    """``x`` of every rank, concatenated along dim 0 (issued and waited here)."""
    ag = add(c10d.all_gather_into_tensor.default, x, world, group)
    ag.meta[NOT_A_PARAM_COLLECTIVE] = True
    return add(c10d.wait_tensor.default, ag)


def _narrow_source(s: _Scatter) -> fx.Node:
    """What the rows were cast up from, where that was a float of fewer bits and the cast
    has no other reader (the table's ``new_zeros`` reads only its dtype): the cast is exact,
    so gathering the source moves fewer bytes. Else the rows themselves."""
    rows = s.rows
    readers = set(rows.users) - {s.table.args[0]}
    if is_cast(rows) and len(readers) == 1 and _is_float(rows.args[0]):
        source = rows.args[0].meta["val"]
        if source.element_size() < rows.meta["val"].element_size():
            return rows.args[0]
    return rows


def _is_float(node) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _accumulates(node: fx.Node) -> bool:
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    return accumulate is True


def _zeros(node) -> bool:
    """A fresh table of zeros."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return False
    name = op_name(node)
    return name in ("zeros", "new_zeros") or name == "full" and node.args[1] == 0


def _pads_rows(node: fx.Node) -> bool:
    """An op that appends zero rows to a 2-d table (the grad of the unpadding slice):
    ``constant_pad_nd(x, [0, 0, 0, p], 0)``, ``slice_backward(x, sizes, 0, 0, rows, 1)`` or
    ``slice_scatter(zeros, x, 0, 0, rows)``."""
    name, args = op_name(node), node.args
    if name == "constant_pad_nd":
        value = args[2] if len(args) > 2 else node.kwargs.get("value", 0)
        pad = list(args[1])
        return len(pad) == 4 and pad[:3] == [0, 0, 0] and value == 0
    if name == "slice_backward":
        return tuple(args[2:4]) == (0, 0) and (args[5] if len(args) > 5 else 1) == 1
    if name == "slice_scatter":
        start_step = (args[3] if len(args) > 3 else 0, args[5] if len(args) > 5 else 1)
        return _zeros(args[0]) and args[2] == 0 and start_step == (0, 1)
    return False


def _fills_rows_with_zero(node: fx.Node, ids) -> bool:
    """``masked_fill(x, mask, 0)`` with one mask entry per id (torch 2.11 zeroes the rows of
    the padding id this way)."""
    mask = node.args[1]
    value = node.args[2]
    return (
        isinstance(mask, fx.Node)
        and value == 0
        and len(node.users) == 1
        and mask.meta["val"].numel() == ids.numel()
    )
