"""The FX helpers the passes share (fczero/passes/graph_utils.py): a node inserted with its
fake value and the source metadata of the node it stands for, moves, and the stable
topological sort that repairs a rewrite."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fczero.passes.graph_utils import (
    aten,
    fake_mode_of,
    in_graph_order,
    insert,
    move_before,
    position,
    stable_topological_sort,
)


def _graph() -> tuple[fx.Graph, fx.Node, fx.Node]:
    mode = FakeTensorMode()
    g = fx.Graph()
    x = g.placeholder("x")
    with mode:
        x.meta["val"] = torch.empty(4, 3)
    y = g.call_function(aten.relu.default, (x,))
    y.meta["val"] = x.meta["val"]
    y.meta["nn_module_stack"] = {"blocks.1": ("blocks.1", torch.nn.Linear)}
    g.output(y)
    return g, x, y


def test_an_inserted_node_has_its_fake_value_and_the_source_it_stands_for():
    g, x, y = _graph()
    mode = fake_mode_of(g)
    assert mode is x.meta["val"].fake_mode
    with g.inserting_after(y):
        t = insert(g, mode, aten.t.default, (y,), like=y)
    assert t.meta["val"].shape == (3, 4)
    assert t.meta["nn_module_stack"] == y.meta["nn_module_stack"]


def test_move_before_keeps_the_given_order():
    g = fx.Graph()
    x = g.placeholder("x")
    a, b, c = (g.call_function(aten.neg.default, (x,)) for _ in range(3))
    g.output((a, b, c))
    move_before([c, b], a)
    assert [n for n in g.nodes if n.op == "call_function"] == [c, b, a]
    assert position(g)[c] == 1


def test_the_sort_moves_only_what_runs_before_its_input():
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.neg.default, (x,))
    b = g.call_function(aten.relu.default, (a,))
    c = g.call_function(aten.abs.default, (x,))
    g.output((b, c))
    b.append(a)  # a rewrite left a after its user b
    stable_topological_sort(g)
    assert list(g.nodes)[:4] == [x, a, b, c]
    g.lint()


def test_the_sort_places_a_node_whose_inputs_all_stand_after_it():
    """A node left before two of its inputs waits for the first, then for the second: it
    must not be dropped (reported as a cycle) once the first is placed. A bucketed
    reduce-scatter left such a node in ALBERT's backward (tests/e2e/test_hf_models.py)."""
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.neg.default, (x,))
    b = g.call_function(aten.relu.default, (x,))
    s = g.call_function(aten.add.Tensor, (a, b))
    g.output(s)
    x.append(s)  # x, s, a, b: s before both of its inputs, the first of them placed first
    stable_topological_sort(g)
    assert list(g.nodes)[:4] == [x, a, b, s]
    g.lint()


def test_nodes_order_by_where_they_stand_after_moves():
    """[Note: nodes compare by their place in the graph]: what ``in_graph_order`` and the
    schedule's comparisons rely on, torch's sort key, kept through moves."""
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.relu.default, (x,))
    b = g.call_function(aten.neg.default, (x,))
    c = g.call_function(aten.abs.default, (x,))
    g.output((a, b, c))
    move_before([c, b], a)  # x, c, b, a
    move_before([a], c)  # x, a, c, b
    expected = [n for n in g.nodes if n.op == "call_function"]
    assert in_graph_order([b, c, a]) == expected == [a, c, b]
    assert position(g)[a] < position(g)[c] and a < c and b > c and min([b, c]) is c
