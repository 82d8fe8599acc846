"""Small FX helpers the passes share: insert a node with a fake value, move nodes, regenerate
a graph module's code once after a chain of passes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fczero.comm.graph_ops import op_name

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


#: Ops that only change a tensor's dtype (or copy it), as post-grad graphs spell them.
CASTS = frozenset({"convert_element_type", "_to_copy"})


def is_cast(node: object) -> bool:
    """``node`` casts (or copies) one tensor node."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and op_name(node) in CASTS
        and bool(node.args)
        and isinstance(node.args[0], fx.Node)
        and isinstance(node.meta.get("val"), torch.Tensor)
    )


def one_reader(node: object) -> bool:
    """``node`` is an op whose result exactly one node reads."""
    return isinstance(node, fx.Node) and node.op == "call_function" and len(node.users) == 1


def static_sizes(*nodes: object) -> bool:
    """Every node's value is a tensor of plain-int sizes (none symbolic).

    [Note: the passes leave symbolic sizes alone]
    A graph compiled with dynamic shapes (Dynamo marks a size dynamic once a frame ran with
    two sizes: a second sequence length; a shared frame such as a unit's gather, called for
    params of several shapes) holds sizes as symbols (``s27``) that only nodes of the graph
    bind. A pass that read such a size off ``meta["val"]`` and wrote it into a new node's
    arguments (a reshape to ``[n]``, a bucket's ``empty``) left an expression in the code
    whose symbol no line defines: the graph raised ``NameError: name 's27' is not defined``
    at its first call (Hugging Face's BART after a second sequence length, an ``nn.LSTM``
    block). A rewrite whose sizes are symbolic is left out instead: the graph keeps the
    collectives as traced. Whether sizes are symbolic follows from the shapes a frame has
    seen, the same on every rank when the ranks' shards have the same shapes. With uneven
    shards (a dim 0 that does not divide by the ranks) a frame that gathers several params
    could see two shard sizes on the short rank only, and the ranks could then rewrite
    differently; such params are best given dim-0 sizes that divide by the ranks
    (docs/troubleshooting.md, "Uneven shards compile rank-specific graphs")."""
    for node in nodes:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return False
        if not all(type(size) is int for size in val.shape):
            return False
    return True


def fake_mode_of(graph: fx.Graph):
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def _meta(arg: Any) -> Any:
    return fx.node.map_arg(arg, lambda n: n.meta["val"])


def insert(
    graph: fx.Graph,
    fake_mode,
    target,
    args: tuple,
    kwargs: dict | None = None,
    like: fx.Node | None = None,
) -> fx.Node:
    """Create ``target(*args)`` at the graph's current insertion point, with ``meta["val"]``.

    ``like`` lends its source metadata (stack trace, module stack) so that later
    passes and readers can tell where the node came from.
    """
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    with fake_mode:
        node.meta["val"] = target(*_meta(args), **_meta(kwargs))
    if like is not None:
        for key in ("nn_module_stack", "stack_trace", "fwd_nn_module_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node


def move_before(nodes: Iterable[fx.Node], anchor: fx.Node) -> None:
    """Move ``nodes`` (kept in their given order) to just before ``anchor``."""
    for n in nodes:
        if n is not anchor:
            anchor.prepend(n)


def position(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's index in the graph (a full pass: for indexing per-node arrays; to order
    or compare a few nodes, compare the nodes themselves, see ``in_graph_order``)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def in_graph_order(nodes: Iterable[fx.Node]) -> list[fx.Node]:
    """``nodes`` sorted in the order the graph runs them.

    [Note: nodes compare by their place in the graph]
    FX nodes of one graph compare with ``<`` by where they stand (torch keeps a sort key on
    each node and updates it when a node moves, torch 2.11 and 2.13 alike), so a few nodes
    are ordered without indexing the whole graph. ``position`` rebuilt for each gather and
    each reduce made the passes quadratic in the graph's size: at 28 layers of Hugging
    Face's Llama (CPU) its 1,566 calls took 0.76 s of the passes' 5.3 s."""
    return sorted(nodes)


def stable_topological_sort(graph: fx.Graph) -> None:
    """Reorder nodes so every node follows its inputs, moving as few as possible: a node
    whose inputs are not all placed yet waits until they are, then takes its place."""
    placed: set[fx.Node] = set()
    waiting: dict[fx.Node, list[fx.Node]] = {}  # missing input -> nodes blocked on it
    order: list[fx.Node] = []

    def place(node: fx.Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            order.append(n)
            placed.add(n)
            for blocked in waiting.pop(n, []):
                missing = [a for a in blocked.all_input_nodes if a not in placed]
                if missing:  # (still waiting: on the next of its inputs not yet placed)
                    waiting.setdefault(missing[0], []).append(blocked)
                else:
                    stack.append(blocked)

    for node in list(graph.nodes):
        missing = [a for a in node.all_input_nodes if a not in placed]
        if missing:
            waiting.setdefault(missing[0], []).append(node)
        else:
            place(node)
    if len(order) != len(graph.nodes):
        raise RuntimeError("fczero: the graph has a cycle after a rewrite; please report this")
    anchor = next(iter(graph.nodes))
    for n in order:
        if n is not anchor:
            anchor.append(n)
            anchor = n


#: graph module id -> whether a pass changed it, for each ``one_recompile`` block running
_RECOMPILED_AT_END: dict[int, bool] = {}


def recompile(gm: fx.GraphModule) -> None:
    """Regenerate ``gm``'s Python code after a pass changed its graph; inside
    ``one_recompile(gm)``, leave it to the block's end.

    [Note: one recompile per graph]
    ``GraphModule.recompile`` writes and compiles the whole graph's Python code. A pass
    applied alone must leave a module that runs, but the passes in a chain only read
    and edit the graph, never the code. Regenerated after each of them, the code of
    Hugging Face's 8-layer Llama (CPU, 2 graphs, 7 regenerations) took 1.07 s of the
    passes' 2.2 s; ``run_passes`` now regenerates it once, and only if a pass changed it.
    Under Inductor it does not at all: Inductor's post-grad passes end by regenerating the
    code themselves, and the hook (``fczero.passes.install``) asks for ``recompile=False``.
    On the graphs of fczero's 28-block checkpointed Llama (2,964 and 7,163 nodes; 2-core
    CPU, a test run on the other core) that took the passes from 2.52-3.01 s to 1.72-2.33 s
    (four alternating rounds each)."""
    if id(gm) in _RECOMPILED_AT_END:
        _RECOMPILED_AT_END[id(gm)] = True
    else:
        gm.recompile()


@contextmanager
def one_recompile(gm: fx.GraphModule, at_end: bool = True) -> Iterator[None]:
    """Within the block ``recompile(gm)`` only takes note; at its end ``gm`` is regenerated
    once if any pass asked (``at_end=False``: not at all, the caller regenerates it)."""
    _RECOMPILED_AT_END[id(gm)] = False
    try:
        yield
    finally:
        if _RECOMPILED_AT_END.pop(id(gm)) and at_end:
            gm.recompile()
