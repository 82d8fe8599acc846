"""The real stock-Inductor path on CPU: collectives survive into generated code.

Slow on 2 cores (C++ compiles), so only a few tests take this path; the rest of the
graph tests use ``aot_eager``, which hands the backend the same partitioned graphs.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.distributed.device_mesh import init_device_mesh

import fczero
from tests.models import TwoLayer

pytestmark = pytest.mark.slow


def test_inductor_code_gathers_in_forward_and_again_in_backward(fake_pg):
    model = fczero.parallelize(
        TwoLayer(), init_device_mesh("cpu", (2,)), param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    compiled = torch.compile(model, fullgraph=True)  # stock Inductor, no custom backend

    def step():
        compiled(torch.randn(3, 8)).sum().backward()

    _, codes = run_and_get_code(step)
    # the input cast compiles as its own small graph; then the forward, then the backward
    forward, backward = codes[-2:]
    assert _calls(forward, "all_gather_into_tensor") == 3
    assert _calls(forward, "wait_tensor") == 3
    assert _calls(backward, "all_gather_into_tensor") == 1  # fc2.weight, gathered again
    assert _calls(backward, "reduce_scatter_tensor") == 3
    assert all(isinstance(p.grad, torch.Tensor) for p in model.parameters())


def _calls(code: str, op: str) -> int:
    """Calls of a functional collective in generated code (comments mention ops too)."""
    return code.count(f"torch.ops._c10d_functional.{op}.default(")
