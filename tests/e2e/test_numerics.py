"""Training parity on real gloo ranks against a single-process reference.

Tolerances: fp32 runs must match to rtol 1e-5 / atol 1e-6 per step loss and per final
param element (only the order of floating-point sums differs). bf16 compute with fp32
reduction is compared with the fp32 reference at rtol 2e-2 / atol 2e-2: bf16 keeps 8
bits of mantissa, so 5 steps drift by up to about 1e-2.
"""

from __future__ import annotations

import pytest

from fczero.testing import parity
from fczero.testing.distributed import run_on_ranks
from tests.cases import (
    BF16, BF16_MP, BF16_OPTS, FP32, REGATHER, Case, run_cases, tiny_llama_with_inductor,
)
from tests.models import tiny_llama, token_batches

CASES = {
    2: [
        Case("mlp"),
        Case("mlp", "adamw"),
        Case("llama"),
        Case("llama", "adamw"),
        Case("llama", options=(("reshard_after_forward", False),)),
        # every gathered param freed after forward (the default keeps the last half)
        Case("llama", "adamw", options=(("comm_policy", REGATHER),)),
        Case("mlp", backend="aot_eager"),
        Case("llama", backend="aot_eager"),
        Case("llama", "adamw", backend="aot_eager"),
        Case("mlp", backend="aot_eager", options=(("reshard_after_forward", False),)),
        Case("llama", options=BF16_OPTS),
        Case("breaks", backend="aot_eager"),
        # fczero's passes (bucketing, late waits, prefetch) on AOT's graphs, run eagerly
        Case("mlp", backend="aot_eager_with_passes"),
        Case("llama", "adamw", backend="aot_eager_with_passes"),
        Case("blocks", backend="aot_eager_with_passes"),
        Case(
            "llama",
            backend="aot_eager_with_passes",
            options=BF16_OPTS,
        ),
        Case("llama", backend="aot_eager_with_passes", options=(("comm_policy", REGATHER),)),
        # each block compiled on its own, the gathers eager around it (blocks: in tests/cases.py)
        Case("llama", "adamw", backend="blocks:aot_eager"),
        Case("llama", backend="blocks:aot_eager", options=(("comm_policy", REGATHER),)),
        Case("gqa-full", "adamw", backend="blocks:aot_eager"),
        Case("moe-loop", "adamw", backend="blocks:aot_eager"),
        Case("llama", "adamw", backend="blocks:aot_eager", options=(("stage", 2),)),
        Case("llama", backend="blocks:aot_eager", options=(("reshard_after_forward", False),)),
        # frozen params among trainable ones in checkpointed blocks, every way of running
        Case("gqa-frozen", "adamw"),
        Case("gqa-frozen", "adamw", backend="aot_eager"),
        Case("gqa-frozen", "adamw", backend="blocks:aot_eager"),
    ],
    4: [
        Case("mlp"),
        Case("llama", "adamw"),
        Case("mlp", backend="aot_eager"),
        Case("llama", backend="aot_eager"),
        Case("mlp", backend="aot_eager_with_passes"),
        Case("blocks", backend="aot_eager_with_passes"),
    ],
}


@pytest.fixture(scope="module")
def parallel_traces() -> dict[int, dict[str, parity.Trace]]:
    """Every case of a world size runs in one set of processes (process start-up is slow)."""
    out = {}
    for world_size, cases in CASES.items():
        per_rank = run_on_ranks(run_cases, world_size, cases)
        for rank_traces in per_rank[1:]:  # every rank saw the same averaged losses
            for a, b in zip(rank_traces, per_rank[0]):
                assert a.losses == b.losses
        out[world_size] = {c.id: t for c, t in zip(cases, per_rank[0])}
    return out


def _reference(case: Case) -> parity.Trace:
    build, batches, criterion = case.setup()
    return parity.train_reference(build, batches, criterion, optimizer=case.optimizer, lr=case.lr)


@pytest.mark.parametrize(
    ("world_size", "case"),
    [(ws, c) for ws, cases in CASES.items() for c in cases],
    ids=lambda v: v.id if isinstance(v, Case) else f"ws{v}",
)
def test_matches_single_process_reference(parallel_traces, world_size, case):
    actual = parallel_traces[world_size][case.id]
    expected = _reference(case)
    tol = BF16 if dict(case.options).get("mp_policy") == BF16_MP else FP32
    parity.assert_close(actual, expected, **tol)


@pytest.mark.slow
def test_inductor_matches_reference():
    """The real stock-Inductor path (C++ codegen on CPU), end to end on 2 gloo ranks."""
    actual = run_on_ranks(tiny_llama_with_inductor, 2)[0]
    expected = parity.train_reference(tiny_llama, token_batches(steps=3), parity.cross_entropy)
    parity.assert_close(actual, expected, **FP32)
