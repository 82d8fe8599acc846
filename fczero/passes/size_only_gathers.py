"""Drop an all-gather that a backward graph issues only to read its size.

[Note: a gather read for its size]
fczero tags each traced gather for recomputation, so the partitioner gathers a param again
in backward rather than saving it. Where a gathered param's size is symbolic (a frame
Dynamo compiled again once shapes differed: a unit called from code that runs eagerly
inside a compiled call, such as a block holding an ``nn.GRU``), a backward op that needs
only that size (``slice_backward`` of the padded rows) made the partitioner recompute the
whole all-gather to read ``sym_size`` off it, with no wait: the collective was issued in
every backward and never waited ("2 functional collectives were never waited", a GRU
language model compiled whole, 2 gloo ranks, torch 2.13). The gathered size follows from
the shard's: dim 0 is the shard's times the group size, the others are the shard's. The
graph is the same on every rank, so every rank drops the same collective.

    before                                          after
    ag = all_gather_into_tensor(shard, 2, "0")
    s  = sym_size.int(ag, 0)                        s0 = sym_size.int(shard, 0)
                                                    s  = mul(s0, 2)
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from fczero.comm.graph_ops import op_name

logger = logging.getLogger("fczero")

aten = torch.ops.aten


def drop_size_only_gathers(gm: fx.GraphModule) -> int:
    """Rewrite the size reads of every all-gather that nothing else reads, then remove it;
    return how many were removed (the graph is recompiled when any was)."""
    graph, dropped = gm.graph, 0
    for gather in list(graph.nodes):
        if gather.op != "call_function" or op_name(gather) != "all_gather_into_tensor":
            continue
        users = list(gather.users)
        if not users or any(user.target is not aten.sym_size.int for user in users):
            continue
        shard, group_size = gather.args[0], gather.args[1]
        for user in users:
            dim = user.args[1]
            with graph.inserting_before(user):
                size = graph.call_function(aten.sym_size.int, (shard, dim))
                size.meta["val"] = shard.meta["val"].shape[dim]
                if dim == 0:
                    size = graph.call_function(operator.mul, (size, group_size))
                    size.meta["val"] = user.meta["val"]
            user.replace_all_uses_with(size)
            graph.erase_node(user)
        graph.erase_node(gather)
        dropped += 1
    if dropped:
        logger.debug("fczero: %d all-gather(s) read only for their size dropped", dropped)
        gm.recompile()
    return dropped
