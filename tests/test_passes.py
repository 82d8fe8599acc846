"""fczero's graph passes: bucket plans, the schedule, the budget, and rank agreement.

Graphs come from AOT autograd under the fake process group (``aot_eager`` records
them); the passes are applied directly, as Inductor would apply them after its own
post-grad passes. Snapshots are recorded with torch 2.13 (see test_graphs.py).
"""

from __future__ import annotations

import logging
import unittest

import expecttest
import torch
import torch.distributed as dist
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch._inductor import config as inductor_config
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import fczero
from fczero.memory import live_bytes
from fczero.passes.schedule import allocated_peak
from fczero.passes import PassSettings, run_passes
from fczero.passes.install import FczeroPostGradPass
from fczero.testing import backends
from fczero.testing.distributed import run_on_ranks
from fczero.testing.graphs import collective_sequence, render
from tests.models import ThreeBlocks, UnevenTiedMLP
from tests.test_graphs import same_torch

PER_BLOCK = 3 << 19  # 1.5 MiB: each 1 MiB block of ThreeBlocks is a bucket of its own


def settings(**overrides) -> PassSettings:
    values = {
        "groups": frozenset({"0"}),
        "bucket_bytes": PER_BLOCK,
        "prefetch": 1,
        "memory_budget": None,
    }
    values.update(overrides)
    return PassSettings(**values)


