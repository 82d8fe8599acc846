"""Reading collectives in an FX graph (fczero/comm/graph_ops.py): short op names, and the
process group each collective node names."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fczero.comm.graph_ops import GROUP_ARG, collective_group, op_name

c10d = torch.ops._c10d_functional


def _graph() -> tuple[fx.Graph, dict[str, fx.Node]]:
    g = fx.Graph()
    x = g.placeholder("x")
    nodes = {
        "gather": g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "7")),
        "scatter": g.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", 2, "8")),
        "reduce": g.call_function(c10d.all_reduce.default, (x, "sum", "9")),
        "in_place": g.call_function(c10d.all_gather_into_tensor_out.default, (x, 2, "6"), {"out": x}),
        "reduce_": g.call_function(c10d.all_reduce_.default, (x, "sum", "5")),
        "view": g.call_function(torch.ops.aten.view.default, (x, [-1])),
        "packet": g.call_function(torch.ops.aten.relu, (x,)),
        "python": g.call_function(operator.getitem, (x, 0)),
    }
    nodes["wait"] = g.call_function(c10d.wait_tensor.default, (nodes["gather"],))
    nodes["x"] = x
    return g, nodes


def test_op_names_drop_namespace_and_overload():
    _, n = _graph()
    assert op_name(n["gather"]) == "all_gather_into_tensor"
    assert op_name(n["wait"]) == "wait_tensor"
    assert op_name(n["view"]) == "view"
    assert op_name(n["packet"]) == "relu"  # an overload packet, not an overload
    assert op_name(n["python"]) == "getitem"


def test_each_collective_names_its_group_and_nothing_else_does():
    _, n = _graph()
    kinds = ("gather", "scatter", "reduce", "in_place", "reduce_")
    assert [collective_group(n[k]) for k in kinds] == ["7", "8", "9", "6", "5"]
    assert all(collective_group(n[k]) is None for k in ("wait", "view", "python", "x"))
    assert set(GROUP_ARG) == {
        "all_gather_into_tensor",
        "all_gather_into_tensor_out",
        "reduce_scatter_tensor",
        "all_reduce",
        "all_reduce_",
    }
