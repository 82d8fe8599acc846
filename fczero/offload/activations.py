"""Activation offload: saved-for-backward tensors go to host memory between forward and backward.

Runs on the forward and backward graphs the partitioner has just split (so it knows
which forward outputs are saved for backward: those past ``num_fwd_outputs``, each
read in backward through a placeholder of the same name). For each chosen activation
``a``::

    forward:   a = ...;  h = fczero.offload(a) ... use(a) ... fczero.offload_wait(h, a)
               ... return (..., h, ...)                                     # was a
    backward:  d = fczero.reload(h, device)  ...  fczero.reload_wait(d);  use(d)

The offload is issued right after ``a`` is computed; ``a``'s device memory is then
free after its last forward use (or the next offload, see below) instead of being
held until backward. The forward wait takes ``a`` so that ``a`` cannot be freed, nor
its memory reused by Inductor, while the copy still reads it; it sits after ``a``'s
last use and, where the budget allows, after the next offload, so the copy overlaps
with the compute in between. In backward
each wait sits just before the first use, and each reload is issued one reloaded
activation ahead (before the first use of the previous one) when the memory model
says the budget allows it, so the copy runs while the previous one is consumed.

Which activations: candidates are computed (not input), contiguous, at least
``min_bytes``. ``"all"`` takes every candidate; ``"auto"`` takes the largest first
until the planned peak of both graphs is within the budget, and raises if even all
of them leave it above (the error names the minimum). Decisions read shapes and
graph order only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.fx as fx

from fczero.core.memory import live_bytes, nbytes, peak_bytes, storage_root
from fczero.offload import ops  # noqa: F401 - registers torch.ops.fczero.*
from fczero.passes.graph_utils import fake_mode_of, insert, position

logger = logging.getLogger("fczero")

MODES = ("off", "auto", "all")


@dataclass
class ActivationPlan:
    """What the pass decided for one forward/backward pair (read by ``memory_report``)."""

    mode: str
    budget: int | None
    min_bytes: int
    device_type: str = "cpu"
    offloaded: list[tuple[str, int]] = field(default_factory=list)
    kept: list[tuple[str, int, str]] = field(default_factory=list)  # name, bytes, why
    peak_before: int = 0
    peak_after: int = 0
    forward_peak: int = 0
    backward_peak: int = 0
    hoisted: int = 0
    delayed: int = 0
    # device bytes alive at each node, forward then backward, before and after the rewrite
    curve_before: tuple[list[int], list[int]] = ([], [])
    curve_after: tuple[list[int], list[int]] = ([], [])


def _saved_pairs(fw: fx.Graph, bw: fx.Graph, num_fwd_outputs: int) -> list[tuple[fx.Node, fx.Node]]:
    """(forward node, backward placeholder) for each tensor saved for backward."""
    out = fw.output_node()
    saved = list(out.args[0])[num_fwd_outputs:]
    by_name = {p.name: p for p in bw.find_nodes(op="placeholder")}
    pairs = []
    for node in saved:
        if isinstance(node, fx.Node) and node.name in by_name:
            pairs.append((node, by_name[node.name]))
    return pairs


def _why_not(node: fx.Node, min_bytes: int) -> str | None:
    val = node.meta.get("val")
    if node.op != "call_function":
        return "a graph input (params and inputs are not activations)"
    if storage_root(node).op == "placeholder":
        return "a view of a graph input (a param shard or the batch), not an activation"
    if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape):
        return "not a tensor of static shape"
    if not val.is_contiguous():
        return "not contiguous (backward reads its strides)"
    if nbytes(node) < min_bytes:
        return f"smaller than min_bytes={min_bytes}"
    return None


def _host_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose bytes are not device memory: graph inputs (params, batch) and host tensors."""
    on_device = _device_type(graph) != "cpu"  # (once: asking per node scanned the graph per node)
    out = set()
    for n in graph.nodes:
        val = n.meta.get("val")
        is_input = n.op == "placeholder" and n.name.startswith("primals")
        on_host = on_device and isinstance(val, torch.Tensor) and val.device.type == "cpu"
        if is_input or on_host or n.meta.get("fczero_host"):
            out.add(n)
    return out


def _device_type(graph: fx.Graph) -> str:
    for n in graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type not in ("cpu", "meta"):
            return val.device.type
    return "cpu"


def planned_peak(graph: fx.Graph) -> int:
    """Device bytes the graph allocates at its peak (inputs and host tensors left out)."""
    return peak_bytes(graph, _host_nodes(graph))


def _curves(fw: fx.Graph, bw: fx.Graph) -> tuple[list[int], list[int]]:
    return live_bytes(fw, _host_nodes(fw)), live_bytes(bw, _host_nodes(bw))


def _first_user(node: fx.Node) -> fx.Node:
    pos = position(node.graph)
    return min(node.users, key=pos.__getitem__)


