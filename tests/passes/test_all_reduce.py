"""All-reduce bucketing (fczero/passes/all_reduce.py): stage 1's per-param all-reduces of
one block become one, placed where the block's last grad is ready."""

from __future__ import annotations

import unittest

from fczero.comm.graph_ops import op_name
from fczero.passes.all_reduce import bucket_all_reduces_pass, find_all_reduces
from fczero.testing.graphs import collective_sequence
from tests.passes import PER_BLOCK, ThreeBlocksGraphs


class AllReduceTest(ThreeBlocksGraphs):
    def test_one_all_reduce_per_block_with_every_grad_sliced_back(self):
        _, bw = self.graphs(stage=1)
        self.assertEqual(len(find_all_reduces(bw.graph, {"0"})), 7)  # 3 x (weight, bias) + head
        bucket_all_reduces_pass(bw, {"0"}, PER_BLOCK)
        reduces = [c for c in collective_sequence(bw) if c.startswith("all_reduce")]
        # the head's grad comes first in backward; then blocks 2, 1, 0, each one bucket
        self.assertEqual(
            reduces,
            ["all_reduce[8, 512]", "all_reduce[262656]", "all_reduce[262656]", "all_reduce[262656]"],
        )
        for node in bw.graph.nodes:
            if node.op == "call_function" and op_name(node) == "all_reduce":
                (wait,) = node.users
                self.assertEqual(op_name(wait), "wait_tensor")

    def test_a_group_that_is_not_fczeros_is_left_alone(self):
        _, bw = self.graphs(stage=1)
        before = collective_sequence(bw)
        bucket_all_reduces_pass(bw, {"another"}, PER_BLOCK)
        self.assertEqual(collective_sequence(bw), before)


if __name__ == "__main__":
    unittest.main()
