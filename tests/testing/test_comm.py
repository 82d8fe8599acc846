"""``CollectiveLog`` (fczero/testing/comm.py): the collectives an eager region issues, in
order, and with ``matmuls=True`` the matmuls between them."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing.comm import CollectiveLog
from tests.models import TwoLayer


def test_an_eager_step_logs_its_gathers_then_its_reduces(fake_pg):
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)))
    with CollectiveLog() as log:
        model(torch.randn(2, 8)).sum().backward()
    assert log.ops[:3] == ["all_gather_into_tensor"] * 3  # fc1 weight and bias, fc2 weight
    assert log.count("reduce_scatter_tensor") == 3
    assert "wait_tensor" not in log.ops


def test_matmuls_are_logged_only_when_asked(fake_pg):
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)))
    with CollectiveLog(matmuls=True) as log:
        model(torch.randn(2, 8))
    assert log.count("addmm") == 1 and log.count("mm") == 1  # fc1 with its bias, fc2 without
    assert log.ops.index("addmm") > 0  # after the gathers that feed it
    with CollectiveLog() as plain:
        model(torch.randn(2, 8))
    assert "addmm" not in plain.ops and "mm" not in plain.ops