class PassTest(expecttest.TestCase):
    def setUp(self) -> None:
        torch._dynamo.reset()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)

    def tearDown(self) -> None:
        dist.destroy_process_group()
        torch._dynamo.reset()

    def graphs(self) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        torch.manual_seed(0)
        model = fczero.parallelize(
            ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(compile_passes=False)
        )
        backend = AotEagerAndRecordGraphs()
        torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 512)).sum().backward()
        return backend.fw_graphs[0], backend.bw_graphs[0]

    def test_buckets_follow_blocks(self):
        fw, bw = self.graphs()
        self.assertEqual(len([c for c in collective_sequence(fw) if c.startswith("all_gather")]), 7)
        run_passes(fw, settings())
        run_passes(bw, settings())
        # forward: blocks.0, blocks.1, blocks.2, and the 16 KiB head alone (the last block)
        self.assertEqual(
            [c for c in collective_sequence(fw) if c.startswith("all_gather")],
            [
                "all_gather_into_tensor[262656]",
                "all_gather_into_tensor[262656]",
                "all_gather_into_tensor[262656]",
                "all_gather_into_tensor[8, 512]",
            ],
        )
        # backward: one reduce-scatter per bucket, in the order the gradients become ready
        self.assertEqual(
            [c for c in collective_sequence(bw) if c.startswith("reduce_scatter")],
            [
                "reduce_scatter_tensor[4, 512]",  # head alone: the first block of backward
                "reduce_scatter_tensor[131328]",
                "reduce_scatter_tensor[131328]",
                "reduce_scatter_tensor[131328]",
            ],
        )

    def test_first_and_last_block_alone_whatever_the_cap(self):
        # [Note: small ends]: a cap that holds the whole model still leaves the first and
        # the last block on their own, and the middle blocks in one bucket
        fw, bw = self.graphs()
        run_passes(fw, settings(bucket_bytes=256 << 20))
        run_passes(bw, settings(bucket_bytes=256 << 20))
        self.assertEqual(
            [c for c in collective_sequence(fw) if c.startswith("all_gather")],
            [
                "all_gather_into_tensor[262656]",  # blocks.0
                "all_gather_into_tensor[525312]",  # blocks.1 + blocks.2
                "all_gather_into_tensor[8, 512]",  # head
            ],
        )
        self.assertEqual(
            [c for c in collective_sequence(bw) if c.startswith("reduce_scatter")],
            [
                "reduce_scatter_tensor[4, 512]",  # head, the first grads of backward
                "reduce_scatter_tensor[262656]",  # blocks.2 + blocks.1
                "reduce_scatter_tensor[131328]",  # blocks.0, the last
            ],
        )

    def test_reduces_are_sized_in_the_gathered_dtype(self):
        # a block's fp32 grads are twice its bf16 params: counted at the param dtype's 2
        # bytes a block is one reduce-scatter, as it is one all-gather; counted at their
        # own 4 bytes the same cap splits every block
        def reduces(itemsize):
            _, bw = self.graphs()
            run_passes(bw, settings(bucket_bytes=3 << 18, param_itemsize=itemsize))
            return [c for c in collective_sequence(bw) if c.startswith("reduce_scatter")]

        # at 2 bytes: the head alone, blocks 2 and 1 (a bucket under 1 MiB takes the next
        # block), block 0 alone; at 4 bytes each block is over the cap and split
        self.assertEqual(
            reduces(2),
            [
                "reduce_scatter_tensor[4, 512]",
                "reduce_scatter_tensor[262656]",
                "reduce_scatter_tensor[131328]",
            ],
        )
        self.assertEqual(len(reduces(None)), 7)  # the head, then each bias and weight apart

    def test_reduce_scatters_are_waited_after_a_matmul(self):
        # every reduce-scatter but the last is in flight across at least one matmul
        _, bw = self.graphs()
        run_passes(bw, settings())
        names = [str(n.target) for n in bw.graph.nodes if n.op == "call_function"]
        issued = [i for i, t in enumerate(names) if "reduce_scatter_tensor" in t]
        waits = []
        for node in bw.graph.nodes:
            if "reduce_scatter_tensor" in str(node.target):
                (wait,) = node.users
                waits.append(wait)
        order = {n: i for i, n in enumerate(n for n in bw.graph.nodes if n.op == "call_function")}
        matmuls = [i for i, t in enumerate(names) if t in ("aten.mm.default", "aten.addmm.default")]
        for start, wait in list(zip(issued, waits))[:-1]:
            self.assertTrue(any(start < m < order[wait] for m in matmuls), names)

    def test_prefetch_issues_the_next_gather_before_this_blocks_matmul(self):
        fw, _ = self.graphs()
        run_passes(fw, settings())
        order = [n for n in fw.graph.nodes if n.op == "call_function"]
        names = [str(n.target) for n in order]
        gathers = [i for i, t in enumerate(names) if "all_gather_into_tensor" in t]
        matmuls = [i for i, t in enumerate(names) if t in ("aten.addmm.default", "aten.mm.default")]
        for gather, matmul in zip(gathers[1:], matmuls):
            self.assertLess(gather, matmul)

    def test_budget_too_small_runs_without_prefetch_and_says_so(self):
        fw, _ = self.graphs()
        with self.assertLogs("fczero", level=logging.WARNING) as logs:
            run_passes(fw, settings(memory_budget=1))
        self.assertIn("too small to prefetch any all-gather", "\n".join(logs.output))
        names = [str(n.target) for n in fw.graph.nodes]
        gathers = [i for i, t in enumerate(names) if "all_gather_into_tensor" in t]
        waits = [i for i, t in enumerate(names) if "wait_tensor" in t]
        # without prefetch each gather is issued after the previous bucket's compute
        matmuls = [i for i, t in enumerate(names) if t == "aten.addmm.default"]
        self.assertGreater(gathers[1], matmuls[0])
        self.assertGreater(gathers[2], matmuls[1])
        self.assertEqual(len(gathers), len(waits))

    def test_budget_decides_how_far_ahead(self):
        def placement(budget):
            fw, _ = self.graphs()
            run_passes(fw, settings(prefetch=2, memory_budget=budget))
            names = [str(n.target) for n in fw.graph.nodes]
            gathers = [i for i, t in enumerate(names) if "all_gather_into_tensor" in t]
            matmuls = [i for i, t in enumerate(names) if t == "aten.addmm.default"]
            return fw, gathers, matmuls

        _, gathers, matmuls = placement(None)
        self.assertLess(gathers[2], matmuls[0])  # unlimited: two buckets ahead
        one_ahead, _ = self.graphs()
        run_passes(one_ahead, settings(prefetch=1))
        budget = allocated_peak(one_ahead.graph, {"0"})  # what one bucket ahead needs
        fw, gathers, matmuls = placement(budget)
        self.assertGreater(gathers[2], matmuls[0])  # the budget holds it to one ahead
        self.assertLess(gathers[2], matmuls[1])
        self.assertLessEqual(allocated_peak(fw.graph, {"0"}), budget)

    def test_graph_without_fczero_collectives_is_untouched(self):
        def f(x):
            return torch.relu(x) @ x.T

        backend = AotEagerAndRecordGraphs()
        torch.compile(f, backend=backend)(torch.randn(4, 4))
        before = render(backend.fw_graphs[0])
        self.assertIs(run_passes(backend.fw_graphs[0]), backend.fw_graphs[0])
        self.assertEqual(render(backend.fw_graphs[0]), before)

    @same_torch
    def test_snapshot_three_blocks_after_passes(self):
        fw, bw = self.graphs()
        run_passes(fw, settings())
        run_passes(bw, settings())
        self.assertExpectedInline(
            render(fw),
            """\
def forward(self, primals_1: "f32[256, 512]", primals_2: "f32[256]", primals_3: "f32[4, 512]", primals_4: "f32[256, 512]", primals_5: "f32[256]", primals_6: "f32[256, 512]", primals_7: "f32[256]", primals_8: "f32[4, 512]"):
view_default: "f32[131072]" = aten.view(primals_1, [-1])
view_default_1: "f32[256]" = aten.view(primals_2, [-1])
cat_default: "f32[131328]" = aten.cat([view_default, view_default_1], 0);  view_default = view_default_1 = None
all_gather_into_tensor_default: "f32[262656]" = _c10d_functional.all_gather_into_tensor(cat_default, 2, '0')
wait_tensor_default: "f32[262656]" = _c10d_functional.wait_tensor(all_gather_into_tensor_default)
view_default_2: "f32[2, 131328]" = aten.view(wait_tensor_default, [2, 131328])
slice_tensor: "f32[2, 131072]" = aten.slice.Tensor(view_default_2, 1, 0, 131072)
clone_default: "f32[2, 131072]" = aten.clone(slice_tensor, memory_format = torch.contiguous_format)
slice_tensor_1: "f32[2, 256]" = aten.slice.Tensor(view_default_2, 1, 131072, 131328)
clone_default_1: "f32[2, 256]" = aten.clone(slice_tensor_1, memory_format = torch.contiguous_format)
view_default_3: "f32[512, 512]" = aten.view(clone_default, [512, 512])
view_default_4: "f32[512]" = aten.view(clone_default_1, [512])
view_default_5: "f32[131072]" = aten.view(primals_4, [-1])
view_default_6: "f32[256]" = aten.view(primals_5, [-1])
cat_default_1: "f32[131328]" = aten.cat([view_default_5, view_default_6], 0);  view_default_5 = view_default_6 = None
all_gather_into_tensor_default_1: "f32[262656]" = _c10d_functional.all_gather_into_tensor(cat_default_1, 2, '0')
t: "f32[512, 512]" = aten.t(view_default_3)
addmm: "f32[4, 512]" = aten.addmm(view_default_4, primals_3, t);  view_default_4 = t = None
relu: "f32[4, 512]" = aten.relu(addmm)
wait_tensor_default_1: "f32[262656]" = _c10d_functional.wait_tensor(all_gather_into_tensor_default_1)
view_default_7: "f32[2, 131328]" = aten.view(wait_tensor_default_1, [2, 131328])
slice_tensor_2: "f32[2, 131072]" = aten.slice.Tensor(view_default_7, 1, 0, 131072)
clone_default_2: "f32[2, 131072]" = aten.clone(slice_tensor_2, memory_format = torch.contiguous_format)
slice_tensor_3: "f32[2, 256]" = aten.slice.Tensor(view_default_7, 1, 131072, 131328)
clone_default_3: "f32[2, 256]" = aten.clone(slice_tensor_3, memory_format = torch.contiguous_format)
view_default_8: "f32[512, 512]" = aten.view(clone_default_2, [512, 512])
view_default_9: "f32[512]" = aten.view(clone_default_3, [512])
view_default_10: "f32[131072]" = aten.view(primals_6, [-1])
view_default_11: "f32[256]" = aten.view(primals_7, [-1])
cat_default_2: "f32[131328]" = aten.cat([view_default_10, view_default_11], 0);  view_default_10 = view_default_11 = None
all_gather_into_tensor_default_2: "f32[262656]" = _c10d_functional.all_gather_into_tensor(cat_default_2, 2, '0')
t_1: "f32[512, 512]" = aten.t(view_default_8)
addmm_1: "f32[4, 512]" = aten.addmm(view_default_9, relu, t_1);  view_default_9 = t_1 = None
relu_1: "f32[4, 512]" = aten.relu(addmm_1)
wait_tensor_default_2: "f32[262656]" = _c10d_functional.wait_tensor(all_gather_into_tensor_default_2)
view_default_12: "f32[2, 131328]" = aten.view(wait_tensor_default_2, [2, 131328])
slice_tensor_4: "f32[2, 131072]" = aten.slice.Tensor(view_default_12, 1, 0, 131072)
clone_default_4: "f32[2, 131072]" = aten.clone(slice_tensor_4, memory_format = torch.contiguous_format)
slice_tensor_5: "f32[2, 256]" = aten.slice.Tensor(view_default_12, 1, 131072, 131328)
clone_default_5: "f32[2, 256]" = aten.clone(slice_tensor_5, memory_format = torch.contiguous_format)
view_default_13: "f32[512, 512]" = aten.view(clone_default_4, [512, 512])
view_default_14: "f32[512]" = aten.view(clone_default_5, [512])
all_gather_into_tensor_6: "f32[8, 512]" = _c10d_functional.all_gather_into_tensor(primals_8, 2, '0')
t_2: "f32[512, 512]" = aten.t(view_default_13)
addmm_2: "f32[4, 512]" = aten.addmm(view_default_14, relu_1, t_2);  view_default_14 = t_2 = None
relu_2: "f32[4, 512]" = aten.relu(addmm_2)
wait_tensor_6: "f32[8, 512]" = _c10d_functional.wait_tensor(all_gather_into_tensor_6)
t_3: "f32[512, 8]" = aten.t(wait_tensor_6)
mm: "f32[4, 8]" = aten.mm(relu_2, t_3)
return (mm, primals_1, primals_2, primals_3, primals_4, primals_5, primals_6, primals_7, primals_8, relu, relu_1, relu_2)""",
        )
        self.assertExpectedInline(
            render(bw),
            """\
def forward(self, primals_1: "f32[256, 512]", primals_2: "f32[256]", primals_3: "f32[4, 512]", primals_4: "f32[256, 512]", primals_5: "f32[256]", primals_6: "f32[256, 512]", primals_7: "f32[256]", primals_8: "f32[4, 512]", relu: "f32[4, 512]", relu_1: "f32[4, 512]", relu_2: "f32[4, 512]", tangents_1: "f32[4, 8]"):
t_4: "f32[8, 4]" = aten.t(tangents_1)
mm_1: "f32[8, 512]" = aten.mm(t_4, relu_2)
t_5: "f32[512, 8]" = aten.t(mm_1)
all_gather_into_tensor_6: "f32[8, 512]" = _c10d_functional.all_gather_into_tensor(primals_8, 2, '0')
wait_tensor_6: "f32[8, 512]" = _c10d_functional.wait_tensor(all_gather_into_tensor_6)
all_gather_into_tensor_4: "f32[512, 512]" = _c10d_functional.all_gather_into_tensor(primals_6, 2, '0')
t_3: "f32[512, 8]" = aten.t(wait_tensor_6)
t_6: "f32[8, 512]" = aten.t(t_3)
mm_2: "f32[4, 512]" = aten.mm(tangents_1, t_6);  tangents_1 = t_6 = None
t_7: "f32[8, 512]" = aten.t(t_5)
div: "f32[8, 512]" = aten.div.Tensor(t_7, 2)
reduce_scatter_tensor: "f32[4, 512]" = _c10d_functional.reduce_scatter_tensor(div, 'sum', 2, '0')
detach_14: "f32[4, 512]" = aten.detach(relu_2)
detach_17: "f32[4, 512]" = aten.detach(detach_14)
threshold_backward: "f32[4, 512]" = aten.threshold_backward(mm_2, detach_17, 0);  mm_2 = detach_17 = None
wait_tensor_4: "f32[512, 512]" = _c10d_functional.wait_tensor(all_gather_into_tensor_4)
all_gather_into_tensor_2: "f32[512, 512]" = _c10d_functional.all_gather_into_tensor(primals_4, 2, '0')
t_2: "f32[512, 512]" = aten.t(wait_tensor_4)
t_8: "f32[512, 512]" = aten.t(t_2)
mm_3: "f32[4, 512]" = aten.mm(threshold_backward, t_8)
t_9: "f32[512, 4]" = aten.t(threshold_backward)
mm_4: "f32[512, 512]" = aten.mm(t_9, relu_1)
t_10: "f32[512, 512]" = aten.t(mm_4)
sum_1: "f32[1, 512]" = aten.sum.dim_IntList(threshold_backward, [0], True)
view: "f32[512]" = aten.view(sum_1, [512])
t_11: "f32[512, 512]" = aten.t(t_10)
div_1: "f32[512]" = aten.div.Tensor(view, 2)
div_2: "f32[512, 512]" = aten.div.Tensor(t_11, 2)
view_default: "f32[2, 256]" = aten.view(div_1, [2, -1])
view_default_1: "f32[2, 131072]" = aten.view(div_2, [2, -1])
cat_default: "f32[2, 131328]" = aten.cat([view_default, view_default_1], 1);  view_default = view_default_1 = None
view_default_2: "f32[262656]" = aten.view(cat_default, [-1])
wait_tensor_7: "f32[4, 512]" = _c10d_functional.wait_tensor(reduce_scatter_tensor)
reduce_scatter_tensor_default: "f32[131328]" = _c10d_functional.reduce_scatter_tensor(view_default_2, 'sum', 2, '0')
detach_9: "f32[4, 512]" = aten.detach(relu_1)
detach_18: "f32[4, 512]" = aten.detach(detach_9)
threshold_backward_1: "f32[4, 512]" = aten.threshold_backward(mm_3, detach_18, 0);  mm_3 = detach_18 = None
wait_tensor_2: "f32[512, 512]" = _c10d_functional.wait_tensor(all_gather_into_tensor_2)
t_1: "f32[512, 512]" = aten.t(wait_tensor_2)
t_12: "f32[512, 512]" = aten.t(t_1)
mm_5: "f32[4, 512]" = aten.mm(threshold_backward_1, t_12)
t_13: "f32[512, 4]" = aten.t(threshold_backward_1)
mm_6: "f32[512, 512]" = aten.mm(t_13, relu)
t_14: "f32[512, 512]" = aten.t(mm_6)
sum_2: "f32[1, 512]" = aten.sum.dim_IntList(threshold_backward_1, [0], True)
view_1: "f32[512]" = aten.view(sum_2, [512])
t_15: "f32[512, 512]" = aten.t(t_14)
div_3: "f32[512]" = aten.div.Tensor(view_1, 2)
div_4: "f32[512, 512]" = aten.div.Tensor(t_15, 2)
view_default_5: "f32[2, 256]" = aten.view(div_3, [2, -1])
view_default_6: "f32[2, 131072]" = aten.view(div_4, [2, -1])
cat_default_1: "f32[2, 131328]" = aten.cat([view_default_5, view_default_6], 1);  view_default_5 = view_default_6 = None
view_default_7: "f32[262656]" = aten.view(cat_default_1, [-1])
wait_tensor_default: "f32[131328]" = _c10d_functional.wait_tensor(reduce_scatter_tensor_default)
slice_tensor: "f32[256]" = aten.slice.Tensor(wait_tensor_default, 0, 0, 256)
slice_tensor_1: "f32[131072]" = aten.slice.Tensor(wait_tensor_default, 0, 256, 131328)
view_default_3: "f32[256]" = aten.view(slice_tensor, [256])
view_default_4: "f32[256, 512]" = aten.view(slice_tensor_1, [256, 512])
reduce_scatter_tensor_default_1: "f32[131328]" = _c10d_functional.reduce_scatter_tensor(view_default_7, 'sum', 2, '0')
detach_4: "f32[4, 512]" = aten.detach(relu)
detach_19: "f32[4, 512]" = aten.detach(detach_4)
threshold_backward_2: "f32[4, 512]" = aten.threshold_backward(mm_5, detach_19, 0);  mm_5 = detach_19 = None
t_16: "f32[512, 4]" = aten.t(threshold_backward_2)
mm_7: "f32[512, 512]" = aten.mm(t_16, primals_3);  t_16 = primals_3 = None
t_17: "f32[512, 512]" = aten.t(mm_7)
sum_3: "f32[1, 512]" = aten.sum.dim_IntList(threshold_backward_2, [0], True)
view_2: "f32[512]" = aten.view(sum_3, [512])
t_18: "f32[512, 512]" = aten.t(t_17)
div_5: "f32[512]" = aten.div.Tensor(view_2, 2)
div_6: "f32[512, 512]" = aten.div.Tensor(t_18, 2)
view_default_10: "f32[2, 256]" = aten.view(div_5, [2, -1])
view_default_11: "f32[2, 131072]" = aten.view(div_6, [2, -1])
cat_default_2: "f32[2, 131328]" = aten.cat([view_default_10, view_default_11], 1);  view_default_10 = view_default_11 = None
view_default_12: "f32[262656]" = aten.view(cat_default_2, [-1])
wait_tensor_default_1: "f32[131328]" = _c10d_functional.wait_tensor(reduce_scatter_tensor_default_1)
slice_tensor_2: "f32[256]" = aten.slice.Tensor(wait_tensor_default_1, 0, 0, 256)
slice_tensor_3: "f32[131072]" = aten.slice.Tensor(wait_tensor_default_1, 0, 256, 131328)
view_default_8: "f32[256]" = aten.view(slice_tensor_2, [256])
view_default_9: "f32[256, 512]" = aten.view(slice_tensor_3, [256, 512])
reduce_scatter_tensor_default_2: "f32[131328]" = _c10d_functional.reduce_scatter_tensor(view_default_12, 'sum', 2, '0')
wait_tensor_default_2: "f32[131328]" = _c10d_functional.wait_tensor(reduce_scatter_tensor_default_2)
slice_tensor_4: "f32[256]" = aten.slice.Tensor(wait_tensor_default_2, 0, 0, 256)
slice_tensor_5: "f32[131072]" = aten.slice.Tensor(wait_tensor_default_2, 0, 256, 131328)
view_default_13: "f32[256]" = aten.view(slice_tensor_4, [256])
view_default_14: "f32[256, 512]" = aten.view(slice_tensor_5, [256, 512])
return (view_default_14, view_default_13, None, view_default_9, view_default_8, view_default_4, view_default_3, wait_tensor_7)""",
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


def test_installed_pass_runs_the_users_pass_first(fake_pg):
    calls = []

    class UserPass:
        def __call__(self, graph):
            calls.append("user")

    with inductor_config.patch(post_grad_custom_post_pass=UserPass()):
        fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)))
        installed = inductor_config.post_grad_custom_post_pass
        assert isinstance(installed, FczeroPostGradPass)
        assert installed.uuid() is None  # the user's pass has no uuid: no caching, as before
        assert inductor_config.reorder_for_peak_memory is False
        gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        gm.graph.output(None)
        installed(gm.graph)
    assert calls == ["user"]


