"""``run_passes`` (fczero/passes/__init__.py): every pass in order on a post-grad graph,
and nothing done to a graph without fczero's collectives."""

from __future__ import annotations

import unittest

import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs

from fczero.passes import run_passes
from fczero.testing.graphs import render
from tests.passes import ThreeBlocksGraphs, settings
from tests.snapshots import same_torch


class RunPassesTest(ThreeBlocksGraphs):
    def test_graph_without_fczero_collectives_is_untouched(self):
        def f(x):
            return torch.relu(x) @ x.T

        backend = AotEagerAndRecordGraphs()
        torch.compile(f, backend=backend)(torch.randn(4, 4))
        before = render(backend.fw_graphs[0])
        self.assertIs(run_passes(backend.fw_graphs[0]), backend.fw_graphs[0])
        self.assertEqual(render(backend.fw_graphs[0]), before)

    def test_the_passes_regenerate_the_code_once(self):
        """[Note: one recompile per graph]: once a chain, and the code matches the graph."""
        fw, _ = self.graphs()
        calls = []
        real = fw.recompile
        fw.recompile = lambda: calls.append(1) or real()  # count on this instance only
        run_passes(fw, settings())
        self.assertEqual(len(calls), 1)
        self.assertIn("all_gather_into_tensor_out", fw.code)  # the last passes' nodes

    def test_under_inductors_hook_the_code_is_left_to_inductor(self):
        """``recompile=False`` (what the installed hook passes): the graph is rewritten and
        its code is not regenerated, since Inductor regenerates it after its own passes."""
        fw, _ = self.graphs()
        calls = []
        real = fw.recompile
        fw.recompile = lambda: calls.append(1) or real()
        run_passes(fw, settings(), recompile=False)
        self.assertEqual(calls, [])
        self.assertNotIn("all_gather_into_tensor_out", fw.code)
        ops = {getattr(n.target, "__name__", "") for n in fw.graph.nodes}
        self.assertIn("all_gather_into_tensor_out.default", ops)

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
empty_memory_format: "f32[262656]" = aten.empty.memory_format([262656], dtype = torch.float32, device = device(type='cpu'))
slice_tensor_6: "f32[131328]" = aten.slice.Tensor(empty_memory_format, 0, 0, 131328)
copy__default: "f32[131328]" = aten.copy_(slice_tensor_6, cat_default);  slice_tensor_6 = cat_default = None
all_gather_into_tensor_out_default: "f32[262656]" = _c10d_functional.all_gather_into_tensor_out(copy__default, 2, '0', out = empty_memory_format);  copy__default = empty_memory_format = None
wait_tensor_default: "f32[262656]" = _c10d_functional.wait_tensor(all_gather_into_tensor_out_default)
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
empty_memory_format_1: "f32[262656]" = aten.empty.memory_format([262656], dtype = torch.float32, device = device(type='cpu'))
slice_tensor_7: "f32[131328]" = aten.slice.Tensor(empty_memory_format_1, 0, 0, 131328)
copy__default_1: "f32[131328]" = aten.copy_(slice_tensor_7, cat_default_1);  slice_tensor_7 = cat_default_1 = None
all_gather_into_tensor_out_default_1: "f32[262656]" = _c10d_functional.all_gather_into_tensor_out(copy__default_1, 2, '0', out = empty_memory_format_1);  copy__default_1 = empty_memory_format_1 = None
t: "f32[512, 512]" = aten.t(view_default_3)
addmm: "f32[4, 512]" = aten.addmm(view_default_4, primals_3, t);  view_default_4 = t = None
relu: "f32[4, 512]" = aten.relu(addmm)
wait_tensor_default_1: "f32[262656]" = _c10d_functional.wait_tensor(all_gather_into_tensor_out_default_1)
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
empty_memory_format_2: "f32[262656]" = aten.empty.memory_format([262656], dtype = torch.float32, device = device(type='cpu'))
slice_tensor_8: "f32[131328]" = aten.slice.Tensor(empty_memory_format_2, 0, 0, 131328)
copy__default_2: "f32[131328]" = aten.copy_(slice_tensor_8, cat_default_2);  slice_tensor_8 = cat_default_2 = None
all_gather_into_tensor_out_default_2: "f32[262656]" = _c10d_functional.all_gather_into_tensor_out(copy__default_2, 2, '0', out = empty_memory_format_2);  copy__default_2 = empty_memory_format_2 = None
t_1: "f32[512, 512]" = aten.t(view_default_8)
addmm_1: "f32[4, 512]" = aten.addmm(view_default_9, relu, t_1);  view_default_9 = t_1 = None
relu_1: "f32[4, 512]" = aten.relu(addmm_1)
wait_tensor_default_2: "f32[262656]" = _c10d_functional.wait_tensor(all_gather_into_tensor_out_default_2)
view_default_12: "f32[2, 131328]" = aten.view(wait_tensor_default_2, [2, 131328])
slice_tensor_4: "f32[2, 131072]" = aten.slice.Tensor(view_default_12, 1, 0, 131072)
clone_default_4: "f32[2, 131072]" = aten.clone(slice_tensor_4, memory_format = torch.contiguous_format)
slice_tensor_5: "f32[2, 256]" = aten.slice.Tensor(view_default_12, 1, 131072, 131328)
clone_default_5: "f32[2, 256]" = aten.clone(slice_tensor_5, memory_format = torch.contiguous_format)
view_default_13: "f32[512, 512]" = aten.view(clone_default_4, [512, 512])
view_default_14: "f32[512]" = aten.view(clone_default_5, [512])
empty_memory_format_3: "f32[8, 512]" = aten.empty.memory_format([8, 512], dtype = torch.float32, device = device(type='cpu'))
slice_tensor_9: "f32[4, 512]" = aten.slice.Tensor(empty_memory_format_3, 0, 0, 4)
copy__default_3: "f32[4, 512]" = aten.copy_(slice_tensor_9, primals_8)
all_gather_into_tensor_out_default_3: "f32[8, 512]" = _c10d_functional.all_gather_into_tensor_out(copy__default_3, 2, '0', out = empty_memory_format_3);  copy__default_3 = empty_memory_format_3 = None
t_2: "f32[512, 512]" = aten.t(view_default_13)
addmm_2: "f32[4, 512]" = aten.addmm(view_default_14, relu_1, t_2);  view_default_14 = t_2 = None
relu_2: "f32[4, 512]" = aten.relu(addmm_2)
wait_tensor_6: "f32[8, 512]" = _c10d_functional.wait_tensor(all_gather_into_tensor_out_default_3)
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
empty_memory_format: "f32[8, 512]" = aten.empty.memory_format([8, 512], dtype = torch.float32, device = device(type='cpu'))
slice_tensor_6: "f32[4, 512]" = aten.slice.Tensor(empty_memory_format, 0, 0, 4)
copy__default: "f32[4, 512]" = aten.copy_(slice_tensor_6, primals_8);  slice_tensor_6 = primals_8 = None
all_gather_into_tensor_out_default: "f32[8, 512]" = _c10d_functional.all_gather_into_tensor_out(copy__default, 2, '0', out = empty_memory_format);  copy__default = empty_memory_format = None
wait_tensor_6: "f32[8, 512]" = _c10d_functional.wait_tensor(all_gather_into_tensor_out_default)
empty_memory_format_1: "f32[512, 512]" = aten.empty.memory_format([512, 512], dtype = torch.float32, device = device(type='cpu'))
slice_tensor_7: "f32[256, 512]" = aten.slice.Tensor(empty_memory_format_1, 0, 0, 256)
copy__default_1: "f32[256, 512]" = aten.copy_(slice_tensor_7, primals_6);  slice_tensor_7 = primals_6 = None
all_gather_into_tensor_out_default_1: "f32[512, 512]" = _c10d_functional.all_gather_into_tensor_out(copy__default_1, 2, '0', out = empty_memory_format_1);  copy__default_1 = empty_memory_format_1 = None
t_3: "f32[512, 8]" = aten.t(wait_tensor_6)
t_6: "f32[8, 512]" = aten.t(t_3)
mm_2: "f32[4, 512]" = aten.mm(tangents_1, t_6);  tangents_1 = t_6 = None
t_7: "f32[8, 512]" = aten.t(t_5)
div: "f32[8, 512]" = aten.div.Tensor(t_7, 2)
detach_14: "f32[4, 512]" = aten.detach(relu_2)
detach_17: "f32[4, 512]" = aten.detach(detach_14)
threshold_backward: "f32[4, 512]" = aten.threshold_backward(mm_2, detach_17, 0);  mm_2 = detach_17 = None
wait_tensor_4: "f32[512, 512]" = _c10d_functional.wait_tensor(all_gather_into_tensor_out_default_1)
empty_memory_format_2: "f32[512, 512]" = aten.empty.memory_format([512, 512], dtype = torch.float32, device = device(type='cpu'))
slice_tensor_8: "f32[256, 512]" = aten.slice.Tensor(empty_memory_format_2, 0, 0, 256)
copy__default_2: "f32[256, 512]" = aten.copy_(slice_tensor_8, primals_4);  slice_tensor_8 = primals_4 = None
all_gather_into_tensor_out_default_2: "f32[512, 512]" = _c10d_functional.all_gather_into_tensor_out(copy__default_2, 2, '0', out = empty_memory_format_2);  copy__default_2 = empty_memory_format_2 = None
reduce_scatter_tensor: "f32[4, 512]" = _c10d_functional.reduce_scatter_tensor(div, 'sum', 2, '0')
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
wait_tensor_2: "f32[512, 512]" = _c10d_functional.wait_tensor(all_gather_into_tensor_out_default_2)
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


if __name__ == "__main__":
    unittest.main()
