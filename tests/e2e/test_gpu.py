"""The parity tests under NCCL on two CUDA GPUs (one rank on a machine with one GPU, and
``FCZERO_GPU_RANKS`` ranks where it is set; skipped without CUDA).

The reference trains on ``cuda:0`` in this process. fp32 tolerance here is rtol 1e-4 /
atol 1e-5: cuBLAS picks its kernels by shape, and each rank multiplies half the
reference's batch, so sums are ordered differently than on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from fczero.testing import parity
from fczero.testing.distributed import gpu_world_size, run_on_ranks
from tests.cases import BF16, BF16_MP, BF16_OPTS, NO_UNITS, Case, run_cases

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
        options=BF16_OPTS,
    ),
    # CUDA graphs (torch.compile(mode="reduce-overhead")): collectives captured in the graphs
    Case("llama", "adamw", backend="inductor-cudagraphs"),
    Case(
        "llama",
        backend="inductor-cudagraphs",
        options=BF16_OPTS,
    ),
    Case("llama", backend="inductor-cudagraphs", options=(("stage", 2),)),
    Case("llama", backend="inductor-cudagraphs", options=(("stage", 1),)),
    # per read (units off), as before units were the default
    Case("llama", backend="inductor", options=NO_UNITS),
    Case("llama", "adamw", backend="inductor-cudagraphs", options=NO_UNITS),
    # experts idle on one rank only (tests/models/moe.py), eager and compiled
    Case("moe-loop", "adamw"),
    Case("moe-loop", "adamw", backend="inductor"),
    Case("moe-packed", "adamw"),
    Case("moe-packed", "adamw", backend="inductor"),
    # the realistic recipe, tiny: grouped-query attention, tied, each block checkpointed
    Case("gqa-full", "adamw"),
    Case("gqa-full", "adamw", backend="inductor"),
    Case("gqa-selective", "adamw", backend="inductor"),
    Case("gqa-full", backend="inductor", options=BF16_OPTS),
    Case("gqa-full", "adamw", backend="inductor-cudagraphs"),
    # the tied embedding's grad reduced as the rows the batch touched (all-gathers)
    Case("gqa-vocab", "adamw", backend="inductor"),
    Case("gqa-vocab", backend="inductor-cudagraphs", options=BF16_OPTS),
    # each block compiled on its own, the gathers eager around it (prefetched, bucketed)
    Case("gqa-full", "adamw", backend="blocks:inductor"),
    Case("moe-loop", "adamw", backend="blocks:inductor"),
    Case("llama", backend="blocks:inductor", options=BF16_OPTS),
]


def _cudagraph_skips(rank: int, world: int) -> tuple[int, list[str]]:
    """Train the Llama of the parity tests under CUDA graphs; Inductor's count of graphs it
    would not capture, and the messages it logged for them."""
    import logging

    from torch._dynamo.utils import counters

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "cudagraph" in record.getMessage().lower():
                messages.append(record.getMessage())

    handler = Keep()
    logging.getLogger("torch._inductor").addHandler(handler)
    counters.clear()
    run_cases(rank, world, [Case("llama", "adamw", backend="inductor-cudagraphs")], "cuda")
    logging.getLogger("torch._inductor").removeHandler(handler)
    return counters["inductor"]["cudagraph_skips"], messages


def test_cuda_graphs_skip_no_graph():
    skips, messages = run_on_ranks(_cudagraph_skips, GPU_RANKS, backend="nccl")[0]
    assert skips == 0, messages


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
    tol = BF16 if dict(case.options).get("mp_policy") == BF16_MP else GPU_FP32
    parity.assert_close(nccl_traces[case.id], expected, **tol)
