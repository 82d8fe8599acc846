"""Tests of fczero/passes/, and what they share: the graphs of ``ThreeBlocks`` under the
fake process group, before any pass ran (``ThreeBlocksGraphs``), and pass settings.

Graphs come from AOT autograd (``aot_eager`` records them); the tests apply the passes
directly, as Inductor would after its own post-grad passes. Snapshots are recorded with
torch 2.13 (see tests/e2e/test_graphs.py).
"""

from __future__ import annotations

import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.passes import PassSettings
from tests.models import ThreeBlocks
from tests.snapshots import FakeGroupTestCase

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


class ThreeBlocksGraphs(FakeGroupTestCase):
    """A fake process group of 2 per test; ``graphs(**options)`` parallelizes ``ThreeBlocks``
    with ``options``, compiles it without fczero's passes and returns its forward and
    backward graphs. Every gathered param is freed after forward (``keep_unsharded=0``), so
    backward regathers and the passes have backward gathers to move."""

    def graphs(self, **options) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        torch.manual_seed(0)
        model = fczero.parallelize(
            ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(compile_passes=False, keep_unsharded=0), **options
        )
        backend = AotEagerAndRecordGraphs()
        torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 512)).sum().backward()
        return backend.fw_graphs[0], backend.bw_graphs[0]
