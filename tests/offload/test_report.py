"""``memory_report`` (fczero/offload/report.py): what the planner decided for each compiled
graph pair, in words and as a plot, and clear errors for a model it cannot report on."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing import backends
from tests.models import ThreeBlocks, TwoLayer


def test_a_model_that_is_not_parallelized_is_refused():
    with pytest.raises(TypeError, match=r"memory_report needs an nn.Module, got str"):
        fczero.memory_report("model")
    with pytest.raises(ValueError, match=r"no sharded params; call fczero.parallelize"):
        fczero.memory_report(TwoLayer())


def test_before_any_compiled_step_the_report_says_so(fake_pg):
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)))
    text = str(fczero.memory_report(model))
    assert "no compiled graph recorded yet" in text
    assert "measured peak not measured (CPU)" in text


def test_a_compiled_step_reports_each_offloaded_activation(fake_pg, tmp_path):
    torch._dynamo.reset()
    model = fczero.parallelize(
        ThreeBlocks(64),
        init_device_mesh("cpu", (2,)),
        offload_policy=fczero.OffloadPolicy(activations="all", activation_min_bytes=0),
        comm_policy=fczero.CommPolicy(keep_unsharded=1 << 30),
    )
    with warnings.catch_warnings():  # (on the CPU the offload saves nothing, and says so)
        warnings.simplefilter("ignore", RuntimeWarning)
        torch.compile(model, backend=backends.aot_eager_with_passes)(torch.randn(8, 64)).sum().backward()
    report = fczero.memory_report(model, measured_peak=3 << 20)
    (plan,) = report.plans
    text = str(report)
    assert "graph pair 0: activations='all'" in text
    assert all(f"offloaded {name}" in text for name, _ in plan.offloaded) and plan.offloaded
    assert "selective unsharding: 4 blocks kept unsharded" in text
    assert text.endswith("vs measured peak 3.00 MiB (everything allocated)")
    path = report.plot(str(tmp_path / "plan.png"))
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG" and path.endswith("plan.png")
