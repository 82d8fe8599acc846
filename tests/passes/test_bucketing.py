"""Bucketing (fczero/passes/bucketing.py): one all-gather and one reduce-scatter per
bucket of whole blocks, the first and last block alone, reduces sized in the gathered dtype,
and a contiguous column handed out without a copy."""

from __future__ import annotations

import copy
import unittest

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.passes import run_passes
from fczero.passes.bucketing import _copied_in_one_op
from fczero.passes.matching import Collective
from fczero.testing.backends import recording
from fczero.testing.graphs import collective_sequence
from tests.models import ThreeBlocks
from tests.passes import ThreeBlocksGraphs, settings


def _clones(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is torch.ops.aten.clone.default for n in gm.graph.nodes)


def _copy_ins(gm: torch.fx.GraphModule) -> list[tuple[str, int]]:
    """How each bucketed reduce's input is laid out: ``chunk_cat`` or ``cat``, and its members."""
    chunk_cat, cat = torch.ops.fczero.chunk_cat.default, torch.ops.aten.cat.default
    return [
        ("chunk_cat" if n.target is chunk_cat else "cat", len(n.args[0]))
        for n in gm.graph.nodes
        if n.target is chunk_cat or (n.target is cat and n.args[1] == 1)
    ]


class BucketingTest(ThreeBlocksGraphs):
    def test_buckets_follow_blocks(self):
        fw, bw = self.graphs()
        self.assertEqual(len([c for c in collective_sequence(fw) if c.startswith("all_gather")]), 7)
        run_passes(fw, settings())
        run_passes(bw, settings())
        # forward: blocks.0, blocks.1, blocks.2, and the 16 KiB head alone (the last block);
        # every gather writes in place (fczero/passes/in_place.py runs last)
        self.assertEqual(
            [c for c in collective_sequence(fw) if c.startswith("all_gather")],
            [
                "all_gather_into_tensor_out[262656]",
                "all_gather_into_tensor_out[262656]",
                "all_gather_into_tensor_out[262656]",
                "all_gather_into_tensor_out[8, 512]",
            ],
        )
        # backward: one reduce-scatter per bucket, in the order the gradients become ready
        self.assertEqual(
            [c for c in collective_sequence(bw) if c.startswith("reduce_scatter")],
            [
                "reduce_scatter_tensor[4, 512]",  # head alone: the first block of backward
                "reduce_scatter_tensor[131328]",
                "reduce_scatter_tensor[131328]",
                "reduce_scatter_tensor[131328]",
            ],
        )

    def test_first_and_last_block_alone_whatever_the_cap(self):
        # [Note: small ends]: a cap that holds the whole model still leaves the first and
        # the last block on their own, and the middle blocks in one bucket
        fw, bw = self.graphs()
        run_passes(fw, settings(bucket_bytes=256 << 20))
        run_passes(bw, settings(bucket_bytes=256 << 20))
        self.assertEqual(
            [c for c in collective_sequence(fw) if c.startswith("all_gather")],
            [
                "all_gather_into_tensor_out[262656]",  # blocks.0
                "all_gather_into_tensor_out[525312]",  # blocks.1 + blocks.2
                "all_gather_into_tensor_out[8, 512]",  # head
            ],
        )
        self.assertEqual(
            [c for c in collective_sequence(bw) if c.startswith("reduce_scatter")],
            [
                "reduce_scatter_tensor[4, 512]",  # head, the first grads of backward
                "reduce_scatter_tensor[262656]",  # blocks.2 + blocks.1
                "reduce_scatter_tensor[131328]",  # blocks.0, the last
            ],
        )

    def test_reduces_are_sized_in_the_gathered_dtype(self):
        # a block's fp32 grads are twice its bf16 params: counted at the param dtype's 2
        # bytes a block is one reduce-scatter, as it is one all-gather; counted at their
        # own 4 bytes the same cap splits every block
        def reduces(itemsize):
            _, bw = self.graphs()
            run_passes(bw, settings(bucket_bytes=3 << 18, param_itemsize=itemsize))
            return [c for c in collective_sequence(bw) if c.startswith("reduce_scatter")]

        # at 2 bytes: the head alone, blocks 2 and 1 (a bucket under 1 MiB takes the next
        # block), block 0 alone; at 4 bytes each block is over the cap and split
        self.assertEqual(
            reduces(2),
            [
                "reduce_scatter_tensor[4, 512]",
                "reduce_scatter_tensor[262656]",
                "reduce_scatter_tensor[131328]",
            ],
        )
        self.assertEqual(len(reduces(None)), 7)  # the head, then each bias and weight apart

    def test_grads_divided_by_the_world_are_laid_out_by_a_cat(self):
        # [Note: one copy-in per bucket]: at 2 ranks each grad is divided by 2 on its way
        # to the reduce, and Inductor writes that division into the cat's output in place
        _, bw = self.graphs()
        run_passes(bw, settings())
        self.assertEqual(_copy_ins(bw), [("cat", 2)] * 3)

    def test_columns_are_copied_out_when_ranks_interleave(self):
        # [Note: copy-out]: at 2 ranks a param's rows of each rank lie apart in the table
        fw, _ = self.graphs()
        run_passes(fw, settings())
        self.assertEqual(_clones(fw), 6)  # the weight and the bias of each of 3 blocks


