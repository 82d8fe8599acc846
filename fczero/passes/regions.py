"""Experimental: keep a reused block's gathered params out of what forward saves.

With ``fczero.runtime.units.REUSE_BLOCKS`` a block's body runs in a
``nested_compile_region`` (an ``invoke_subgraph`` call) whose inputs are the block's
gathered params ([Note: a block compiled once] in ``fczero/runtime/units.py``). AOT
autograd partitions the region on its own, and the region's backward needs the params
(``mm(grad, W)``), so its forward returns them, or views of them, as saved tensors. Saved
there, the outer partitioner cannot regather them in backward: every block's unsharded
params would live from forward to backward. This rewrite (on the joint graph, after AOT
restitched the regions, before the outer partition) hands the region's backward the
outer input instead, through the same views, so the outer partitioner recomputes the
gather in backward as it does without regions::

    fw = invoke_subgraph(region_fw, "fw...", x, full_w)   # before
    t  = getitem(fw, k)      # region_fw returns t(t(full_w)): a view of its input
    bw = invoke_subgraph(region_bw, "bw...", ..., t, ...)

    fw = invoke_subgraph(region_fw, "fw...", x, full_w)   # after
    t  = t(t(full_w))        # the same view, of the outer input
    bw = invoke_subgraph(region_bw, "bw...", ..., t, ...)

Only outputs that are a chain of view ops of one input are rerouted: the same values
(the joint graph is functional), so any call's such outputs may be, whoever reads them;
anything a region computed stays as it is.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

from fczero.passes.graph_utils import fake_mode_of, insert

logger = logging.getLogger("fczero")
aten = torch.ops.aten

#: ops that return a view of their first argument (what the region partition saves of a param)
VIEW_OPS = frozenset(
    {
        aten.t.default,
        aten.view.default,
        aten._unsafe_view.default,
        aten.transpose.int,
        aten.permute.default,
        aten.detach.default,
        aten.alias.default,
        aten.expand.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.slice.Tensor,
    }
)
#: FX meta keys the rerouted views copy from the outer input (its recompute tags)
RECOMPUTE_KEYS = ("recompute", "ac_graph_id")


def _view_chain(out: fx.Node) -> tuple[int, list[fx.Node]] | None:
    """``(input index, view nodes from the input to out)`` when ``out`` is a chain of view
    ops of one placeholder of its graph, else None."""
    chain = []
    node = out
    while node.op == "call_function" and node.target in VIEW_OPS:
        rest = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, fx.Node)]
        if rest:
            return None
        chain.append(node)
        node = node.args[0]
    if node.op != "placeholder":
        return None
    placeholders = [n for n in node.graph.nodes if n.op == "placeholder"]
    return placeholders.index(node), chain[::-1]


def reroute_region_views_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Feed each region backward the views of its forward's inputs from outside (see the
    module docstring); returns ``gm``."""
    graph = gm.graph
    fake_mode = None
    rerouted = 0
    for hop in list(graph.nodes):
        if hop.op != "call_function" or hop.target is not invoke_subgraph:
            continue
        body = getattr(gm, hop.args[0].target)
        outs = next(n for n in body.graph.nodes if n.op == "output").args[0]
        for user in list(hop.users):
            if user.target is not operator.getitem:
                continue
            found = _view_chain(outs[user.args[1]])
            if found is None or not user.users:
                continue
            index, chain = found
            source = hop.args[2 + index]
            if not isinstance(source, fx.Node):
                continue
            fake_mode = fake_mode or fake_mode_of(graph)
            current = source
            with graph.inserting_before(user):
                for view in chain:
                    current = insert(
                        graph, fake_mode, view.target, (current, *view.args[1:]), dict(view.kwargs),
                        like=source,
                    )  # fmt: skip
                    for key in RECOMPUTE_KEYS:
                        if key in source.meta:
                            current.meta[key] = source.meta[key]
            user.replace_all_uses_with(current)
            graph.erase_node(user)
            rerouted += 1
    if rerouted:
        graph.lint()
        gm.recompile()
        logger.info("reroute_region_views_pass: %d saved views of region inputs rerouted", rerouted)
    return gm
