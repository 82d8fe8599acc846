"""An embedding's touched rows (fczero/passes/touched_rows.py): its lookup reads the shards
(an all-gather of the ids, a reduce-scatter of the rows found) instead of waiting for the
whole table, and its grad's reduce-scatter becomes two all-gathers, where they move fewer
bytes; training matches one process on the whole batch; both of torch's decompositions of
the embedding's backward (2.13's masked accumulate, 2.11's ``masked_fill`` and index_put)
are matched."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn as nn
from torch._decomp.decompositions import embedding_dense_backward
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.comm.graph_ops import op_name
from fczero.passes.matching import NOT_A_PARAM_COLLECTIVE, find_gathers
from fczero.testing import parity
from fczero.testing.backends import recording
from fczero.testing.distributed import run_on_ranks
from fczero.testing.graphs import collective_sequence
from tests.models import token_batches
from tests.snapshots import FakeGroupTestCase

aten = torch.ops.aten

VOCAB, DIM, PAD = 509, 16, 3  # an odd vocabulary: the table is padded to 510 rows at 2 ranks


class TiedTokens(nn.Module):
    """An embedding (with a padding id), one block, and a head tied to the embedding."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM, padding_idx=PAD)
        self.block = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(self.embed(tokens))))


def backward_as_torch_2_11(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    """torch 2.11's decomposition of ``embedding_dense_backward``: the padding id's rows
    zeroed with ``masked_fill``, then an unmasked index_put with accumulation."""
    grad = grad_output.float()
    mask = (indices == padding_idx).unsqueeze(-1)
    grad = grad.masked_fill(mask, 0)
    table = grad.new_zeros((num_weights, grad.shape[-1]))
    return aten._unsafe_index_put(table, [indices], grad, accumulate=True).to(grad_output.dtype)


DECOMPOSITIONS = {
    "installed": embedding_dense_backward,
    "2.11": backward_as_torch_2_11,
}


def _backend(decomposition: str, graphs: list | None = None):
    """fczero's passes, run eagerly, after the embedding's backward is lowered as Inductor
    lowers it (AOT autograd alone keeps ``embedding_dense_backward`` whole)."""
    decompositions = {aten.embedding_dense_backward.default: DECOMPOSITIONS[decomposition]}
    return recording(graphs, decompositions=decompositions)


def _pass_collectives(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.meta.get(NOT_A_PARAM_COLLECTIVE)]


class TouchedRowsGraphTest(FakeGroupTestCase):
    def graphs(self, vocab: int = VOCAB, decomposition: str = "installed", **options):
        """The forward and backward graphs after fczero's passes."""
        torch.manual_seed(0)
        model = fczero.parallelize(TiedTokens(vocab), init_device_mesh("cpu", (2,)), **options)
        graphs: list[torch.fx.GraphModule] = []
        tokens = torch.randint(0, vocab, (2, 8))
        torch.compile(model, backend=_backend(decomposition, graphs), fullgraph=True)(
            tokens
        ).sum().backward()
        return graphs

    def backward(self, vocab: int = VOCAB, decomposition: str = "installed", **options):
        return self.graphs(vocab, decomposition, **options)[-1]

    def test_the_lookup_reads_the_shards_and_the_table_is_gathered_for_the_head(self):
        fw = self.graphs()[0]
        self.assertEqual(
            collective_sequence(fw),
            [
                "all_gather_into_tensor[32]",  # every rank's 16 ids
                "wait_tensor[32]",
                "reduce_scatter_tensor[16, 16]",  # the rows each rank found, summed: mine
                "wait_tensor[16, 16]",
                "all_gather_into_tensor_out[8432]",  # the params (the tied table for the head)
                "wait_tensor[8432]",
            ],
        )
        ops = [op_name(n) for n in fw.graph.nodes]
        self.assertEqual(ops.count("embedding"), 1)
        lookup = next(n for n in fw.graph.nodes if op_name(n) == "embedding")
        self.assertEqual(lookup.args[0].op, "placeholder")  # the shard itself, [255, 16]
        self.assertEqual(tuple(lookup.args[0].meta["val"].shape), (255, 16))

    def test_an_untied_table_is_not_gathered_in_forward(self):
        class Untied(TiedTokens):
            def __init__(self) -> None:
                super().__init__()
                self.head.weight = nn.Parameter(torch.randn(VOCAB, DIM))

        torch.manual_seed(0)
        model = fczero.parallelize(Untied(), init_device_mesh("cpu", (2,)))
        graphs: list[torch.fx.GraphModule] = []
        torch.compile(model, backend=_backend("installed", graphs), fullgraph=True)(
            torch.randint(0, VOCAB, (2, 8))
        ).sum().backward()
        gathered = [tuple(n.meta["val"].shape) for n in graphs[0].graph.nodes
                    if op_name(n).startswith("all_gather")]  # fmt: skip
        self.assertNotIn((510, 16), gathered)  # the embedding's table: only the head's is
        self.assertEqual(len(_pass_collectives(graphs[0])), 2)

    def test_the_table_is_not_reduced_but_its_ids_and_rows_gathered(self):
        for decomposition in DECOMPOSITIONS:
            with self.subTest(decomposition):
                bw = self.backward(decomposition=decomposition)
                self.assertEqual(
                    collective_sequence(bw),
                    [
                        "all_gather_into_tensor_out[8416]",  # every param, gathered again
                        "wait_tensor[8416]",
                        "reduce_scatter_tensor[4216]",  # the head's grad and the block's
                        "all_gather_into_tensor[32]",  # every rank's 16 ids
                        "wait_tensor[32]",
                        "all_gather_into_tensor[32, 16]",  # and their rows
                        "wait_tensor[32, 16]",
                        "wait_tensor[4216]",
                    ],
                )
                ids, rows = _pass_collectives(bw)
                self.assertEqual(ids.meta["val"].dtype, torch.int64)
                gathers = {g.node for g in find_gathers(bw.graph, {"0"})}
                self.assertFalse(gathers & {ids, rows})  # never taken for a param's gather

    def test_bf16_rows_travel_before_their_cast_up(self):
        mp = fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        bw = self.backward(mp_policy=mp)
        ids, rows = _pass_collectives(bw)
        self.assertEqual(rows.meta["val"].dtype, torch.bfloat16)
        shard = [n for n in bw.graph.nodes if op_name(n) == "_unsafe_masked_index_put_accumulate"]
        self.assertEqual(len(shard), 1)
        self.assertEqual(tuple(shard[0].meta["val"].shape), (255, 16))
        self.assertEqual(shard[0].meta["val"].dtype, torch.float32)  # summed in fp32

    def test_the_policy_can_keep_every_reduce_whole(self):
        bw = self.backward(comm_policy=fczero.CommPolicy(sparse_embedding_grads=False))
        self.assertEqual(_pass_collectives(bw), [])
        reduces = [c for c in collective_sequence(bw) if c.startswith("reduce_scatter")]
        self.assertEqual(reduces[-1], "reduce_scatter_tensor[255, 16]")  # the embedding's

    def test_a_table_cheaper_than_its_rows_is_reduced_whole(self):
        """16 ids of 16 + 2 int64 words each against 61 x 16 fp32 rows: the table stays."""
        bw = self.backward(vocab=61)
        self.assertEqual(_pass_collectives(bw), [])
        reduces = [c for c in collective_sequence(bw) if c.startswith("reduce_scatter")]
        self.assertEqual(reduces[-1], "reduce_scatter_tensor[31, 16]")  # the embedding's


@pytest.mark.parametrize("decomposition", list(DECOMPOSITIONS))
def test_touched_rows_train_as_one_process(decomposition):
    """Two gloo ranks, the padding id in the batches, the padded table: the same losses and
    params as one process on the whole batch."""
    batches = token_batches(steps=3, batch=4, seq=8, vocab=VOCAB)
    batches = [(x.masked_fill(x % 7 == 0, PAD), y) for x, y in batches]  # padding ids too
    expected = parity.train_reference(TiedTokens, batches, parity.cross_entropy)
    runs = run_on_ranks(functools.partial(_train_batches, batches=batches), 2, decomposition)
    for trace, rewritten in runs:
        assert rewritten == [2, 2]  # forward: ids and found rows; backward: ids and grad rows
        parity.assert_close(trace, expected, rtol=1e-5, atol=1e-6)


def _train_batches(
    rank: int, world_size: int, decomposition: str, batches
) -> tuple[parity.Trace, list[int]]:
    graphs: list[torch.fx.GraphModule] = []
    trace = parity.train_parallel(
        rank, world_size, TiedTokens, batches, parity.cross_entropy,
        compile_backend=_backend(decomposition, graphs),
    )  # fmt: skip
    return trace, [len(_pass_collectives(gm)) for gm in graphs]


def _train_with_inductor(rank: int, world_size: int, batches) -> tuple[parity.Trace, list[str]]:
    """Stock Inductor: its own decompositions and post-grad passes, then fczero's."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("fczero")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:  # (caches off: a graph taken from them runs no pass, and logs nothing)
        with torch._inductor.config.patch(force_disable_caches=True):
            trace = parity.train_parallel(
                rank, world_size, TiedTokens, batches, parity.cross_entropy,
                compile_backend="inductor",
            )  # fmt: skip
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return trace, [line for line in lines if "touched_rows_pass" in line]


@pytest.mark.slow
def test_touched_rows_under_inductor_train_as_one_process():
    batches = token_batches(steps=2, batch=4, seq=8, vocab=VOCAB)
    expected = parity.train_reference(TiedTokens, batches, parity.cross_entropy)
    for trace, logged in run_on_ranks(_train_with_inductor, 2, batches):
        assert logged == [
            "look_up_touched_rows_pass: 1 lookups read the shards",
            "reduce_touched_rows_pass: 1 reduces send the touched rows only",
        ]
        parity.assert_close(trace, expected, rtol=1e-5, atol=1e-6)
