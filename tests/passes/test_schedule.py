"""Scheduling (fczero/passes/schedule.py): waits sink to their first use, gathers are
prefetched under the memory budget, every rank places them alike, and on gloo each
collective is waited where it is issued."""

from __future__ import annotations

import logging
import unittest

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import fczero
from fczero.passes import run_passes
from fczero.passes.matching import block_key
from fczero.passes.schedule import allocated_peak
from fczero.testing import backends
from fczero.testing.distributed import run_on_ranks
from tests.models import ThreeBlocks, UnevenTiedMLP
from tests.passes import PER_BLOCK, ThreeBlocksGraphs, settings


class ScheduleTest(ThreeBlocksGraphs):
    def test_reduce_scatters_are_waited_after_a_matmul(self):
        # every reduce-scatter but the last is in flight across at least one matmul
        _, bw = self.graphs()
        run_passes(bw, settings())
        names = [str(n.target) for n in bw.graph.nodes if n.op == "call_function"]
        issued = [i for i, t in enumerate(names) if "reduce_scatter_tensor" in t]
        waits = []
        for node in bw.graph.nodes:
            if "reduce_scatter_tensor" in str(node.target):
                (wait,) = node.users
                waits.append(wait)
        order = {n: i for i, n in enumerate(n for n in bw.graph.nodes if n.op == "call_function")}
        matmuls = [i for i, t in enumerate(names) if t in ("aten.mm.default", "aten.addmm.default")]
        for start, wait in list(zip(issued, waits))[:-1]:
            self.assertTrue(any(start < m < order[wait] for m in matmuls), names)

    def test_a_block_split_in_buckets_is_waited_after_the_next_blocks_matmul(self):
        # buckets smaller than a block's weight: each block's grads go out as two
        # reduce-scatters, issued back to back; neither may be waited before the other is
        # issued (that wait would hold the compute stream while the first one runs), only
        # once the next block's backward has run a matmul
        _, bw = self.graphs()
        run_passes(bw, settings(bucket_bytes=2**19))
        order = [n for n in bw.graph.nodes if n.op == "call_function"]
        at = {n: i for i, n in enumerate(order)}
        names = [str(n.target) for n in order]
        matmuls = [i for i, t in enumerate(names) if t in ("aten.mm.default", "aten.addmm.default")]
        reduces = [n for n in order if "reduce_scatter_tensor" in str(n.target)]
        self.assertGreater(len(reduces), 4, names)  # more buckets than blocks
        blocks = [block_key(r) for r in reduces]
        for reduce, block in zip(reduces, blocks):
            if block == blocks[-1]:
                continue  # the last block's: waited where the grads are returned
            (wait,) = reduce.users
            self.assertTrue(any(at[reduce] < m < at[wait] for m in matmuls), (block, names))

    def test_no_gather_waits_behind_a_reduce(self):
        """[Note: a gather never queues behind a reduce]: where backward issues a block's
        reduce-scatter and the next gathers with no matmul between, the gathers go first
        (before the pass the head's reduce-scatter came first, then block 2's regather)."""
        for bucket in (PER_BLOCK, 2**19):
            _, bw = self.graphs()
            run_passes(bw, settings(bucket_bytes=bucket))
            with self.subTest(bucket=bucket):
                issued = _issued_between_matmuls(bw)
                self.assertIn("r", "".join(issued))
                self.assertFalse([run for run in issued if "ra" in run], issued)

    def test_prefetch_issues_the_next_gather_before_this_blocks_matmul(self):
        fw, _ = self.graphs()
        run_passes(fw, settings())
        order = [n for n in fw.graph.nodes if n.op == "call_function"]
        names = [str(n.target) for n in order]
        gathers = [i for i, t in enumerate(names) if "all_gather_into_tensor" in t]
        matmuls = [i for i, t in enumerate(names) if t in ("aten.addmm.default", "aten.mm.default")]
        for gather, matmul in zip(gathers[1:], matmuls):
            self.assertLess(gather, matmul)

    def test_a_gather_larger_than_a_bucket_is_issued_further_ahead(self):
        """[Note: a gather larger than a bucket]: each block's 1 MiB weight against buckets of
        0.6 MiB is two buckets' worth, so it is issued two buckets ahead, not one."""
        for bucket, ahead in ((PER_BLOCK, 1), (PER_BLOCK * 2 // 5, 2)):
            fw, _ = self.graphs()
            run_passes(fw, settings(bucket_bytes=bucket))
            order = [n for n in fw.graph.nodes if n.op == "call_function"]
            names = [str(n.target) for n in order]
            weights = [
                i for i, n in enumerate(order)
                if "all_gather_into_tensor" in names[i] and n.meta["val"].numel() >= 512 * 512
            ]  # fmt: skip
            matmuls = [i for i, t in enumerate(names) if t == "aten.addmm.default"]
            with self.subTest(bucket=bucket):
                self.assertLess(weights[2], matmuls[2 - ahead])  # block 2's, ahead of its use
                if ahead == 1:
                    self.assertGreater(weights[2], matmuls[0])

    def test_budget_too_small_runs_without_prefetch_and_says_so(self):
        fw, _ = self.graphs()
        with self.assertLogs("fczero", level=logging.WARNING) as logs:
            run_passes(fw, settings(memory_budget=1))
        self.assertIn("too small to prefetch any all-gather", "\n".join(logs.output))
        names = [str(n.target) for n in fw.graph.nodes]
        gathers = [i for i, t in enumerate(names) if "all_gather_into_tensor" in t]
        waits = [i for i, t in enumerate(names) if "wait_tensor" in t]
        # without prefetch each gather is issued after the previous bucket's compute
        matmuls = [i for i, t in enumerate(names) if t == "aten.addmm.default"]
        self.assertGreater(gathers[1], matmuls[0])
        self.assertGreater(gathers[2], matmuls[1])
        self.assertEqual(len(gathers), len(waits))

    def test_budget_decides_how_far_ahead(self):
        def placement(budget):
            fw, _ = self.graphs()
            run_passes(fw, settings(prefetch=2, memory_budget=budget))
            names = [str(n.target) for n in fw.graph.nodes]
            gathers = [i for i, t in enumerate(names) if "all_gather_into_tensor" in t]
            matmuls = [i for i, t in enumerate(names) if t == "aten.addmm.default"]
            return fw, gathers, matmuls

        _, gathers, matmuls = placement(None)
        self.assertLess(gathers[2], matmuls[0])  # unlimited: two buckets ahead
        one_ahead, _ = self.graphs()
        run_passes(one_ahead, settings(prefetch=1))
        budget = allocated_peak(one_ahead.graph, {"0"})  # what one bucket ahead needs
        fw, gathers, matmuls = placement(budget)
        self.assertGreater(gathers[2], matmuls[0])  # the budget holds it to one ahead
        self.assertLess(gathers[2], matmuls[1])
        self.assertLessEqual(allocated_peak(fw.graph, {"0"}), budget)


BUDGETS = [None, 0, 400, 800, 1200, 1600, 2000, 3000, 4000]  # bytes; tight ones split ranks before


def _sequences(rank: int, world_size: int) -> list[list[list[str]]]:
    out = []
    for budget in BUDGETS:
        torch._dynamo.reset()
        graphs: list[torch.fx.GraphModule] = []
        torch.manual_seed(0)
        model = fczero.parallelize(
            UnevenTiedMLP(),
            init_device_mesh("cpu", (world_size,)),
            comm_policy=fczero.CommPolicy(bucket_bytes=0),
            memory_budget=budget,
        )
        compiled = torch.compile(model, backend=backends.recording(graphs))
        compiled(torch.randn(4, 5)).sum().backward()
        out.append([_order(g) for g in graphs])
    return out


def _order(gm: torch.fx.GraphModule, waits: bool = False) -> list[str]:
    """Collectives and matmuls in program order: where each gather was placed (and, with
    ``waits``, where each collective is waited)."""
    keep = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "mm", "addmm")
    keep += ("all_gather_into_tensor_out", "wait_tensor") if waits else ()
    return [
        f"{n.target}{list(n.meta['val'].shape)}"
        for n in gm.graph.nodes
        if n.op == "call_function" and str(n.target).split(".")[1] in keep
    ]


def test_every_rank_issues_the_same_collectives():
    """13 rows on 4 ranks: shards differ in real rows (4, 4, 4, 1); under any memory budget
    the collectives, and where they sit among the matmuls, must not."""
    per_rank = run_on_ranks(_sequences, 4)
    assert all(graphs for graphs in per_rank[0])
    for other in per_rank[1:]:
        assert other == per_rank[0]


def _issued_between_matmuls(gm: torch.fx.GraphModule) -> list[str]:
    """The collectives issued between consecutive matmuls, in order: "a" an all-gather,
    "r" a reduce-scatter (one string per stretch between matmuls)."""
    line = ""
    for node in gm.graph.nodes:
        target = str(node.target)
        if "reduce_scatter_tensor" in target:
            line += "r"
        elif "all_gather" in target:
            line += "a"
        elif target in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default"):
            line += "|"
    return line.split("|")


def _checkpointed_llama_backward(fake_pg) -> torch.fx.GraphModule:
    """fczero's Llama with every block checkpointed, blocks split in two buckets as Llama
    3B's are at 128 MiB (4 MiB here), compiled with the passes; its backward graph."""
    from fczero.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=4096, dim=512, n_layers=3, n_heads=8, n_kv_heads=4,
                      ffn_dim=1536, max_seq_len=32, tie_embeddings=True, checkpointing="full")  # fmt: skip
    torch.manual_seed(0)
    model = fczero.parallelize(
        Llama(cfg),
        init_device_mesh("cpu", (fake_pg,)),
        mp_policy=fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        comm_policy=fczero.CommPolicy(bucket_bytes=4 << 20),
    )
    graphs: list[torch.fx.GraphModule] = []
    logits = torch.compile(model, backend=backends.recording(graphs))(torch.randint(0, 4096, (1, 16)))
    logits.float().sum().backward()
    return graphs[-1]


