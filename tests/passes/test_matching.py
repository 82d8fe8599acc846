"""Matching (fczero/passes/matching.py): each gather with the shard prep that feeds it,
each reduce with its wait, and the block each belongs to."""

from __future__ import annotations

import unittest

import torch

import fczero
from fczero.comm.graph_ops import op_name
from fczero.passes.matching import find_gathers, find_reduces
from tests.passes import ThreeBlocksGraphs


class MatchingTest(ThreeBlocksGraphs):
    def test_gathers_and_reduces_are_found_with_their_waits_and_blocks(self):
        fw, bw = self.graphs()
        gathers = find_gathers(fw.graph, {"0"})
        blocks = ["blocks.0"] * 2 + ["blocks.1"] * 2 + ["blocks.2"] * 2 + ["head"]
        self.assertEqual([g.block for g in gathers], blocks)  # weight and bias per block
        for g in gathers:
            self.assertEqual(op_name(g.wait), "wait_tensor")
            self.assertEqual(g.prep, [])  # even fp32 shards: gathered as the graph takes them
            self.assertEqual((g.group_size, g.group_name), (2, "0"))
        self.assertEqual(gathers[0].bytes, 512 * 512 * 4)  # the unsharded side, in bytes
        self.assertEqual(gathers[0].bytes_as(2), 512 * 512 * 2)
        reduces = find_reduces(bw.graph, {"0"})
        self.assertEqual(len(reduces), 7)
        self.assertTrue(all(op_name(r.wait) == "wait_tensor" and not r.prep for r in reduces))

    def test_a_gather_brings_the_cast_that_prepares_its_shard(self):
        fw, _ = self.graphs(mp_policy=fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        for g in find_gathers(fw.graph, {"0"}):
            self.assertEqual(g.prep[-1], g.input)  # the chain ends in the gathered shard
            self.assertEqual(g.prep[0].all_input_nodes[0].op, "placeholder")
            self.assertEqual(g.dtype, torch.bfloat16)

    def test_collectives_of_other_groups_are_not_fczeros(self):
        fw, bw = self.graphs()
        self.assertEqual(find_gathers(fw.graph, {"another"}), [])
        self.assertEqual(find_reduces(bw.graph, set()), [])


if __name__ == "__main__":
    unittest.main()
