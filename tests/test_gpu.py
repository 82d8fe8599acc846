"""The parity tests under NCCL on two CUDA GPUs (one rank on a machine with one GPU; skipped
without CUDA).

The reference trains on ``cuda:0`` in this process. fp32 tolerance here is rtol 1e-4 /
atol 1e-5: cuBLAS picks its kernels by shape, and each rank multiplies half the
reference's batch, so sums are ordered differently than on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from fczero.testing import parity
from fczero.testing.distributed import gpu_world_size, run_on_ranks
from tests.test_numerics import BF16, Case, run_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GPU_RANKS = gpu_world_size()

GPU_FP32 = {"rtol": 1e-4, "atol": 1e-5}

CASES = [
    Case("mlp"),
    Case("llama", "adamw"),
    Case("mlp", backend="inductor"),
    Case("llama", backend="inductor"),
    Case(
        "llama",
        backend="inductor",
        options=(("param_dtype", torch.bfloat16), ("reduce_dtype", torch.float32)),
    ),
]


@pytest.fixture(scope="module")
def nccl_traces() -> dict[str, parity.Trace]:
    per_rank = run_on_ranks(run_cases, GPU_RANKS, CASES, "cuda", backend="nccl")
    return {c.id: t for c, t in zip(CASES, per_rank[0])}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_nccl_matches_reference(nccl_traces, case):
    build, batches, criterion = case.setup()
    expected = parity.train_reference(
        build, batches, criterion, optimizer=case.optimizer, lr=case.lr, device="cuda"
    )
    tol = BF16 if dict(case.options).get("param_dtype") == torch.bfloat16 else GPU_FP32
    parity.assert_close(nccl_traces[case.id], expected, **tol)
