"""Graphs whose sizes are symbols still train like one process through fczero's passes: a
rewrite that would write a size the graph does not bind is left out ([Note: the passes
leave symbolic sizes alone] in ``fczero/passes/graph_utils.py``). Before that, both cases
below raised ``NameError: name 's..' is not defined`` at the first call of the graph."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.passes.graph_utils import static_sizes
from fczero.testing import parity
from fczero.testing.distributed import run_on_ranks
from tests.cases import WIDE_VOCAB
from tests.models import tiny_gqa, token_batches

FP32 = {"rtol": 1e-4, "atol": 1e-5}


class GruLM(nn.Module):
    """A GRU between an embedding and a head: Dynamo runs ``nn.GRU`` outside its graph, so
    the gather of its unit is a frame of its own, compiled again with symbolic sizes once
    it has seen params of two shapes. With an odd vocabulary the tables are padded at 2
    ranks: the backward of a gather's slice reads the gathered size, which the partitioner
    took from an all-gather issued again and never waited ([Note: a gather read for its
    size] in ``fczero/passes/size_only_gathers.py``; ``run_on_ranks`` fails a rank that
    leaves one unwaited)."""

    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.gru = nn.GRU(32, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(tokens))[0])


def _two_lengths() -> list:
    """Two steps at 16 tokens, then two at 12: Dynamo compiles the second length with the
    sequence as a symbol (the tied table's lookup and its grad then have symbolic ids)."""
    return token_batches(steps=2, vocab=WIDE_VOCAB) + token_batches(
        steps=2, seq=12, vocab=WIDE_VOCAB
    )


CASES = {
    "gru": (GruLM, functools.partial(token_batches, steps=3, batch=4, seq=8)),
    "gru-padded": (
        functools.partial(GruLM, 1021),
        functools.partial(token_batches, steps=3, batch=4, seq=8, vocab=1021),
    ),
    "two-lengths": (functools.partial(tiny_gqa, "full", vocab=WIDE_VOCAB), _two_lengths),
}


def _train(rank: int, world: int) -> dict[str, parity.Trace]:
    out = {}
    for name, (build, batches) in CASES.items():
        torch._dynamo.reset()
        out[name] = parity.train_parallel(
            rank, world, build, batches(), parity.cross_entropy,
            compile_backend="aot_eager_with_passes",
        )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def traces():
    return run_on_ranks(_train, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_symbolic_sizes_train_like_one_process(traces, name):
    build, batches = CASES[name]
    expected = parity.train_reference(build, batches(), parity.cross_entropy)
    for per_rank in traces:
        parity.assert_close(per_rank[name], expected, **FP32)


def test_static_sizes_tells_symbols_from_ints(fake_pg):
    """The check itself, on the graph of a frame compiled with a dynamic batch size."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    model = fczero.parallelize(nn.Linear(4, 4), init_device_mesh("cpu", (fake_pg,)))
    torch.compile(model, backend=record, dynamic=True)(torch.randn(3, 4))
    (gm,) = graphs
    values = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
    sized = [n for n in values.values() if isinstance(n.meta.get("example_value"), torch.Tensor)]
    assert sized
    for node in sized:  # Dynamo's graph keeps values as ``example_value``
        node.meta["val"] = node.meta["example_value"]
    symbolic = [n for n in sized if not all(type(s) is int for s in n.meta["val"].shape)]
    static = [n for n in sized if n not in symbolic]
    assert symbolic and static  # the batch's output is symbolic; the gathered weight is not
    assert not static_sizes(*symbolic) and static_sizes(*static)
    assert not static_sizes(None) and not static_sizes(symbolic[0], static[0])
