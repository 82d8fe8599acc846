"""reroute_region_views_pass (fczero/passes/regions.py): with REUSE_BLOCKS, a region's
backward takes its params from the outer gathers, which backward regathers; without the
pass the region's forward saves them (every block's unsharded params held until backward)."""

from __future__ import annotations

import operator

import torch

import fczero.offload.partition
from fczero.passes.regions import _view_chain
from fczero.testing.graphs import collective_sequence
from tests.runtime.test_units import _block_graphs


def _gathers(gm: torch.fx.GraphModule) -> int:
    return sum(c.startswith("all_gather") for c in collective_sequence(gm))


def _saved_input_views(fw: torch.fx.GraphModule) -> int:
    """Bytes the forward saves for backward that a region returns as a view of its input."""
    output = next(n for n in fw.graph.nodes if n.op == "output")
    total = 0
    for node in output.args[0][1:]:
        if not isinstance(node, torch.fx.Node) or node.target is not operator.getitem:
            continue
        hop = node.args[0]
        if hop.target is not torch.ops.higher_order.invoke_subgraph:
            continue
        body = getattr(fw, hop.args[0].target)
        outs = next(n for n in body.graph.nodes if n.op == "output").args[0]
        if _view_chain(outs[node.args[1]]) is not None:
            total += node.meta["val"].numel() * node.meta["val"].element_size()
    return total


def test_without_the_pass_regions_save_the_gathered_params(fake_pg, monkeypatch):
    _, fw, bw = _block_graphs(monkeypatch, reuse=True)
    monkeypatch.setattr(fczero.offload.partition, "reroute_region_views_pass", lambda gm: gm)
    _, fw_kept, bw_kept = _block_graphs(monkeypatch, reuse=True)
    assert _gathers(bw) > 0 and _gathers(bw_kept) == 0  # without the pass: no regather
    assert _saved_input_views(fw) == 0
    # each of the 4 blocks: wqkv, wo, w1, w3, w2 (dim 32, ffn 40) and 2 norm weights, fp32
    block = (96 * 32 + 32 * 32 + 3 * 40 * 32 + 2 * 32) * 4
    assert _saved_input_views(fw_kept) >= 4 * block
