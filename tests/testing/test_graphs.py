"""Graph rendering for snapshots (fczero/testing/graphs.py): one short line per node, the
collectives in program order, and the gathered params a forward saves for backward."""

from __future__ import annotations

import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing.graphs import collective_sequence, render, saved_unsharded
from tests.cases import REGATHER
from tests.models import TwoLayer


def _graphs(**options):
    torch.manual_seed(0)
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), **options)
    backend = AotEagerAndRecordGraphs()
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 8)).sum().backward()
    return backend.fw_graphs[0], backend.bw_graphs[0]


def test_render_keeps_one_plain_line_per_node(fake_pg):
    fw, _ = _graphs()
    text = render(fw)
    assert text.splitlines()[0].startswith("def forward(self, ")
    assert "torch.ops." not in text and ".default" not in text and "#" not in text
    assert "_c10d_functional.all_gather_into_tensor(" in text


def test_collectives_come_in_program_order_with_their_shapes(fake_pg):
    fw, bw = _graphs()
    forward = collective_sequence(fw)
    assert forward[0].startswith("all_gather_into_tensor[") and forward[1].startswith("wait_tensor[")
    assert sum(c.startswith("all_gather_into_tensor") for c in forward) == 3  # fc1 weight and bias, fc2 weight
    assert any(c.startswith("reduce_scatter_tensor") for c in collective_sequence(bw))


def test_saved_unsharded_params_show_whether_forward_keeps_them(fake_pg):
    fw, _ = _graphs(comm_policy=REGATHER)
    assert saved_unsharded(fw) == []  # stage 3: regathered in backward, nothing saved
    torch._dynamo.reset()
    fw, _ = _graphs(reshard_after_forward=False)
    assert saved_unsharded(fw)  # the gathered weights live on until backward
