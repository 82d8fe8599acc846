"""The memory model (fczero/core/memory.py): bytes alive at each node of an FX graph, and
the budget a plan from measurement starts from."""

from __future__ import annotations

import torch

from fczero.core.memory import (
    budget_and_peak,
    device_budget,
    live_bytes,
    nbytes,
    peak_bytes,
    storage_root,
)


def test_memory_model_counts_views_as_their_base():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(256)  # 1 KiB, alive throughout
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    y.meta["val"] = torch.empty(256)
    v = g.call_function(torch.ops.aten.view.default, (y, [16, 16]))
    v.meta["val"] = torch.empty(16, 16)
    z = g.call_function(torch.ops.aten.sum.default, (v,))
    z.meta["val"] = torch.empty(())
    g.output(z)
    # x, then x+y, y kept by its view, then y freed after sum reads the view
    assert live_bytes(g) == [1024, 2048, 2048, 2052, 1028]


def test_storage_root_sees_through_views_and_waits_but_not_compute():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    gathered = g.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 2, "0"))
    waited = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (gathered,))
    sliced = g.call_function(torch.ops.aten.slice.Tensor, (waited, 0, 0, 3))
    doubled = g.call_function(torch.ops.aten.mul.Tensor, (sliced, 2))
    assert storage_root(sliced) is gathered
    assert storage_root(doubled) is doubled
    assert storage_root(x) is x


def test_bytes_of_a_node_count_every_tensor_it_returns_and_skip_symbolic_ones():
    g = torch.fx.Graph()
    pair = g.placeholder("pair")
    pair.meta["val"] = (torch.empty(4, dtype=torch.float16), torch.empty(2, 2))
    none = g.placeholder("none")
    assert nbytes(pair) == 4 * 2 + 4 * 4
    assert nbytes(none) == 0  # no fake value: nothing known, nothing counted


def test_ignored_nodes_own_no_bytes():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(256)
    y = g.call_function(torch.ops.aten.neg.default, (x,))
    y.meta["val"] = torch.empty(256)
    g.output(y)
    assert peak_bytes(g) == 2048
    assert peak_bytes(g, ignore={x}) == 1024  # graph inputs left out, as the passes do


def test_plans_from_measurement_say_why_they_cannot_start_on_the_cpu():
    cpu = torch.device("cpu")
    assert device_budget(cpu, None) is None
    assert device_budget(cpu, 5 << 20) == 5 << 20
    assert budget_and_peak(cpu, None) == "no memory_budget"
    assert budget_and_peak(cpu, 5 << 20) == "no allocator peak"  # the CPU has no peak counter
