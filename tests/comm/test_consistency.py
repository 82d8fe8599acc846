"""Cross-rank checks (fczero/comm/consistency.py): a graph's fingerprint lists its
collectives on checked groups in program order, equal fingerprints pass, and the first
entry that differs is named on every rank. Whole runs that would hang are in
tests/e2e/test_hangs.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from fczero.comm import consistency
from fczero.testing.distributed import run_on_ranks

c10d = torch.ops._c10d_functional


def test_graph_fingerprint_lists_checked_collectives_in_program_order():
    g = fx.Graph()
    x = g.placeholder("x")
    for op, args, val in [
        (c10d.all_gather_into_tensor.default, (x, 2, "1"), torch.empty(8, 4, dtype=torch.bfloat16)),
        (c10d.all_reduce.default, (x, "sum", "2"), torch.empty(3)),  # group not checked
        (c10d.reduce_scatter_tensor.default, (x, "sum", 2, "1"), torch.empty(2, 4)),
    ]:
        node = g.call_function(op, args)
        node.meta["val"] = val
    assert consistency.graph_collectives(g, {"1"}) == {
        "1": ["all_gather_into_tensor bfloat16[8, 4]", "reduce_scatter_tensor float32[2, 4]"]
    }


def test_the_fake_group_has_no_peers_to_ask(fake_pg):
    consistency.exchange(dist.group.WORLD.group_name, "test", ["anything"], 0.1, "a test")


def _exchange(rank: int, world_size: int, entries_by_rank: list[list[str]]) -> str:
    group = dist.group.WORLD.group_name
    try:
        consistency.exchange(group, "test", entries_by_rank[rank], 30.0, "the test point")
        consistency.exchange(group, "test", ["again"], 30.0, "the second test point")
    except consistency.CollectiveMismatchError as e:
        return str(e)
    return "agreed"


def test_equal_fingerprints_pass_twice():
    same = [["gather [4] as float32"]] * 2
    assert run_on_ranks(_exchange, 2, same) == ["agreed", "agreed"]


def test_the_first_differing_entry_is_named_on_every_rank():
    differ = [["gather [4] as float32", "gather [8] as float32"], ["gather [4] as float32"]]
    for message in run_on_ranks(_exchange, 2, differ):
        assert "differ at the test point: entry #1" in message
        assert "(2 against 1 entries)" in message or "(1 against 2 entries)" in message
