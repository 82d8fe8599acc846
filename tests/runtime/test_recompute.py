"""Backward's recompute of checkpointed units ([Note: regathers for a recompute] in
fczero/runtime/recompute.py): one all-gather per block, in backward's order, each issued
while the block after it recomputes; nothing left held once backward ends. Parity of the
same models with the one-process reference: tests/e2e/test_numerics.py (gqa-full)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.flop_counter import FlopCounterMode

import fczero
from fczero.comm import collectives
from fczero.models import Llama, LlamaConfig
from fczero.runtime import recompute
from fczero.testing.comm import CollectiveLog

CHECKPOINTED = LlamaConfig(
    vocab_size=64, dim=32, n_layers=4, n_heads=2, ffn_dim=40, checkpointing="full"
)
PARAMS_PER_BLOCK = 9  # two norms, four attention projections, three feed-forward ones


def _backward_events(
    monkeypatch, mode=contextlib.nullcontext, **options
) -> tuple[Llama, list[tuple[str, int]]]:
    """Train two steps of a checkpointed Llama, each under ``mode()``; the second backward's
    events, in order: ``("recompute", i)`` when block i's recompute begins, ``("gather",
    elements)`` for each all-gather issued (a bucket's coalesced one counts once, with its
    members' elements)."""
    torch.manual_seed(0)
    model = fczero.parallelize(Llama(CHECKPOINTED), init_device_mesh("cpu", (2,)), **options)
    events: list[tuple[str, int]] = []
    ops = collectives._c10d

    class Recording:
        def __getattr__(self, name: str):
            return getattr(ops, name)

        def all_gather_into_tensor(self, shard, group_size, group_name):
            if recompute.in_backward():
                events.append(("gather", shard.numel()))
            return ops.all_gather_into_tensor(shard, group_size, group_name)

        def all_gather_into_tensor_coalesced(self, shards, group_size, group_name):
            if recompute.in_backward():  # (an eager bucket: one collective)
                events.append(("gather", sum(shard.numel() for shard in shards)))
            return ops.all_gather_into_tensor_coalesced(shards, group_size, group_name)

    monkeypatch.setattr(collectives, "_c10d", Recording())
    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(
            lambda *_, i=i: events.append(("recompute", i)) if recompute.in_backward() else None
        )
    for _ in range(2):
        events.clear()
        with mode():
            model(torch.randint(0, 64, (2, 8))).float().pow(2).mean().backward()
    return model, events


BLOCKS_IN_BACKWARD = [
    ("recompute", 3), ("gather", "block"), ("gather", "block"),  # block 3's, then block 2's
    ("recompute", 2), ("gather", "block"),  # block 1's, while block 2 recomputes
    ("recompute", 1), ("gather", "block"),
    ("recompute", 0),  # its gather went out during block 1's
]  # fmt: skip


def _named(model: Llama, events: list[tuple[str, int]]) -> list[tuple[str, int | str]]:
    block = sum(p.to_local().numel() for p in model.layers[0].parameters())
    return [(kind, "block" if kind == "gather" and n == block else n) for kind, n in events]


def test_each_recomputed_block_regathers_as_one_bucket_issued_a_block_ahead(fake_pg, monkeypatch):
    model, events = _backward_events(monkeypatch, comm_policy=fczero.CommPolicy(keep_unsharded=0))
    # the head's and the final norm's regathers (saved tensors, not recomputed), then the blocks
    head, norm = model.output.weight.numel() // 2, model.norm.weight.numel() // 2
    assert _named(model, events) == [("gather", head), ("gather", norm), *BLOCKS_IN_BACKWARD]
    root = model.layers[0]._fczero.unit.states[0].root
    assert recompute.ahead_of(root) is None  # nothing prefetched outlives backward


def test_by_default_the_head_stays_gathered_and_the_blocks_regather_ahead(fake_pg, monkeypatch):
    """The default keeps one shard's worth gathered from forward to backward (the head and
    the last half of the blocks on 2 ranks). A checkpointed block saves none of its params,
    so backward's recompute gathers it again all the same, one bucket, a block ahead."""
    model, events = _backward_events(monkeypatch)
    assert _named(model, events) == BLOCKS_IN_BACKWARD


@pytest.mark.parametrize(
    "mode",
    [lambda: FlopCounterMode(display=False), CollectiveLog],
    ids=["FlopCounterMode", "CollectiveLog"],
)
def test_a_dispatch_mode_around_the_step_leaves_the_regathers_as_they_are(
    fake_pg, monkeypatch, mode
):
    """A tool that watches a step through a dispatch mode sees the regathers the step makes
    without one: only a selective checkpoint's own modes send a recompute param by param
    (under any mode, the recompute used to gather its 9 params one by one, each waited for
    at once)."""
    model, events = _backward_events(monkeypatch, mode)
    assert _named(model, events) == BLOCKS_IN_BACKWARD
