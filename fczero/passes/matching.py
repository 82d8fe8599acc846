"""Find fczero's collectives in a post-grad graph (matching is kept apart from rewriting).

A *gather* is the chain fczero's ``collectives.gather_shard`` traces to, and a
*reduce* the chain its backward traces to:

    x  = <views, casts, pads of a graph input>      # the shard, maybe cast
    ag = all_gather_into_tensor(x, world, group)     # gather
    w  = wait_tensor(ag)

and, once ``fczero.passes.in_place`` has run (last), a gather writes in place:

    ag = all_gather_into_tensor_out(copy_(slice(out, ...), x), world, group, out=out)

    rs = reduce_scatter_tensor(grad, "sum", world, group)   # reduce
    w  = wait_tensor(rs)

Only collectives on process groups that ``parallelize`` registered are matched, and
a gather must come from a graph input alone, so a user's own collectives on
activations are never touched. Everything matched is the same on every rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.fx as fx

from fczero.comm.graph_ops import op_name
from fczero.core.memory import nbytes
from fczero.core.unsharding import block_of
from fczero.passes.graph_utils import in_graph_order

# Ops allowed between a graph input and the all-gather of a gather.
_SHARD_PREP = {
    "view",
    "_to_copy",
    "convert_element_type",
    "constant_pad_nd",
    "clone",
    "alias",
    "_unsafe_view",
    "reshape",
    "contiguous",
    "cat",
}


@dataclass
class Collective:
    """One matched all-gather or reduce-scatter and its wait."""

    node: fx.Node  # all_gather_into_tensor(_out) or reduce_scatter_tensor
    wait: fx.Node
    group_size: int
    group_name: str
    prep: list[fx.Node]  # gathers: the ops from graph inputs to the all-gather input

    @property
    def input(self) -> fx.Node:
        """What is gathered or reduced (for an in-place gather: what fills its slot)."""
        x = self.node.args[0]
        return x.args[1] if self.in_place else x

    @property
    def in_place(self) -> bool:
        return op_name(self.node) == "all_gather_into_tensor_out"

    @property
    def dtype(self):
        return self.node.meta["val"].dtype

    @property
    def bytes(self) -> int:
        """Bytes on the unsharded side: a gather's output, a reduce's input."""
        return max(nbytes(self.node), nbytes(self.input))

    def bytes_as(self, itemsize: int | None) -> int:
        """``bytes`` counted at ``itemsize`` bytes per element (None: its own dtype's)."""
        if itemsize is None:
            return self.bytes
        return self.bytes // self.dtype.itemsize * itemsize

    @property
    def block(self) -> str:
        return block_key(self.node)


def only_wait(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    if len(users) == 1 and op_name(users[0]) == "wait_tensor":
        return users[0]
    return None


def _prep_chain(x: fx.Node) -> list[fx.Node] | None:
    """The ops that compute ``x`` from graph inputs alone (in graph order), or None if some
    ancestor is not a view, cast, pad or concatenation of graph inputs."""
    seen: dict[fx.Node, None] = {}
    stack = [x]
    while stack:
        n = stack.pop()
        if n.op == "placeholder" or n in seen:
            continue
        if n.op != "call_function" or op_name(n) not in _SHARD_PREP:
            return None
        seen[n] = None
        stack.extend(n.all_input_nodes)
    return in_graph_order(seen)


_GATHERS = ("all_gather_into_tensor", "all_gather_into_tensor_out")

#: Meta key of a collective a pass added that moves no param and no grad (never matched as
#: a gather or a reduce: ``fczero.passes.touched_rows``).
NOT_A_PARAM_COLLECTIVE = "fczero_not_a_param_collective"


def find_gathers(graph: fx.Graph, groups: set[str]) -> list[Collective]:
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or op_name(node) not in _GATHERS:
            continue
        if node.meta.get(NOT_A_PARAM_COLLECTIVE):
            continue
        _, size, name = node.args[:3]
        gather = Collective(node, only_wait(node), size, name, [])
        if gather.in_place and op_name(node.args[0]) != "copy_":
            continue
        prep = _prep_chain(gather.input)
        if name in groups and gather.wait is not None and prep is not None:
            gather.prep = prep
            found.append(gather)
    return found


def find_reduces(graph: fx.Graph, groups: set[str]) -> list[Collective]:
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or op_name(node) != "reduce_scatter_tensor":
            continue
        _, op, size, name = node.args[:4]
        wait = only_wait(node)
        if node.meta.get(NOT_A_PARAM_COLLECTIVE):
            continue
        if name in groups and op == "sum" and wait is not None:
            found.append(Collective(node, wait, size, name, []))
    return found


def block_key(node: fx.Node) -> str:
    """The model block a node runs in, from its module stack: ``layers.3`` for anything
    under ``layers.3.attn``; the top-level child (``embed``) outside indexed containers."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['self'\]\.?", "", str(path))
    path = re.sub(r"\[(\d+)\]", r".\1", path)  # layers[3] -> layers.3
    return block_of(path)
