"""In-place collectives (fczero/passes/in_place.py): each gather's input is copied into this
rank's slot of the output, nothing moves, and only the slot depends on the rank; a reduce
over one rank reduces in place, and only an intermediate that nothing else reads."""

from __future__ import annotations

import unittest
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fczero.comm.graph_ops import op_name
from fczero.passes import run_passes
from fczero.passes.in_place import reduce_where_summed_pass, reduces_in_place_pass
from fczero.passes.matching import find_gathers
from tests.passes import ThreeBlocksGraphs, settings


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [op_name(n) for n in gm.graph.nodes if n.op == "call_function"]


class InPlaceTest(ThreeBlocksGraphs):
    def test_each_gather_fills_its_own_slot_at_every_rank(self):
        for rank in (0, 1):
            fw, _ = self.graphs()
            run_passes(fw, settings(rank=rank))
            gathers = find_gathers(fw.graph, {"0"})
            self.assertEqual(len(gathers), 4)
            for g in gathers:
                self.assertTrue(g.in_place)
                filled = g.node.args[0]
                slot, source = filled.args
                out = g.node.kwargs["out"]
                self.assertEqual(op_name(filled), "copy_")
                self.assertEqual((op_name(slot), slot.args[0], slot.args[1]), ("slice", out, 0))
                rows = source.meta["val"].shape[0]
                self.assertEqual(slot.args[2:], (rank * rows, (rank + 1) * rows))
                self.assertEqual(out.meta["val"].shape[0], 2 * rows)
                self.assertIs(g.wait.args[0], g.node)  # the wait takes the in-place collective

    def test_the_rewrite_moves_nothing(self):
        # the same collectives and compute, in the same order, with the pass and without it
        def order(gm):
            kept = [o for o in _ops(gm) if o not in ("empty", "copy_", "slice")]
            return [o.replace("all_gather_into_tensor_out", "all_gather_into_tensor") for o in kept]

        with_pass, _ = self.graphs()
        run_passes(with_pass, settings())
        without, _ = self.graphs()
        with mock.patch("fczero.passes.gathers_in_place_pass", lambda gm, groups, rank: gm):
            run_passes(without, settings())
        self.assertIn("all_gather_into_tensor", _ops(without))
        self.assertNotIn("all_gather_into_tensor", _ops(with_pass))
        self.assertEqual(order(with_pass), order(without))

    def test_the_rank_is_part_of_the_cache_key(self):
        # Inductor keys its cache on the pass settings: two ranks' graphs differ in the slot
        self.assertNotEqual(repr(settings(rank=0)), repr(settings(rank=1)))


def _reduce_graph(world: int, prep: bool, extra_user: bool = False) -> torch.fx.GraphModule:
    """x (-> relu) -> reduce_scatter(sum, world, "0") -> wait, with fake values."""
    c10d, g = torch.ops._c10d_functional, torch.fx.Graph()
    with FakeTensorMode() as mode:
        x = g.placeholder("x")
        x.meta["val"] = mode.from_tensor(torch.zeros(4 * world, 3))
        grad = x
        if prep:
            grad = g.call_function(torch.ops.aten.relu.default, (x,))
            grad.meta["val"] = torch.ops.aten.relu.default(x.meta["val"])
        rs = g.call_function(c10d.reduce_scatter_tensor.default, (grad, "sum", world, "0"))
        wait = g.call_function(c10d.wait_tensor.default, (rs,))
        outputs = (wait, grad) if extra_user else (wait,)
    g.output(outputs)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_a_reduce_over_one_rank_is_an_in_place_all_reduce_of_an_intermediate():
    gm = reduces_in_place_pass(_reduce_graph(world=1, prep=True), {"0"})
    assert _ops(gm) == ["relu", "all_reduce_", "wait_tensor"]
    reduce = next(n for n in gm.graph.nodes if op_name(n) == "all_reduce_")
    assert reduce.args == (reduce.args[0], "sum", "0") and op_name(reduce.args[0]) == "relu"
    # left out of place: two ranks, a graph input, an intermediate something else reads
    for graph in (
        _reduce_graph(world=2, prep=True),
        _reduce_graph(world=1, prep=False),
        _reduce_graph(world=1, prep=True, extra_user=True),
    ):
        assert "reduce_scatter_tensor" in _ops(reduces_in_place_pass(graph, {"0"}))
    # and only on fczero's groups
    assert "reduce_scatter_tensor" in _ops(reduces_in_place_pass(_reduce_graph(1, True), {"9"}))


