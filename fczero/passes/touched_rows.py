"""An embedding's grad reduced as the rows the batch touched, not as the whole table.

An embedding's backward adds each token's output grad into the row of that token's id,
into a table of zeros. fczero's reduce then reduce-scatters the whole table, zeros and
all: Llama-3.2-3B's 128256 x 3072 table is 1.47 GiB in fp32, and it is reduced last,
when nothing is left to compute beside it. The same sum takes far fewer bytes if every
rank sends what it scattered, the ids and their rows, and each rank adds up the rows
that fall in its own shard:

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
The rewrite is taken where the gathered ids and rows are at most a quarter of the bytes
of the table the reduce-scatter would move: ``W * N * (D * itemsize + 8) <= bytes / 4``.
Regime R (2 ranks, 4096 tokens, 3072 wide) gathers 50 MB instead of reducing 1.58 GB;
at 32 ranks or with the whole vocabulary in every batch the table is cheaper and stays.
The decision reads only shapes and dtypes, which are the same on every rank, so every
rank replaces the same reduce with the same two all-gathers; only the shard's offset
(``rank * S``) differs.

The pass runs first, before bucketing, so the reduce it replaces is never bucketed; the
two all-gathers it adds carry ``NOT_A_GATHER`` so the gather passes leave them where
they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx as fx

from fczero.comm.graph_ops import op_name
from fczero.core.memory import nbytes
from fczero.passes.graph_utils import fake_mode_of, insert, recompile
from fczero.passes.matching import NOT_A_GATHER, Collective, find_reduces

logger = logging.getLogger("fczero")

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

#: The gathered ids and rows may be at most this share of the table's bytes.
MAX_SHARE = 0.25

_CASTS = ("convert_element_type", "_to_copy")
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


def _match(r: Collective) -> _Scatter | None:
    """``r``'s input as a chain of one-reader casts, a division by a constant and a pad of
    trailing rows, down to an index_put with accumulation into zeros."""
    if r.group_size < 2:
        return None
    chain: list[fx.Node] = []
    divisor = None
    node = r.input
    while _one_reader(node):
        name = op_name(node)
        if name in _ACCUMULATES:
            return _scatter_of(node, r, divisor, chain)
        if name == "div" and isinstance(node.args[1], (int, float)) and divisor is None:
            divisor = node.args[1]
        elif not (name in _CASTS and _is_float(node.args[0]) or _pads_rows(node)):
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
    fresh = _one_reader(zeros) and _zeros(zeros)
    if not (fresh and len(indices) == 1 and isinstance(indices[0], fx.Node)):
        return None
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
        local = add(aten.sub.Tensor, every_id, first) if first else every_id
        inside = add(
            aten.bitwise_and.Tensor,
            add(aten.ge.Scalar, local, 0),
            add(aten.lt.Scalar, local, shard_rows),
        )
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
    for node in dict.fromkeys([r.wait, r.node, *s.chain, s.table, zeros, old_rows, s.rows]):
        if not node.users and node.op == "call_function":  # (the old rows: if gathered narrower)
            graph.erase_node(node)


def _gathered(add, x: fx.Node, world: int, group: str) -> fx.Node:
    """``x`` of every rank, concatenated along dim 0 (issued and waited here)."""
    ag = add(c10d.all_gather_into_tensor.default, x, world, group)
    ag.meta[NOT_A_GATHER] = True
    return add(c10d.wait_tensor.default, ag)


def _narrow_source(s: _Scatter) -> fx.Node:
    """What the rows were cast up from, where that was a float of fewer bits and the cast
    has no other reader (the table's ``new_zeros`` reads only its dtype): the cast is exact,
    so gathering the source moves fewer bytes. Else the rows themselves."""
    rows = s.rows
    readers = set(rows.users) - {s.table.args[0]}
    if op_name(rows) in _CASTS and len(readers) == 1 and _is_float(rows.args[0]):
        source = rows.args[0].meta["val"]
        if source.element_size() < rows.meta["val"].element_size():
            return rows.args[0]
    return rows


def _one_reader(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and len(node.users) == 1


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