BUDGETS = [None, 0, 400, 800, 1200, 1600, 2000, 3000, 4000]  # bytes; tight ones split ranks before


def _sequences(rank: int, world_size: int) -> list[list[list[str]]]:
    out = []
    for budget in BUDGETS:
        torch._dynamo.reset()
        graphs: list[torch.fx.GraphModule] = []
        torch.manual_seed(0)
        model = fczero.parallelize(
            UnevenTiedMLP(),
            init_device_mesh("cpu", (world_size,)),
            comm_policy=fczero.CommPolicy(bucket_bytes=0),
            memory_budget=budget,
        )
        compiled = torch.compile(model, backend=backends.recording(graphs))
        compiled(torch.randn(4, 5)).sum().backward()
        out.append([_order(g) for g in graphs])
    return out


def _order(gm: torch.fx.GraphModule) -> list[str]:
    """Collectives and matmuls in program order: where each gather was placed."""
    keep = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "mm", "addmm")
    return [
        f"{n.target}{list(n.meta['val'].shape)}"
        for n in gm.graph.nodes
        if n.op == "call_function" and str(n.target).split(".")[1] in keep
    ]


def test_every_rank_issues_the_same_collectives():
    """13 rows on 4 ranks: shards differ in real rows (4, 4, 4, 1); under any memory budget
    the collectives, and where they sit among the matmuls, must not."""
    per_rank = run_on_ranks(_sequences, 4)
    assert all(graphs for graphs in per_rank[0])
    for other in per_rank[1:]:
        assert other == per_rank[0]


