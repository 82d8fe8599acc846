"""What graph tests share: graph snapshots (expecttest) are recorded with one torch version
and asserted only there, since other versions name and order some nodes differently; and
each graph test runs in a fresh fake process group (``FakeGroupTestCase``)."""

from __future__ import annotations

import unittest

import expecttest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

SNAPSHOT_TORCH = "2.13"
same_torch = unittest.skipUnless(
    torch.__version__.startswith(SNAPSHOT_TORCH), f"snapshots recorded with torch {SNAPSHOT_TORCH}"
)


class FakeGroupTestCase(expecttest.TestCase):
    """Each test in a fake process group of 2 ranks (one process: graphs, never numerics),
    with Dynamo reset before and after."""

    def setUp(self) -> None:
        torch._dynamo.reset()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)

    def tearDown(self) -> None:
        dist.destroy_process_group()
        torch._dynamo.reset()
