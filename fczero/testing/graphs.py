"""Render FX graphs as short, stable text for expecttest snapshots.

``render(gm)`` keeps one line per node (``name: "dtype[shape]" = op(args)``) and
drops source comments, blank lines, the ``torch.ops.`` prefix and ``.default``
overload names, so a snapshot shows only what the graph does: every all-gather,
wait, reduce-scatter and cast in order.
"""

from __future__ import annotations

import re

import torch

from fczero.comm.graph_ops import GROUP_ARG, op_name
from fczero.core.memory import storage_root

COLLECTIVE_OPS = (*GROUP_ARG, "wait_tensor")


def render(gm: torch.fx.GraphModule) -> str:
    text = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    # Opaque inputs (the process groups a DTensor carries) are not data; which of them AOT
    # passes through to backward varies with what the process compiled before.
    opaque = [
        n.name
        for n in gm.graph.nodes
        if n.op == "placeholder" and not isinstance(n.meta.get("val"), (torch.Tensor, type(None)))
    ]
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("class "):
            continue
        stripped = re.sub(r";\s+[\w, ]+ = None$", "", stripped)  # drop 'x = None' frees
        stripped = stripped.replace("torch.ops.", "").replace(".default", "")
        if stripped.startswith(("def forward", "return ")):
            for name in opaque:
                stripped = re.sub(rf",? ?\b{name}\b(?=[,)])", "", stripped)
            stripped = stripped.replace("(, ", "(").replace("(self, ", "(self, ")
        lines.append(stripped)
    return "\n".join(lines)


def collective_sequence(gm: torch.fx.GraphModule) -> list[str]:
    """The collectives of a graph in program order, with their shapes (rank-comparable)."""
    seq = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node)
        if name in COLLECTIVE_OPS:
            val = node.meta.get("val")
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
            seq.append(f"{name}{list(shape) if shape is not None else ''}")
    return seq


def saved_unsharded(fw_gm: torch.fx.GraphModule, num_user_outputs: int = 1) -> list[str]:
    """Names of forward outputs saved for backward that are (views of) gathered params.

    AOT's forward graph returns the user outputs first, then what backward needs. A
    saved value whose storage is an all-gather's output (``memory.storage_root`` sees
    through views and ``wait_tensor``) is an unsharded param kept alive from forward to
    backward (stage-2 memory).
    """
    output = next(n for n in fw_gm.graph.nodes if n.op == "output")
    saved = [a for a in output.args[0][num_user_outputs:] if isinstance(a, torch.fx.Node)]
    return [node.name for node in saved if node.op == "call_function" and _gathered(storage_root(node))]


def _gathered(root: torch.fx.Node) -> bool:
    """An all-gather's output: its own, or the buffer an in-place all-gather fills."""
    if op_name(root) == "all_gather_into_tensor":
        return True
    return any(
        op_name(user) == "all_gather_into_tensor_out" and user.kwargs.get("out") is root
        for user in root.users
    )
