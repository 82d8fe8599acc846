"""The test backend (fczero/testing/backends.py): AOT autograd's graphs with fczero's
passes, run without code generation; ``recording(graphs)`` keeps them in the caller's list."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing import backends
from fczero.testing.graphs import collective_sequence
from tests.models import ThreeBlocks


def test_forward_and_backward_are_recorded_after_the_passes(fake_pg):
    graphs: list[torch.fx.GraphModule] = []
    model = fczero.parallelize(
        ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(bucket_bytes=3 << 19)
    )
    out = torch.compile(model, backend=backends.recording(graphs))(torch.randn(4, 512))
    out.sum().backward()
    forward, backward = graphs
    gathers = [c for c in collective_sequence(forward) if c.startswith("all_gather")]
    assert len(gathers) == 4  # bucketed by the passes: one per block, then the head
    assert any(c.startswith("reduce_scatter") for c in collective_sequence(backward))
    assert set(backends.BACKENDS) == {"aot_eager_with_passes", "inductor-cudagraphs"}