def _summed_graph(
    source_dtype: torch.dtype = torch.float32,
    from_input: bool = False,
    extra_user: bool = False,
    rounded: bool = True,
) -> torch.fx.GraphModule:
    """y = cumsum(x) (a sum Inductor materializes) -> to bf16 -> to fp32 (``rounded``; torch
    2.11's Inductor folds this round trip away) -> / 2 -> reduce_scatter -> wait."""
    aten, prims = torch.ops.aten, torch.ops.prims
    c10d, g = torch.ops._c10d_functional, torch.fx.Graph()

    def call(target, *args):
        node = g.call_function(target, args)
        node.meta["val"] = target(
            *[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        )
        return node

    with FakeTensorMode() as mode:
        x = g.placeholder("x")
        x.meta["val"] = mode.from_tensor(torch.zeros(8, 3, dtype=source_dtype))
        y = x if from_input else call(aten.cumsum.default, x, 0)
        if rounded:
            low = call(prims.convert_element_type.default, y, torch.bfloat16)
            y_again = call(prims.convert_element_type.default, low, torch.float32)
        grad = call(aten.div.Tensor, y_again if rounded else y, 2)
        rs = g.call_function(c10d.reduce_scatter_tensor.default, (grad, "sum", 2, "0"))
        rs.meta["val"] = mode.from_tensor(torch.zeros(4, 3))
        wait = g.call_function(c10d.wait_tensor.default, (rs,))
        wait.meta["val"] = rs.meta["val"]
    g.output((wait, y) if extra_user else (wait,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("rounded", [True, False], ids=["round-trip", "folded"])
def test_a_grad_summed_in_fp32_is_reduced_before_its_rounding(rounded):
    gm = reduce_where_summed_pass(_summed_graph(rounded=rounded), {"0"})
    assert _ops(gm) == ["cumsum", "reduce_scatter_tensor", "wait_tensor", "div"]
    reduce = next(n for n in gm.graph.nodes if op_name(n) == "reduce_scatter_tensor")
    scaled = next(n for n in gm.graph.nodes if op_name(n) == "div")
    assert op_name(reduce.args[0]) == "cumsum" and scaled.args[1] == 2
    assert op_name(scaled.args[0]) == "wait_tensor"
    assert list(gm.graph.output_node().args[0]) == [scaled]
    # the sum left alone: a graph input, a source that something else reads, and
    # collectives on other groups
    for graph in (
        _summed_graph(rounded=rounded, from_input=True),
        _summed_graph(rounded=rounded, extra_user=True),
    ):
        gm = reduce_where_summed_pass(graph, {"0"})
        reduce = next(n for n in gm.graph.nodes if op_name(n) == "reduce_scatter_tensor")
        assert op_name(reduce.args[0]) != "cumsum"
    other = reduce_where_summed_pass(_summed_graph(rounded=rounded), {"9"})
    assert _ops(other)[-2:] == ["reduce_scatter_tensor", "wait_tensor"]


def test_a_bf16_grad_cast_up_is_reduced_as_cast_and_divided_after():
    """A bf16 sum cast to fp32 (a matmul's grad): the reduce reads the cast, the division
    moves to the reduced shard."""
    gm = reduce_where_summed_pass(_summed_graph(source_dtype=torch.bfloat16), {"0"})
    reduce = next(n for n in gm.graph.nodes if op_name(n) == "reduce_scatter_tensor")
    assert op_name(reduce.args[0]) == "convert_element_type"
    assert reduce.args[0].meta["val"].dtype == torch.float32
    assert _ops(gm)[-2:] == ["wait_tensor", "div"]


if __name__ == "__main__":
    unittest.main()
