"""``drop_size_only_gathers`` on hand-built backward graphs: an all-gather read only for its
sizes goes, its sizes taken from the shard; one whose result is waited on stays."""

from __future__ import annotations

import torch
import torch.fx as fx

from fczero.comm.graph_ops import op_name
from fczero.passes.size_only_gathers import drop_size_only_gathers

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def _graph(waited: bool) -> fx.GraphModule:
    """``shard`` (3 x 4) gathered over 2 ranks; its dims 0 and 1 read with ``sym_size``."""
    graph = fx.Graph()
    shard = graph.placeholder("shard")
    shard.meta["val"] = torch.empty(3, 4)
    gather = graph.call_function(c10d.all_gather_into_tensor.default, (shard, 2, "0"))
    gather.meta["val"] = torch.empty(6, 4)
    rows = graph.call_function(aten.sym_size.int, (gather, 0))
    rows.meta["val"] = 6
    cols = graph.call_function(aten.sym_size.int, (gather, 1))
    cols.meta["val"] = 4
    outputs = [rows, cols]
    if waited:
        outputs.append(graph.call_function(c10d.wait_tensor.default, (gather,)))
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _gathers(gm: fx.GraphModule) -> int:
    return sum(
        1
        for n in gm.graph.nodes
        if n.op == "call_function" and op_name(n) == "all_gather_into_tensor"
    )


def test_a_gather_read_for_its_sizes_goes_and_the_sizes_stay():
    gm = _graph(waited=False)
    assert drop_size_only_gathers(gm) == 1
    assert _gathers(gm) == 0
    assert gm(torch.zeros(3, 4)) == (6, 4)  # dim 0: the shard's rows times the group's size


def test_a_waited_gather_stays():
    gm = _graph(waited=True)
    before = gm.code
    assert drop_size_only_gathers(gm) == 0
    assert _gathers(gm) == 1 and gm.code == before