def test_checkpointed_blocks_regather_before_they_reduce(fake_pg):
    """The case the pass was written for: with each block checkpointed, backward finishes a
    block (its reduce-scatters) where the next block's recompute needs its regather. No
    regather may be issued behind a reduce-scatter with no matmul between (without the
    pass, three were: the head's and two blocks')."""
    issued = _issued_between_matmuls(_checkpointed_llama_backward(fake_pg))
    assert "".join(issued).count("r") > 6, issued  # two buckets a block, the head
    assert not [run for run in issued if "ra" in run], issued


def test_a_padded_shard_waits_for_its_reduce_where_the_others_do():
    """13 rows on 4 ranks again, on the fake group, so no rank waits where it issues: rank
    3, whose shards carry padding, must place every collective and every wait where rank 0
    does (its reduce-scatters were once waited at once, held by the padding's removal)."""
    orders = []
    for rank in (0, 3):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        try:
            torch._dynamo.reset()
            torch.manual_seed(0)
            graphs: list[torch.fx.GraphModule] = []
            model = fczero.parallelize(
                UnevenTiedMLP(), init_device_mesh("cpu", (4,)), comm_policy=fczero.CommPolicy(bucket_bytes=0)
            )
            torch.compile(model, backend=backends.recording(graphs))(torch.randn(4, 5)).sum().backward()
            orders.append([_order(g, waits=True) for g in graphs])
        finally:
            dist.destroy_process_group()
    assert any("wait_tensor" in n for g in orders[0] for n in g)
    assert orders[1] == orders[0]


