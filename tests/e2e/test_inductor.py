"""The real stock-Inductor path on CPU: collectives, and fczero's schedule, survive
into generated code.

Slow on 2 cores (C++ compiles), so only a few tests take this path; the rest of the
graph tests use ``aot_eager``, which hands the backend the same partitioned graphs.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from torch.distributed.device_mesh import init_device_mesh

import fczero
from tests.cases import REGATHER
from tests.models import ThreeBlocks, TwoLayer

pytestmark = pytest.mark.slow


def _calls(code: str, op: str) -> int:
    """Calls of a functional collective in generated code (comments mention ops too)."""
    return code.count(f"torch.ops._c10d_functional.{op}.default(")


def _call_lines(code: str) -> list[str]:
    return [line.strip() for line in code.splitlines() if not line.strip().startswith("#")]


def test_inductor_code_gathers_in_forward_and_again_in_backward(fake_pg):
    model = fczero.parallelize(
        TwoLayer(),
        init_device_mesh("cpu", (2,)),
        mp_policy=fczero.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        ),
        comm_policy=REGATHER,
    )
    compiled = torch.compile(model, fullgraph=True)  # stock Inductor, no custom backend

    def step():
        compiled(torch.randn(3, 8)).sum().backward()

    _, codes = run_and_get_code(step)
    # the input cast compiles as its own small graph; then the forward, then the backward
    forward, backward = codes[-2:]
    # the three params are one bucket (the model is far below 1 MiB), gathered in place
    assert _calls(forward, "all_gather_into_tensor_out") == 1
    assert _calls(backward, "all_gather_into_tensor_out") == 1  # fc2.weight, gathered again
    assert _calls(forward + backward, "all_gather_into_tensor") == 0
    assert _calls(backward, "reduce_scatter_tensor") == 1
    assert all(isinstance(p.grad, torch.Tensor) for p in model.parameters())


def test_inductor_reduces_in_place_over_one_rank_with_the_plain_models_grads():
    """[Note: reducing in place at one rank] in generated code: a gloo group of one rank
    reduces each bucket with the in-place all-reduce, and the grads are the plain model's."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref = TwoLayer()
        model = fczero.parallelize(copy.deepcopy(ref), init_device_mesh("cpu", (1,)))
        compiled = torch.compile(model, fullgraph=True)
        x = torch.randn(3, 8)
        _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
        backward = codes[-1]
        assert _calls(backward, "all_reduce_") == 1
        assert _calls(backward, "reduce_scatter_tensor") == 0
        ref(x).sum().backward()
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_inductor_keeps_the_prefetch_order(fake_pg):
    user_pass_calls = []

    def user_pass(graph):
        user_pass_calls.append(len(graph.nodes))

    with inductor_config.patch(post_grad_custom_post_pass=user_pass):
        # 1.5 MiB: one 1 MiB block per bucket; the head, the last block, has its own
        model = fczero.parallelize(
            ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(bucket_bytes=3 << 19)
        )
        compiled = torch.compile(model, fullgraph=True)
        _, codes = run_and_get_code(lambda: compiled(torch.randn(4, 512)).sum().backward())
    assert len(user_pass_calls) == 2  # the user's pass still ran, on forward and backward
    forward = _call_lines(codes[-2])
    gathers = [i for i, line in enumerate(forward) if "all_gather_into_tensor_out.default(" in line]
    matmuls = [
        i for i, line in enumerate(forward) if re.search(r"extern_kernels\.(addmm|mm)\(", line)
    ]
    assert len(gathers) == 4 and len(matmuls) == 4  # a bucket per block
    # the gather for the next block is issued before the matmul of the block before it
    for gather, matmul in zip(gathers[1:], matmuls):
        assert gather < matmul, "\n".join(forward)
