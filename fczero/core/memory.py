"""The memory model the passes consult: bytes alive at each node of an FX graph.

Pure functions over a graph whose nodes carry ``meta["val"]`` (fake tensors), as
AOT autograd's and Inductor's graphs do. A node's output is alive from the node
until the last use of it or of any view of it; views (and ``wait_tensor``, which
returns its input) own no bytes of their own. Graph inputs are alive throughout.
This is an estimate from shapes: it ignores the allocator's rounding and caching,
and memory outside the graph (optimizer state, other graphs' activations).

The last helpers read the device instead, for the plans made from measurement
(automatic selective unsharding, optimizer states kept on the device): the allocator's
peak, and the budget ``memory_budget`` stands for when it is not given.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fczero.comm.graph_ops import op_name

# Ops whose output aliases their first argument's storage.
_ALIASING = {
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "permute",
    "slice",
    "select",
    "expand",
    "as_strided",
    "alias",
    "unsqueeze",
    "squeeze",
    "detach",
    "split",
    "unbind",
    "wait_tensor",
    "reshape",
    "view_as",
    "split_with_sizes",
    "copy_",  # returns its (mutated) first argument
    # returns ``out``, whose slot its first argument is (``fczero.passes.in_place``)
    "all_gather_into_tensor_out",
    "all_reduce_",  # a reduce over one rank, in place (``fczero.passes.in_place``)
}


def nbytes(node: fx.Node) -> int:
    """Bytes of the tensor(s) a node produces, from its fake value."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    total = 0
    for v in vals:
        if isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in v.shape):
            total += v.numel() * v.element_size()
    return total


def storage_root(node: fx.Node) -> fx.Node:
    """The node that allocated the storage ``node``'s output lives in."""
    while (
        node.op == "call_function"
        and op_name(node) in _ALIASING
        and node.args
        and isinstance(node.args[0], fx.Node)
    ):
        node = node.args[0]
    return node


def live_bytes(
    graph: fx.Graph, ignore: set[fx.Node] | frozenset[fx.Node] = frozenset()
) -> list[int]:
    """Bytes alive while each node runs (its inputs and its output), in graph order.

    Nodes in ``ignore`` own no bytes (the passes leave out graph inputs and shard prep,
    whose sizes differ between ranks when shards are uneven).
    """
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    end = len(nodes) - 1
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        root = storage_root(n)
        if root is not n:
            last_use[root] = max(last_use.get(root, index[root]), index[n])
        for user in n.users:
            last_use[root] = max(last_use.get(root, index[root]), index[user])
    delta = [0] * (len(nodes) + 1)
    for n in nodes:
        if storage_root(n) is not n or n in ignore:
            continue
        size = nbytes(n)
        if not size:
            continue
        start = 0 if n.op == "placeholder" else index[n]
        stop = end if n.op == "placeholder" else last_use.get(n, index[n])
        delta[start] += size
        delta[stop + 1] -= size
    out, running = [], 0
    for i in range(len(nodes)):
        running += delta[i]
        out.append(running)
    return out


def peak_bytes(graph: fx.Graph, ignore: set[fx.Node] | frozenset[fx.Node] = frozenset()) -> int:
    """The largest number of bytes alive at any node (``ignore`` as in ``live_bytes``)."""
    return max(live_bytes(graph, ignore), default=0)


def peak_allocated(device: torch.device) -> int | None:
    """Most bytes the device's allocator has held (since start or the last reset); None
    where the device keeps no such count (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None


def device_budget(device: torch.device, memory_budget: int | None) -> int | None:
    """``memory_budget``, or by default 90% of the accelerator's memory (None on CPU)."""
    if memory_budget is not None or device.type == "cpu":
        return memory_budget
    return int(0.9 * torch.get_device_module(device).get_device_properties(device).total_memory)


def budget_and_peak(device: torch.device, memory_budget: int | None) -> tuple[int, int] | str:
    """What a plan from measurement starts from: the budget and the allocator's peak so
    far, or why there is none to plan from (``"no memory_budget"``, ``"no allocator peak"``)."""
    budget = device_budget(device, memory_budget)
    if budget is None:
        return "no memory_budget"
    peak = peak_allocated(device)
    if peak is None:
        return "no allocator peak"
    return budget, peak