def test_one_rank_hands_out_views_of_the_bucket_with_the_same_numerics():
    """[Note: copy-out] at world size 1: the table is one row, so every column is contiguous
    and handed out as a view (no clone in either graph); with no division the grads come
    straight from matmuls, so each bucket's reduce input is one ``chunk_cat`` ([Note: one
    copy-in per bucket]); loss and grads equal the plain model's (a gloo group of one
    rank: the collectives are copies)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref = ThreeBlocks()
        model = fczero.parallelize(copy.deepcopy(ref), init_device_mesh("cpu", (1,)))
        graphs: list[torch.fx.GraphModule] = []
        x = torch.randn(4, 512)
        loss = torch.compile(model, backend=recording(graphs), fullgraph=True)(x).pow(2).sum()
        loss.backward()
        fw, bw = graphs
        assert [c for c in collective_sequence(fw) if c.startswith("all_gather")] == [
            "all_gather_into_tensor_out[262656]",  # blocks.0
            "all_gather_into_tensor_out[525312]",  # blocks.1 + blocks.2: 4 columns
            "all_gather_into_tensor_out[8, 512]",  # head
        ]
        assert _clones(fw) == 0 and _clones(bw) == 0
        # [Note: reducing in place at one rank]: each bucket's reduce is an in-place all-reduce
        reduces = [c for c in collective_sequence(bw) if c.startswith(("reduce", "all_reduce"))]
        assert reduces == ["all_reduce_[8, 512]", "all_reduce_[525312]", "all_reduce_[262656]"]
        assert _copy_ins(bw) == [("chunk_cat", 4), ("chunk_cat", 2)]  # blocks 2 + 1, block 0
        expected = ref(x).pow(2).sum()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=0, atol=0)
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_a_bucket_takes_one_copy_in_op_only_for_grads_straight_from_extern_kernels():
    # [Note: one copy-in per bucket], on a hand-made graph: a matmul's grad alone is laid out
    # by chunk_cat; a pointwise grad beside it (a tied weight's sum of two grads), or a
    # bucket of reductions only, keeps the cat
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    mm = graph.call_function(torch.ops.aten.mm.default, (a, b))
    tied = graph.call_function(torch.ops.aten.add.Tensor, (mm, mm))
    norm = graph.call_function(torch.ops.aten.sum.dim_IntList, (a, [0]))

    def reduce(grad: torch.fx.Node) -> Collective:
        rs = torch.ops._c10d_functional.reduce_scatter_tensor.default
        return Collective(graph.call_function(rs, (grad, "sum", 1, "0")), grad, 1, "0", [])

    t = graph.call_function(torch.ops.aten.t.default, (mm,))
    assert _copied_in_one_op([reduce(t), reduce(norm)])  # through the transpose, to the mm
    assert not _copied_in_one_op([reduce(mm), reduce(tied)])
    assert not _copied_in_one_op([reduce(norm)])


def test_one_rank_casting_grads_to_the_reduce_dtype_keeps_the_cat():
    """[Note: one copy-in per bucket]: with ``reduce_dtype`` each bf16 grad is cast to fp32
    on its way to the reduce, a cast Inductor writes into the ``cat`` in place; so even at
    one rank the buckets keep the ``cat``."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        mp = fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (1,)), mp_policy=mp)
        graphs: list[torch.fx.GraphModule] = []
        compiled = torch.compile(model, backend=recording(graphs), fullgraph=True)
        compiled(torch.randn(4, 512)).float().pow(2).sum().backward()
        (bw,) = [g for g in graphs if "all_reduce_[525312]" in collective_sequence(g)]
        assert _copy_ins(bw) == [("cat", 4), ("cat", 2)]
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


if __name__ == "__main__":
    unittest.main()
