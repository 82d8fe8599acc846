"""The parity cases the numerics tests share: ``Case`` (a model, an optimizer, a compile
backend and ``parallelize`` options), ``run_cases`` (trains a list of cases in one rank's
process; the ranks' processes import it) over ``train_each`` (any list of training runs, also
tests/e2e/test_hf_llama.py's), the bf16 mixed-precision options, and the fp32 and bf16
tolerances the cases are held to (why these: tests/e2e/test_numerics.py's docstring).
test_numerics runs its cases on gloo ranks, tests/runtime/test_param_states.py adds ZeRO stages 1
and 2, and tests/e2e/test_gpu.py runs them under NCCL."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

import fczero
from fczero.testing import parity
from fczero.testing.backends import BACKENDS
from tests.models.moe import loop_moe, moe_batches, packed_moe
from tests.models import (
    GraphBreakMLP,
    ThreeBlocks,
    UnevenTiedMLP,
    block_batches,
    frozen_gqa,
    mlp_batches,
    tiny_gqa,
    tiny_llama,
    token_batches,
)

FP32 = {"rtol": 1e-5, "atol": 1e-6}
#: bf16 compute, fp32 reduction: the mixed precision every bf16 case runs
BF16_MP = fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
#: stage 3 as FSDP2 runs it: every gathered param freed after forward and gathered again in
#: backward. The default keeps one shard's worth (the last blocks, all of a one-rank model);
#: the tests of the regather itself turn that off.
REGATHER = fczero.CommPolicy(keep_unsharded=0)
BF16_OPTS = (("mp_policy", BF16_MP),)
BF16 = {"rtol": 2e-2, "atol": 2e-2}
#: units off ([Note: units]): each read gathers on its own, as before units were the default
NO_UNITS = (("units", None),)
#: Tokens of the "gqa-vocab" case: at 2 ranks its 64 ids a rank and their rows are well under
#: a quarter of the tied table's bytes, so its grad is reduced as touched rows.
WIDE_VOCAB = 1024



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
    model: str  # "mlp", "llama", "blocks", "breaks" (graph breaks in forward), "moe-loop" or
    # "moe-packed" (experts idle on one rank: tests/models/moe.py; safe with units only),
    # "gqa-full" or "gqa-selective" (grouped-query, tied, every block checkpointed),
    # "gqa-frozen" (gqa-full with some params of every block frozen), "gqa-vocab" (gqa-full
    # with WIDE_VOCAB tokens: its embedding's grad is reduced as touched rows)
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
        if self.model == "moe-loop":
            return loop_moe, moe_batches(), parity.cross_entropy
        if self.model == "moe-packed":
            return packed_moe, moe_batches(), parity.cross_entropy
        if self.model == "gqa-vocab":  # a vocabulary wide enough for touched-row reduces
            build = functools.partial(tiny_gqa, "full", vocab=WIDE_VOCAB)
            return build, token_batches(vocab=WIDE_VOCAB), parity.cross_entropy
        if self.model == "gqa-frozen":  # checkpointed blocks with some params frozen
            return frozen_gqa, token_batches(), parity.cross_entropy
        if self.model.startswith("gqa-"):  # gqa-full, gqa-selective: checkpointed blocks
            build = functools.partial(tiny_gqa, self.model.removeprefix("gqa-"))
            return build, token_batches(), parity.cross_entropy
        return tiny_llama, token_batches(), parity.cross_entropy

    @property
    def lr(self) -> float:
        return 1e-3 if self.optimizer == "adamw" else 0.05


def run_cases(
    rank: int, world_size: int, cases: list[Case], device_type: str = "cpu"
) -> list[parity.Trace]:
    """Train every case in this rank's process (tests on GPUs call it too)."""
    runs = []
    for case in cases:
        build, batches, criterion = case.setup()
        options = dict(case.options)
        runs.append((build, batches, criterion, case.optimizer, case.lr, case.backend, options))
    return train_each(rank, world_size, runs, device_type)


#: A case backend ``blocks:<backend>``: after ``parallelize`` each block is compiled on its
#: own by ``fczero.compile_blocks(model, backend=...)``, the rest eager ([Note: blocks
#: compiled alone] in fczero/runtime/units.py).
BLOCKS = "blocks:"


def tiny_llama_with_inductor(rank: int, world_size: int, **options) -> parity.Trace:
    """The fp32 tiny Llama, 3 steps, compiled whole by stock Inductor (one rank's run;
    ``options`` go to ``fczero.parallelize``)."""
    return parity.train_parallel(
        rank, world_size, tiny_llama, token_batches(steps=3), parity.cross_entropy,
        compile_backend="inductor", **options,
    )  # fmt: skip


def compile_blocks(model: nn.Module, backend: str) -> None:
    fczero.compile_blocks(model, backend=BACKENDS.get(backend, backend))


def train_each(
    rank: int, world_size: int, runs: list[tuple], device_type: str
) -> list[parity.Trace]:
    """Train each run, ``(build, batches, criterion, optimizer, lr, compile backend,
    parallelize options)``, in this rank's process, with Dynamo reset before each."""
    traces = []
    for build, batches, criterion, optimizer, lr, backend, options in runs:
        torch._dynamo.reset()
        finish = None
        if backend is not None and backend.startswith(BLOCKS):
            finish = functools.partial(compile_blocks, backend=backend.removeprefix(BLOCKS))
            backend = None
        traces.append(
            parity.train_parallel(
                rank,
                world_size,
                build,
                batches,
                criterion,
                optimizer=optimizer,
                lr=lr,
                compile_backend=backend,
                device_type=device_type,
                finish=finish,
                **options,
            )
        )
    return traces
