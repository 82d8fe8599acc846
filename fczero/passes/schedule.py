"""Scheduling: issue gathers early (prefetch) and ahead of reduces, wait for collectives late.

After bucketing, a gather bucket is an *issue group* (the casts and concatenation of
its shards, then the all-gather) and a *copy-out group* (the wait, then the views
and copies that hand each param to its users). Two rewrites, in this order, and a
third that only reorders issues ([Note: a gather never queues behind a reduce]):

``sink_waits_pass`` moves each copy-out group down to just before the first node
that uses a param (and the issue group down to just before it: a unit's gathers are
traced where the unit begins, and the prefetch pass decides how early they go), and
each reduce-scatter's wait down to just before the next block's first reduce-scatter
is issued (so at most two blocks of full-size gradients are alive; the buckets of one
block, issued back to back, do not wait for each other), or before the first user of
its result:

    ag = all_gather(x); w = wait(ag); mm(a, w)      ->   ag = all_gather(x); ...; w = wait(ag); mm(a, w)

``prefetch_all_gathers_pass`` moves the issue group of bucket i up to just before
the first compute of bucket i-1 (up to ``prefetch`` buckets ahead), if the memory
model says the bytes the graph allocates (inputs and shard prep left out, as they
differ between ranks when shards are uneven) stay within ``memory_budget`` with the
gathered bucket alive that much longer; otherwise the bucket is gathered where it
is used:

    w0 = wait(ag0); mm(a, w0); ag1 = all_gather(x1); w1 = wait(ag1); mm(b, w1)
 -> w0 = wait(ag0); ag1 = all_gather(x1); mm(a, w0); w1 = wait(ag1); mm(b, w1)

[Note: a gather larger than a bucket]
One bucket of compute ahead hides a gather of about one bucket's bytes. A single param
larger than ``bucket_bytes`` (an embedding table, a head: 788 MB for Llama-3.2-3B's tied
one against 128 MiB buckets) is a bucket of its own and would take several buckets of
compute to hide, so it may be issued ``prefetch * ceil(bytes / bucket_bytes)`` buckets
ahead instead of ``prefetch``, still under ``memory_budget``, trying the farthest first.
On two H200s the tied table, gathered one bucket ahead of the head, left 1.5 ms of its
gather exposed (docs/benchmarks.md, regime R without checkpointing).

[Note: a gather never queues behind a reduce]
A process group runs its collectives one after another, in the order they were issued
(one NCCL stream). In backward a block's reduce-scatters are issued when its grads are
done, which is also where the prefetch pass puts the next block's regather, just behind
them: the regather then waits for the reduce-scatters to finish before it starts, and the
compute that needs it waits too. ``gathers_before_reduces_pass`` moves each reduce-scatter
down past the all-gathers on its group issued before the next bucket's compute begins.
The reduce-scatter is waited a block later, the gather within a bucket. In a profile of
fczero's Llama at 3B with each block checkpointed (2 of 4 H200s), 0.2 ms of each of half the
blocks' regathers, and 2.7 ms for the tied table's reduce-scatter at the start of backward,
were exposed this way.

Each decision reads shapes and graph order only, so it is the same on every rank.

``one_in_flight_pass`` runs last, and only on gloo groups: each collective's wait moves
up to just after it, where the collective was issued (see [Note: one gloo collective in
flight] in ``fczero/comm/collectives.py``). Where collectives are issued does not change.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from fczero.comm import collectives
from fczero.comm.graph_ops import collective_group, op_name
from fczero.core.memory import live_bytes, nbytes, peak_bytes
from fczero.passes.graph_utils import in_graph_order, move_before, position, recompile
from fczero.passes.matching import find_gathers, find_reduces

logger = logging.getLogger("fczero")

_COPY_OUT = {"view", "slice", "clone", "_unsafe_view", "alias"}
# constant_pad_nd: a rank whose shard is padded drops the padding rows after the wait, and
# that must not hold its wait where it is, or the ranks would place their waits apart
_REDUCE_TAIL = _COPY_OUT | {"div", "_to_copy", "convert_element_type", "constant_pad_nd"}


def _tail(wait: fx.Node, ops: set[str]) -> list[fx.Node]:
    """``wait`` and the nodes downstream of it that only re-view, copy or scale its result."""
    tail, frontier = [wait], [wait]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "call_function" and op_name(user) in ops and user not in tail:
                inputs = [a for a in user.all_input_nodes]
                if all(a in tail for a in inputs):
                    tail.append(user)
                    frontier.append(user)
    return in_graph_order(tail)


def _first_outside_user(tail: list[fx.Node]) -> fx.Node:
    members = set(tail)
    return min(u for n in tail for u in n.users if u not in members)  # the first in the graph


def _sink_gathers(graph: fx.Graph, groups: set[str]) -> int:
    """Each gather's copy-out group to just before its first use, and its issue group just
    before that: a gather issued where it is used (a unit gathers all its params where its
    forward begins, [Note: units]; the prefetch pass then hoists each as the budget allows)."""
    moved = 0
    for gather in find_gathers(graph, groups):
        tail = _tail(gather.wait, _COPY_OUT)
        if not any(u not in tail for n in tail for u in n.users):
            continue  # nothing uses it (a graph's output counts as a use)
        move_before(tail, _first_outside_user(tail))
        group, at = _issue_group(gather), tail[0]
        members = set(group)
        move_before(
            [n for n in group if n < at and all(u in members or u >= at for u in n.users)],
            at,
        )
        moved += 1
    return moved


def sink_gathers_pass(gm: fx.GraphModule, groups: set[str]) -> fx.GraphModule:
    """Before bucketing: every gather where it is used, so buckets follow the order of use
    (a unit's gathers, traced together at its start, would otherwise share one bucket with
    params used much later, such as a head gathered with the embedding)."""
    moved = _sink_gathers(gm.graph, groups)
    gm.graph.lint()
    recompile(gm)
    logger.info("sink_gathers_pass: %d gathers issued where they are used", moved)
    return gm


def sink_waits_pass(gm: fx.GraphModule, groups: set[str]) -> fx.GraphModule:
    graph = gm.graph
    moved = _sink_gathers(graph, groups)
    reduces = find_reduces(graph, groups)
    for i, current in enumerate(reduces):
        following = _next_block(reduces, i)
        tail = _tail(current.wait, _REDUCE_TAIL)
        anchor = _first_outside_user(tail)
        if following is not None and following.node < anchor:
            anchor = _issue_group(following)[0]
        move_before(tail, anchor)
        moved += 1
    graph.lint()
    recompile(gm)
    logger.info("sink_waits_pass: %d waits placed just before their first use", moved)
    return gm


def _next_block(reduces: list, i: int):
    """The first reduce after ``reduces[i]`` that belongs to another block (None if none).
    A block larger than ``bucket_bytes`` goes out as several reduces issued back to back;
    waiting for one just before the next is issued would stall the compute stream for
    the whole of the first (2 x 0.6 ms of each 3B block's 5 ms backward, on 2 x H200)."""
    block = reduces[i].block
    return next((r for r in reduces[i + 1 :] if not block or r.block != block), None)


def _issue_group(c) -> list[fx.Node]:
    """For a gather: its prep and the all-gather; for a reduce: the reduce alone."""
    return [*c.prep, c.node]


def rank_dependent_nodes(graph: fx.Graph, groups: set[str]) -> set[fx.Node]:
    """Graph inputs and shard prep: their sizes differ between ranks when shards are
    uneven, so the memory model leaves them out and every rank decides the same."""
    nodes = {n for n in graph.nodes if n.op == "placeholder"}
    nodes.update(n for g in find_gathers(graph, groups) for n in g.prep)
    return nodes


def allocated_peak(graph: fx.Graph, groups: set[str]) -> int:
    """What ``memory_budget`` is compared with: the graph's peak, rank-dependent nodes left out."""
    return peak_bytes(graph, rank_dependent_nodes(graph, groups))


def prefetch_all_gathers_pass(
    gm: fx.GraphModule,
    groups: set[str],
    prefetch: int,
    memory_budget: int | None,
    warned: set[str] | None = None,
    bucket_bytes: int = 0,
) -> fx.GraphModule:
    """``warned``: the warnings given under these settings already (``PassSettings.warned``):
    a budget too small to prefetch is said once per settings, not once per graph.
    ``bucket_bytes``: a gather larger than this goes further ahead ([Note: a gather larger
    than a bucket]; 0: never)."""
    graph = gm.graph
    gathers = find_gathers(graph, groups)
    if prefetch <= 0 or len(gathers) < 2:
        return gm
    rank_dependent = rank_dependent_nodes(graph, groups)
    starts = [_compute_start(g) for g in gathers]
    hoisted = refused = 0
    for i in range(1, len(gathers)):
        group = _issue_group(gathers[i])
        gathered = nbytes(gathers[i].node)
        ahead = prefetch * max(1, -(-gathered // bucket_bytes)) if bucket_bytes > 0 else prefetch
        for depth in range(min(ahead, i), 0, -1):
            anchor = starts[i - depth]
            pos = position(graph)
            if pos[anchor] >= pos[group[0]]:
                break  # already issued at least that early
            live = live_bytes(graph, rank_dependent)
            # the gathered bucket is alive from the anchor on (its input is shard prep,
            # which the model leaves out like every rank-dependent node)
            start, stop = pos[anchor], pos[gathers[i].node]
            peak = max(live[start:stop]) + gathered
            if memory_budget is None or peak <= memory_budget:
                move_before([n for n in group if pos[n] > pos[anchor]], anchor)
                hoisted += 1
                break
        else:
            refused += 1
    if hoisted == 0 and refused and "budget" not in (warned or ()):
        if warned is not None:
            warned.add("budget")
        logger.warning(
            "fczero: memory_budget=%s bytes is too small to prefetch any all-gather; "
            "gathering each bucket where it is used",
            memory_budget,
        )
    graph.lint()
    recompile(gm)
    logger.info(
        "prefetch_all_gathers_pass: %d of %d all-gathers issued ahead (%d refused by the budget)",
        hoisted,
        len(gathers),
        refused,
    )
    return gm


def gathers_before_reduces_pass(gm: fx.GraphModule, groups: set[str]) -> fx.GraphModule:
    """Each reduce-scatter issued after the all-gathers on its group that come before the
    next bucket's compute starts ([Note: a gather never queues behind a reduce])."""
    graph = gm.graph
    reduces = find_reduces(graph, groups)
    if not reduces:
        return gm  # (a forward graph)
    gathers = [g for g in find_gathers(graph, groups) if _used(g)]
    starts = in_graph_order({_compute_start(g) for g in gathers})
    moved = 0
    for reduce in reduces:
        start = next((s for s in starts if s > reduce.node), None)
        if start is None or reduce.wait < start:
            continue
        if any(reduce.node < g.node < start and g.group_name == reduce.group_name for g in gathers):
            move_before([reduce.node], start)
            moved += 1
    graph.lint()
    recompile(gm)
    logger.info("gathers_before_reduces_pass: %d reduce-scatters issued after gathers", moved)
    return gm


def _used(gather) -> bool:
    """Whether anything outside the gather's copy-out reads it (a graph output counts)."""
    tail = _tail(gather.wait, _COPY_OUT)
    return any(u not in tail for n in tail for u in n.users)


def _compute_start(gather) -> fx.Node:
    """Where a gathered bucket's compute starts: the first user of its copy-out group."""
    return _first_outside_user(_tail(gather.wait, _COPY_OUT))


def one_in_flight_pass(gm: fx.GraphModule, groups: set[str]) -> fx.GraphModule:
    """On gloo groups, wait for each collective right after it is issued."""
    serial = {g for g in groups if collectives.one_at_a_time(g)}
    if not serial:
        return gm
    moved = 0
    for node in list(gm.graph.nodes):
        if collective_group(node) not in serial:
            continue
        waits = [u for u in node.users if op_name(u) == "wait_tensor"]
        for wait in waits:
            node.append(wait)
            moved += 1
    gm.graph.lint()
    recompile(gm)
    logger.info("one_in_flight_pass: %d waits moved up to their collective (gloo)", moved)
    return gm
