"""Bucketing of all-reduces (stage 1's grads, HSDP's replicate-group grads): one per bucket.

Under ``torch.compile`` stage 1 all-reduces each param's whole grad. Like the
reduce-scatters in ``bucketing.py``, the all-reduces of one block (same group and
dtype) are merged into one, placed where the last of them was (every grad is ready
there), and each member gets its slice back:

    before                                   after
    r1 = all_reduce(g1); w1 = wait(r1)       flat = cat([g1.view(-1), g2.view(-1)])
    r2 = all_reduce(g2); w2 = wait(r2)       r = all_reduce(flat); w = wait(r)
                                             w1 = w[:n1].view(shape1)
                                             w2 = w[n1:].view(shape2)

Buckets come from ``bucketing.plan_collective_buckets`` (program order, whole blocks, at most
``bucket_bytes``), which reads shapes and module paths only: every rank forms the same.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from fczero.comm.graph_ops import op_name
from fczero.passes.bucketing import bucket_collectives, flatten_inputs, hand_out, slices
from fczero.passes.graph_utils import c10d, insert, position
from fczero.passes.matching import Collective, only_wait

logger = logging.getLogger("fczero")


def find_all_reduces(graph: fx.Graph, groups: set[str]) -> list[Collective]:
    """Summing all-reduces on one of the given groups whose only user is their wait."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or op_name(node) != "all_reduce":
            continue
        _, op, name = node.args[:3]
        wait = only_wait(node)
        if name in groups and op == "sum" and wait is not None:
            found.append(Collective(node, wait, 0, name, []))
    return found


def bucket_all_reduces_pass(
    gm: fx.GraphModule, groups: set[str], bucket_bytes: int
) -> fx.GraphModule:
    return bucket_collectives(
        gm, find_all_reduces(gm.graph, groups), bucket_bytes, _merge_all_reduces, "all-reduces"
    )


def _merge_all_reduces(graph: fx.Graph, fake_mode, bucket: list[Collective]) -> None:
    pos = position(graph)
    last = max(bucket, key=lambda c: pos[c.node]).node  # every grad is ready here
    with graph.inserting_before(last):
        flat, sizes = flatten_inputs(graph, fake_mode, bucket, like=last)
        reduced = insert(
            graph,
            fake_mode,
            c10d.all_reduce.default,
            (flat, "sum", bucket[0].group_name),
            like=last,
        )
        wait = insert(graph, fake_mode, c10d.wait_tensor.default, (reduced,), like=last)
        hand_out(graph, fake_mode, bucket, slices(graph, fake_mode, wait, bucket, sizes))
