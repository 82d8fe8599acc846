"""Training parity on real gloo ranks against a single-process reference.

Tolerances: fp32 runs must match to rtol 1e-5 / atol 1e-6 per step loss and per final
param element (only the order of floating-point sums differs). bf16 compute with fp32
reduction is compared with the fp32 reference at rtol 2e-2 / atol 2e-2: bf16 keeps 8
bits of mantissa, so 5 steps drift by up to about 1e-2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

import fczero
from fczero.testing import parity
from fczero.testing.distributed import run_on_ranks
from tests.models import (
    GraphBreakMLP,
    ThreeBlocks,
    UnevenTiedMLP,
    block_batches,
    mlp_batches,
    tiny_llama,
    token_batches,
)

FP32 = {"rtol": 1e-5, "atol": 1e-6}
#: bf16 compute, fp32 reduction: the mixed precision every bf16 case runs
BF16_MP = fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BF16_OPTS = (("mp_policy", BF16_MP),)
BF16 = {"rtol": 2e-2, "atol": 2e-2}



def _short(value: object) -> str:
    """A test id's spelling of an option: a policy shows only the fields it sets."""
    if not dataclasses.is_dataclass(value):
        return str(value)
    changed = [
        f"{f.name}={getattr(value, f.name)}"
        for f in dataclasses.fields(value)
        if getattr(value, f.name) != f.default
    ]
    return f"{type(value).__name__}({','.join(changed)})"

@dataclass(frozen=True)
class Case:
    model: str  # "mlp", "llama", "blocks" or "breaks" (graph breaks in forward)
    optimizer: str = "sgd"
    backend: str | None = None  # None: eager; else a torch.compile backend
    options: tuple[tuple[str, object], ...] = ()

    @property
    def id(self) -> str:
        opts = ",".join(f"{k}={_short(v)}" for k, v in self.options)
        return f"{self.model}-{self.optimizer}-{self.backend or 'eager'}" + (
            f"-{opts}" if opts else ""
        )

    def setup(self):
        if self.model == "mlp":
            return UnevenTiedMLP, mlp_batches(), parity.mse
        if self.model == "breaks":
            return GraphBreakMLP, mlp_batches(), parity.mse
        if self.model == "blocks":
            return ThreeBlocks, block_batches(), parity.mse
        return tiny_llama, token_batches(), parity.cross_entropy

    @property
    def lr(self) -> float:
        return 1e-3 if self.optimizer == "adamw" else 0.05


CASES = {
    2: [
        Case("mlp"),
        Case("mlp", "adamw"),
        Case("llama"),
        Case("llama", "adamw"),
        Case("llama", options=(("reshard_after_forward", False),)),
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


def run_cases(
    rank: int, world_size: int, cases: list[Case], device_type: str = "cpu"
) -> list[parity.Trace]:
    """Train every case in this rank's process (tests on GPUs call it too)."""
    traces = []
    for case in cases:
        build, batches, criterion = case.setup()
        torch._dynamo.reset()
        traces.append(
            parity.train_parallel(
                rank,
                world_size,
                build,
                batches,
                criterion,
                optimizer=case.optimizer,
                lr=case.lr,
                compile_backend=case.backend,
                device_type=device_type,
                **dict(case.options),
            )
        )
    return traces


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


def _fp32_llama_with_inductor(rank: int, world_size: int) -> parity.Trace:
    return parity.train_parallel(
        rank,
        world_size,
        tiny_llama,
        token_batches(steps=3),
        parity.cross_entropy,
        compile_backend="inductor",
    )


@pytest.mark.slow
def test_inductor_matches_reference():
    """The real stock-Inductor path (C++ codegen on CPU), end to end on 2 gloo ranks."""
    actual = run_on_ranks(_fp32_llama_with_inductor, 2)[0]
    expected = parity.train_reference(tiny_llama, token_batches(steps=3), parity.cross_entropy)
    parity.assert_close(actual, expected, **FP32)
