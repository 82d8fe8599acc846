"""Reading fczero's collectives in an FX graph: an op's short name, and the process
group a collective node runs on.

A gather or reduce traced into a graph is a ``_c10d_functional`` node and its wait:

    ag = all_gather_into_tensor(shard, world, group)     # group: the process group's name
    w  = wait_tensor(ag)

The passes, their registry and the cross-rank check all find collectives through
``collective_group``, so the op names and where each keeps its group live here once.
"""

from __future__ import annotations

import torch
import torch.fx as fx

#: The collectives fczero issues, by short op name: the position of the group-name argument.
GROUP_ARG = {
    "all_gather_into_tensor": 2,
    "all_gather_into_tensor_out": 2,  # written in place (``fczero.passes.in_place``)
    "reduce_scatter_tensor": 3,
    "all_reduce": 2,
    "all_reduce_": 2,  # a reduce over one rank, in place (``fczero.passes.in_place``)
}


def op_name(node: fx.Node) -> str:
    """``aten.view.default`` -> ``view``; ``_c10d_functional.wait_tensor.default`` -> ``wait_tensor``."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def collective_group(node: fx.Node) -> str | None:
    """The process group name of an all-gather, reduce-scatter or all-reduce node (None
    for any other node)."""
    if node.op != "call_function":
        return None
    index = GROUP_ARG.get(op_name(node))
    return None if index is None else node.args[index]
