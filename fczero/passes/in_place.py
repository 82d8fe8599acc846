"""In-place all-gathers: each rank's shard is written straight into its slot of the output.

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
still writes the concatenation's own buffer, then the slot). The pass runs last, after bucketing and scheduling have placed every
gather, and it moves nothing: only the slot's offset depends on the rank, never which
collectives run or in what order.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from fczero.passes.graph_utils import aten, c10d, fake_mode_of, insert
from fczero.passes.matching import find_gathers

logger = logging.getLogger("fczero")


def available() -> bool:
    """Whether this torch has the out-variant all-gather (``_c10d_functional``)."""
    return hasattr(c10d, "all_gather_into_tensor_out")


def gathers_in_place_pass(gm: fx.GraphModule, groups: set[str], rank: int) -> fx.GraphModule:
    """Rewrite every matched all-gather on ``groups`` to write in place; ``rank`` is this
    process's rank in those groups (the slot its shard fills)."""
    gathers = [g for g in find_gathers(gm.graph, groups) if not g.in_place]
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
    gm.recompile()
    logger.info("gathers_in_place_pass: %d all-gathers write in place", len(gathers))
    return gm
