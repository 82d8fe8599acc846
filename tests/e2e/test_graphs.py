"""Compiled graphs under the fake process group: where each collective lands.

Snapshots are of the forward and backward graphs that AOT autograd hands to the
backend (``aot_eager`` here; Inductor receives the same graphs), rendered by
``fczero.testing.graphs.render``. They are recorded with torch 2.13 and asserted
only there: other versions name and order some nodes differently.
Regenerate with ``EXPECTTEST_ACCEPT=1 pytest tests/e2e/test_graphs.py``, then read them.
"""

from __future__ import annotations

import unittest

import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing.graphs import collective_sequence, render, saved_unsharded
from tests.cases import REGATHER
from tests.models import GraphBreakMLP, TwoLayer
from tests.snapshots import FakeGroupTestCase, same_torch


class GraphTest(FakeGroupTestCase):
    def compile_two_layer(self, **options) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        """The model's (forward, backward) graphs. With ``param_dtype`` the root's input cast
        (a forward pre-hook) compiles as a graph of its own, without collectives."""
        torch.manual_seed(0)
        model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), **options)
        backend = AotEagerAndRecordGraphs()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        compiled(torch.randn(3, 8)).sum().backward()
        forward = [g for g in backend.fw_graphs if collective_sequence(g)]
        self.assertEqual(len(forward), 1)
        self.assertEqual(len(backend.bw_graphs), 1)
        return forward[0], backend.bw_graphs[0]

    def test_partitioner_regathers_in_backward_when_resharding(self):
        fw, bw = self.compile_two_layer(reshard_after_forward=True, comm_policy=REGATHER)
        self.assertEqual(saved_unsharded(fw), [])
        self.assertIn("all_gather_into_tensor[4, 16]", collective_sequence(bw))

    def test_default_keeps_one_shard_of_the_last_modules(self):
        """[Note: the default kept bytes]: over 2 ranks half the model's bytes may stay
        gathered; ``fc2`` (256 of 832 bytes) fits, ``fc1`` then does not. So forward saves
        fc2's weight for backward, and backward gathers nothing: the only backward use of
        fc1's weight, the input's grad, is not needed (with ``REGATHER`` it gathers fc2's)."""
        fw, bw = self.compile_two_layer()
        nodes = {n.name: n for n in fw.graph.nodes}
        saved = [tuple(nodes[name].meta["val"].shape) for name in saved_unsharded(fw)]
        self.assertEqual(saved, [(4, 16)])
        self.assertEqual([c for c in collective_sequence(bw) if c.startswith("all_gather")], [])
        self.assertIn("all_gather_into_tensor[16, 8]", collective_sequence(fw))

    def test_partitioner_keeps_unsharded_params_without_resharding(self):
        fw, bw = self.compile_two_layer(reshard_after_forward=False)
        self.assertEqual(len(saved_unsharded(fw)), 1)  # fc2.weight
        self.assertNotIn("all_gather_into_tensor", " ".join(collective_sequence(bw)))

    def test_graph_break_compiles_each_piece_with_its_gathers(self):
        model = fczero.parallelize(GraphBreakMLP(), init_device_mesh("cpu", (2,)))
        backend = AotEagerAndRecordGraphs()
        torch.compile(model, backend=backend)(torch.randn(4, 5)).sum().backward()
        pieces = [collective_sequence(g) for g in backend.fw_graphs]
        self.assertEqual(len(pieces), 3)  # split at the print and at the branch
        self.assertTrue(all(any(op.startswith("all_gather") for op in p) for p in pieces))
        self.assertEqual(len(backend.bw_graphs), 2)  # the branch condition's piece has no backward

    @same_torch
    def test_snapshot_reshard_after_forward(self):
        fw, bw = self.compile_two_layer(reshard_after_forward=True, comm_policy=REGATHER)
        self.assertExpectedInline(
            render(fw),
            """\
def forward(self, primals_1: "f32[8, 8]", primals_2: "f32[8]", primals_3: "f32[3, 8]", primals_4: "f32[2, 16]"):
all_gather_into_tensor: "f32[16, 8]" = _c10d_functional.all_gather_into_tensor(primals_1, 2, '0')
wait_tensor: "f32[16, 8]" = _c10d_functional.wait_tensor(all_gather_into_tensor)
all_gather_into_tensor_1: "f32[16]" = _c10d_functional.all_gather_into_tensor(primals_2, 2, '0')
wait_tensor_1: "f32[16]" = _c10d_functional.wait_tensor(all_gather_into_tensor_1)
t: "f32[8, 16]" = aten.t(wait_tensor)
addmm: "f32[3, 16]" = aten.addmm(wait_tensor_1, primals_3, t);  wait_tensor_1 = t = None
relu: "f32[3, 16]" = aten.relu(addmm)
all_gather_into_tensor_2: "f32[4, 16]" = _c10d_functional.all_gather_into_tensor(primals_4, 2, '0')
wait_tensor_2: "f32[4, 16]" = _c10d_functional.wait_tensor(all_gather_into_tensor_2)
t_1: "f32[16, 4]" = aten.t(wait_tensor_2)
mm: "f32[3, 4]" = aten.mm(relu, t_1)
return (mm, primals_1, primals_2, primals_3, primals_4, relu)""",
        )
        self.assertExpectedInline(
            render(bw),
            """\
def forward(self, primals_1: "f32[8, 8]", primals_2: "f32[8]", primals_3: "f32[3, 8]", primals_4: "f32[2, 16]", relu: "f32[3, 16]", tangents_1: "f32[3, 4]"):
t_2: "f32[4, 3]" = aten.t(tangents_1)
mm_1: "f32[4, 16]" = aten.mm(t_2, relu)
t_3: "f32[16, 4]" = aten.t(mm_1)
all_gather_into_tensor_2: "f32[4, 16]" = _c10d_functional.all_gather_into_tensor(primals_4, 2, '0')
wait_tensor_2: "f32[4, 16]" = _c10d_functional.wait_tensor(all_gather_into_tensor_2)
t_1: "f32[16, 4]" = aten.t(wait_tensor_2)
t_4: "f32[4, 16]" = aten.t(t_1)
mm_2: "f32[3, 16]" = aten.mm(tangents_1, t_4);  tangents_1 = t_4 = None
t_5: "f32[4, 16]" = aten.t(t_3)
div: "f32[4, 16]" = aten.div.Tensor(t_5, 2)
reduce_scatter_tensor: "f32[2, 16]" = _c10d_functional.reduce_scatter_tensor(div, 'sum', 2, '0')
wait_tensor_3: "f32[2, 16]" = _c10d_functional.wait_tensor(reduce_scatter_tensor)
detach_4: "f32[3, 16]" = aten.detach(relu)
detach_7: "f32[3, 16]" = aten.detach(detach_4)
threshold_backward: "f32[3, 16]" = aten.threshold_backward(mm_2, detach_7, 0);  mm_2 = detach_7 = None
t_6: "f32[16, 3]" = aten.t(threshold_backward)
mm_3: "f32[16, 8]" = aten.mm(t_6, primals_3);  t_6 = primals_3 = None
t_7: "f32[8, 16]" = aten.t(mm_3)
sum_1: "f32[1, 16]" = aten.sum.dim_IntList(threshold_backward, [0], True)
view: "f32[16]" = aten.view(sum_1, [16])
t_8: "f32[16, 8]" = aten.t(t_7)
div_1: "f32[16]" = aten.div.Tensor(view, 2)
reduce_scatter_tensor_1: "f32[8]" = _c10d_functional.reduce_scatter_tensor(div_1, 'sum', 2, '0')
wait_tensor_4: "f32[8]" = _c10d_functional.wait_tensor(reduce_scatter_tensor_1)
div_2: "f32[16, 8]" = aten.div.Tensor(t_8, 2)
reduce_scatter_tensor_2: "f32[8, 8]" = _c10d_functional.reduce_scatter_tensor(div_2, 'sum', 2, '0')
wait_tensor_5: "f32[8, 8]" = _c10d_functional.wait_tensor(reduce_scatter_tensor_2)
return (wait_tensor_5, wait_tensor_4, None, wait_tensor_3)""",
        )

    @same_torch
    def test_snapshot_keep_after_forward(self):
        fw, bw = self.compile_two_layer(reshard_after_forward=False)
        self.assertExpectedInline(
            render(fw),
            """\
def forward(self, primals_1: "f32[8, 8]", primals_2: "f32[8]", primals_3: "f32[3, 8]", primals_4: "f32[2, 16]"):
all_gather_into_tensor: "f32[16, 8]" = _c10d_functional.all_gather_into_tensor(primals_1, 2, '0')
wait_tensor: "f32[16, 8]" = _c10d_functional.wait_tensor(all_gather_into_tensor)
all_gather_into_tensor_1: "f32[16]" = _c10d_functional.all_gather_into_tensor(primals_2, 2, '0')
wait_tensor_1: "f32[16]" = _c10d_functional.wait_tensor(all_gather_into_tensor_1)
t: "f32[8, 16]" = aten.t(wait_tensor)
addmm: "f32[3, 16]" = aten.addmm(wait_tensor_1, primals_3, t);  wait_tensor_1 = t = None
relu: "f32[3, 16]" = aten.relu(addmm)
all_gather_into_tensor_2: "f32[4, 16]" = _c10d_functional.all_gather_into_tensor(primals_4, 2, '0')
wait_tensor_2: "f32[4, 16]" = _c10d_functional.wait_tensor(all_gather_into_tensor_2)
t_1: "f32[16, 4]" = aten.t(wait_tensor_2)
mm: "f32[3, 4]" = aten.mm(relu, t_1)
t_4: "f32[4, 16]" = aten.t(t_1)
return (mm, primals_3, relu, t_4)""",
        )
        self.assertExpectedInline(
            render(bw),
            """\
def forward(self, primals_3: "f32[3, 8]", relu: "f32[3, 16]", t_4: "f32[4, 16]", tangents_1: "f32[3, 4]"):
t_2: "f32[4, 3]" = aten.t(tangents_1)
mm_1: "f32[4, 16]" = aten.mm(t_2, relu)
t_3: "f32[16, 4]" = aten.t(mm_1)
mm_2: "f32[3, 16]" = aten.mm(tangents_1, t_4);  tangents_1 = t_4 = None
t_5: "f32[4, 16]" = aten.t(t_3)
div: "f32[4, 16]" = aten.div.Tensor(t_5, 2)
reduce_scatter_tensor: "f32[2, 16]" = _c10d_functional.reduce_scatter_tensor(div, 'sum', 2, '0')
wait_tensor_3: "f32[2, 16]" = _c10d_functional.wait_tensor(reduce_scatter_tensor)
detach: "f32[3, 16]" = aten.detach(relu)
detach_1: "f32[3, 16]" = aten.detach(detach)
threshold_backward: "f32[3, 16]" = aten.threshold_backward(mm_2, detach_1, 0);  mm_2 = detach_1 = None
t_6: "f32[16, 3]" = aten.t(threshold_backward)
mm_3: "f32[16, 8]" = aten.mm(t_6, primals_3);  t_6 = primals_3 = None
t_7: "f32[8, 16]" = aten.t(mm_3)
sum_1: "f32[1, 16]" = aten.sum.dim_IntList(threshold_backward, [0], True)
view: "f32[16]" = aten.view(sum_1, [16])
t_8: "f32[16, 8]" = aten.t(t_7)
div_1: "f32[16]" = aten.div.Tensor(view, 2)
reduce_scatter_tensor_1: "f32[8]" = _c10d_functional.reduce_scatter_tensor(div_1, 'sum', 2, '0')
wait_tensor_4: "f32[8]" = _c10d_functional.wait_tensor(reduce_scatter_tensor_1)
div_2: "f32[16, 8]" = aten.div.Tensor(t_8, 2)
reduce_scatter_tensor_2: "f32[8, 8]" = _c10d_functional.reduce_scatter_tensor(div_2, 'sum', 2, '0')
wait_tensor_5: "f32[8, 8]" = _c10d_functional.wait_tensor(reduce_scatter_tensor_2)
return (wait_tensor_5, wait_tensor_4, None, wait_tensor_3)""",
        )

    @same_torch
    def test_snapshot_bf16_params_fp32_reduce(self):
        fw, bw = self.compile_two_layer(
            mp_policy=fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            comm_policy=REGATHER,
        )
        self.assertExpectedInline(
            render(fw),
            """\
def forward(self, primals_1: "f32[8, 8]", primals_2: "f32[8]", primals_3: "bf16[3, 8]", primals_4: "f32[2, 16]"):
_to_copy: "bf16[8, 8]" = aten._to_copy(primals_1, dtype = torch.bfloat16)
all_gather_into_tensor: "bf16[16, 8]" = _c10d_functional.all_gather_into_tensor(_to_copy, 2, '0')
wait_tensor: "bf16[16, 8]" = _c10d_functional.wait_tensor(all_gather_into_tensor)
_to_copy_1: "bf16[8]" = aten._to_copy(primals_2, dtype = torch.bfloat16)
all_gather_into_tensor_1: "bf16[16]" = _c10d_functional.all_gather_into_tensor(_to_copy_1, 2, '0')
wait_tensor_1: "bf16[16]" = _c10d_functional.wait_tensor(all_gather_into_tensor_1)
t: "bf16[8, 16]" = aten.t(wait_tensor)
addmm: "bf16[3, 16]" = aten.addmm(wait_tensor_1, primals_3, t);  wait_tensor_1 = t = None
relu: "bf16[3, 16]" = aten.relu(addmm)
_to_copy_2: "bf16[2, 16]" = aten._to_copy(primals_4, dtype = torch.bfloat16)
all_gather_into_tensor_2: "bf16[4, 16]" = _c10d_functional.all_gather_into_tensor(_to_copy_2, 2, '0')
wait_tensor_2: "bf16[4, 16]" = _c10d_functional.wait_tensor(all_gather_into_tensor_2)
t_1: "bf16[16, 4]" = aten.t(wait_tensor_2)
mm: "bf16[3, 4]" = aten.mm(relu, t_1)
return (mm, primals_1, primals_2, primals_3, primals_4, relu)""",
        )
        self.assertExpectedInline(
            render(bw),
            """\
def forward(self, primals_1: "f32[8, 8]", primals_2: "f32[8]", primals_3: "bf16[3, 8]", primals_4: "f32[2, 16]", relu: "bf16[3, 16]", tangents_1: "bf16[3, 4]"):
t_2: "bf16[4, 3]" = aten.t(tangents_1)
mm_1: "bf16[4, 16]" = aten.mm(t_2, relu)
t_3: "bf16[16, 4]" = aten.t(mm_1)
_to_copy_2: "bf16[2, 16]" = aten._to_copy(primals_4, dtype = torch.bfloat16)
all_gather_into_tensor_2: "bf16[4, 16]" = _c10d_functional.all_gather_into_tensor(_to_copy_2, 2, '0')
wait_tensor_2: "bf16[4, 16]" = _c10d_functional.wait_tensor(all_gather_into_tensor_2)
t_1: "bf16[16, 4]" = aten.t(wait_tensor_2)
t_4: "bf16[4, 16]" = aten.t(t_1)
mm_2: "bf16[3, 16]" = aten.mm(tangents_1, t_4);  tangents_1 = t_4 = None
t_5: "bf16[4, 16]" = aten.t(t_3)
_to_copy_3: "f32[4, 16]" = aten._to_copy(t_5, dtype = torch.float32)
div: "f32[4, 16]" = aten.div.Tensor(_to_copy_3, 2)
reduce_scatter_tensor: "f32[2, 16]" = _c10d_functional.reduce_scatter_tensor(div, 'sum', 2, '0')
wait_tensor_3: "f32[2, 16]" = _c10d_functional.wait_tensor(reduce_scatter_tensor)
detach_6: "bf16[3, 16]" = aten.detach(relu)
detach_10: "bf16[3, 16]" = aten.detach(detach_6)
threshold_backward: "bf16[3, 16]" = aten.threshold_backward(mm_2, detach_10, 0);  mm_2 = detach_10 = None
t_6: "bf16[16, 3]" = aten.t(threshold_backward)
mm_3: "bf16[16, 8]" = aten.mm(t_6, primals_3);  t_6 = primals_3 = None
t_7: "bf16[8, 16]" = aten.t(mm_3)
sum_1: "bf16[1, 16]" = aten.sum.dim_IntList(threshold_backward, [0], True)
view: "bf16[16]" = aten.view(sum_1, [16])
t_8: "bf16[16, 8]" = aten.t(t_7)
_to_copy_4: "f32[16]" = aten._to_copy(view, dtype = torch.float32)
div_1: "f32[16]" = aten.div.Tensor(_to_copy_4, 2)
reduce_scatter_tensor_1: "f32[8]" = _c10d_functional.reduce_scatter_tensor(div_1, 'sum', 2, '0')
wait_tensor_4: "f32[8]" = _c10d_functional.wait_tensor(reduce_scatter_tensor_1)
_to_copy_5: "f32[16, 8]" = aten._to_copy(t_8, dtype = torch.float32)
div_2: "f32[16, 8]" = aten.div.Tensor(_to_copy_5, 2)
reduce_scatter_tensor_2: "f32[8, 8]" = _c10d_functional.reduce_scatter_tensor(div_2, 'sum', 2, '0')
wait_tensor_5: "f32[8, 8]" = _c10d_functional.wait_tensor(reduce_scatter_tensor_2)
return (wait_tensor_5, wait_tensor_4, None, wait_tensor_3)""",
        )


if __name__ == "__main__":
    unittest.main()