def _offload_one(
    fw: fx.Graph, bw: fx.Graph, a: fx.Node, p: fx.Node, num_fwd_outputs: int
) -> fx.Node:
    """Rewrite both graphs so ``a`` crosses to backward through host memory; returns the reload."""
    with fw.inserting_after(a):
        host = insert(fw, fake_mode_of(fw), torch.ops.fczero.offload.default, (a,), like=a)
    host.meta["fczero_host"] = True
    out = fw.output_node()
    values = list(out.args[0])
    values[num_fwd_outputs:] = [host if v is a else v for v in values[num_fwd_outputs:]]
    out.args = (type(out.args[0])(values),) + tuple(out.args[1:])
    device = p.meta["val"].device
    p.meta["val"] = host.meta["val"]
    p.meta["fczero_host"] = True
    first = _first_user(p)
    with bw.inserting_before(first):
        fake = fake_mode_of(bw) or fake_mode_of(fw)
        dest = insert(bw, fake, torch.ops.fczero.reload.default, (p, device), like=first)
        wait = bw.call_function(torch.ops.fczero.reload_wait.default, (dest,))
        wait.meta["val"] = None
    p.replace_all_uses_with(dest, delete_user_cb=lambda user: user is not dest)
    # ``a`` must outlive the copy that reads it: a wait that takes it, after its last use
    pos = position(fw)
    users = [u for u in a.users if u is not host and u.op != "output"]
    with fw.inserting_after(max([*users, host], key=pos.__getitem__)):
        keep = fw.call_function(torch.ops.fczero.offload_wait.default, (host, a))
        keep.meta["val"] = None
    return dest


def _delay_offload_waits(fw: fx.Graph, budget: int | None) -> int:
    """Move each offload's wait after the next offload, so the copy has a layer's compute
    to hide behind, where the budget allows (the source lives that much longer)."""
    wait_op = torch.ops.fczero.offload_wait.default
    offloads = [n for n in fw.nodes if n.target is torch.ops.fczero.offload.default]
    delayed = 0
    for cur, nxt in pairwise(offloads):
        wait = next(u for u in cur.users if u.target is wait_op)
        pos = position(fw)
        if pos[wait] > pos[nxt]:
            continue
        before = wait.prev
        nxt.append(wait)
        if budget is not None and planned_peak(fw) > budget:
            before.append(wait)
            continue
        delayed += 1
    return delayed


def _hoist_reloads(bw: fx.Graph, reloads: list[fx.Node], budget: int | None) -> int:
    """Issue each reload before the first use of the previous one, within the budget."""
    pos = position(bw)
    reloads = sorted(reloads, key=pos.__getitem__)
    hoisted = 0
    for prev, cur in pairwise(reloads):
        wait_prev = next(u for u in prev.users if u.target is torch.ops.fczero.reload_wait.default)
        anchor = wait_prev  # the previous activation's wait: its first use follows
        before = cur.prev
        anchor.prepend(cur)
        if budget is not None and planned_peak(bw) > budget:
            before.append(cur)  # undo: this reload stays next to its use
            continue
        hoisted += 1
    return hoisted


def offload_activations(
    fw_gm: fx.GraphModule,
    bw_gm: fx.GraphModule,
    num_fwd_outputs: int,
    *,
    mode: str,
    min_bytes: int,
    budget: int | None,
) -> ActivationPlan:
    """Offload saved activations from ``fw_gm`` to ``bw_gm`` (both rewritten in place)."""
    if mode not in MODES:
        raise ValueError(f"fczero: activation_offload={mode!r}; use one of {MODES}.")
    fw, bw = fw_gm.graph, bw_gm.graph
    plan = ActivationPlan(mode, budget, min_bytes, _device_type(fw))
    plan.curve_before = _curves(fw, bw)
    plan.forward_peak = max(plan.curve_before[0], default=0)
    plan.backward_peak = max(plan.curve_before[1], default=0)
    plan.peak_before = plan.peak_after = max(plan.forward_peak, plan.backward_peak)
    plan.curve_after = plan.curve_before
    if mode == "off":
        return plan
    candidates = []
    for a, p in _saved_pairs(fw, bw, num_fwd_outputs):
        why = _why_not(a, min_bytes)
        if why is None and not p.users:
            why = "not read in backward"
        if why is None:
            candidates.append((a, p))
        elif a.op == "call_function":
            plan.kept.append((a.name, nbytes(a), why))
    candidates.sort(key=lambda pair: (-nbytes(pair[0]), pair[0].name))
    reloads = []
    for a, p in candidates:
        peak = max(planned_peak(fw), planned_peak(bw))
        if mode == "auto" and (budget is None or peak <= budget):
            plan.kept.append((a.name, nbytes(a), "the planned peak is within the budget"))
            continue
        reloads.append(_offload_one(fw, bw, a, p, num_fwd_outputs))
        plan.offloaded.append((a.name, nbytes(a)))
    peak = max(planned_peak(fw), planned_peak(bw))
    if mode == "auto" and budget is not None and peak > budget:
        raise ValueError(
            f"fczero: memory_budget={budget} bytes is below what this graph needs even with "
            f"every saved activation offloaded: at least {peak} bytes "
            f"({peak / 2**20:.1f} MiB). Raise memory_budget to {peak} or more, or shrink "
            "the micro-batch."
        )
    if reloads:
        plan.hoisted = _hoist_reloads(bw, reloads, budget)
        plan.delayed = _delay_offload_waits(fw, budget)
    fw.lint()
    bw.lint()
    fw_gm.recompile()
    bw_gm.recompile()
    plan.curve_after = _curves(fw, bw)
    plan.forward_peak = max(plan.curve_after[0], default=0)
    plan.backward_peak = max(plan.curve_after[1], default=0)
    plan.peak_after = max(plan.forward_peak, plan.backward_peak)
    logger.info(
        "activation offload (%s): %d tensors (%.1f MiB) to host memory, %d kept; planned peak "
        "%.1f -> %.1f MiB",
        mode,
        len(plan.offloaded),
        sum(b for _, b in plan.offloaded) / 2**20,
        len(plan.kept),
        plan.peak_before / 2**20,
        plan.peak_after / 2**20,
    )
    return plan