def _gloo_schedule(rank: int, world_size: int) -> list[list[str]]:
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []
    model = fczero.parallelize(
        ThreeBlocks(), init_device_mesh("cpu", (world_size,)), comm_policy=fczero.CommPolicy(bucket_bytes=PER_BLOCK)
    )
    compiled = torch.compile(model, backend=backends.recording(graphs))
    compiled(torch.randn(4, 512)).sum().backward()
    keep = ("all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor", "addmm", "mm")
    return [
        [str(n.target).split(".")[1] for n in g.graph.nodes if n.op == "call_function"
         and str(n.target).split(".")[1] in keep]
        for g in graphs
    ]  # fmt: skip


def test_gloo_waits_each_collective_where_it_is_issued():
    """[Note: one gloo collective in flight]: on gloo the prefetch still issues block 1's
    gather before block 0's matmul, and every collective is waited right after it."""
    forward, backward = run_on_ranks(_gloo_schedule, 2)[0]
    for ops in (forward, backward):
        issued = [i for i, op in enumerate(ops) if op in ("all_gather_into_tensor", "reduce_scatter_tensor")]
        assert issued and all(ops[i + 1] == "wait_tensor" for i in issued), ops
    gathers = [i for i, op in enumerate(forward) if op == "all_gather_into_tensor"]
    assert gathers[1] < forward.index("addmm"), forward


if __name__ == "__main__":
    unittest.main()