def _gloo_schedule(rank: int, world_size: int) -> list[list[str]]:
    torch._dynamo.reset()
    torch.manual_seed(0)  # the same weights on every rank, however the ranks were started
    graphs: list[torch.fx.GraphModule] = []
    model = fczero.parallelize(
        ThreeBlocks(), init_device_mesh("cpu", (world_size,)), comm_policy=fczero.CommPolicy(bucket_bytes=PER_BLOCK)
    )
    compiled = torch.compile(model, backend=backends.recording(graphs))
    compiled(torch.randn(4, 512)).sum().backward()
    keep = ("all_gather_into_tensor_out", "reduce_scatter_tensor", "wait_tensor", "addmm", "mm")
    return [
        [str(n.target).split(".")[1] for n in g.graph.nodes if n.op == "call_function"
         and str(n.target).split(".")[1] in keep]
        for g in graphs
    ]  # fmt: skip


def test_gloo_waits_each_collective_where_it_is_issued():
    """[Note: one gloo collective in flight]: on gloo the prefetch still issues block 1's
    gather before block 0's matmul, and every collective is waited right after it."""
    forward, backward = run_on_ranks(_gloo_schedule, 2)[0]
    for ops in (forward, backward):
        issued = [i for i, op in enumerate(ops) if op in ("all_gather_into_tensor_out", "reduce_scatter_tensor")]
        assert issued and all(ops[i + 1] == "wait_tensor" for i in issued), ops
    gathers = [i for i, op in enumerate(forward) if op == "all_gather_into_tensor_out"]
    assert gathers[1] < forward.index("addmm"), forward


if __name__ == "__main__":
    unittest.main()
