"""Eager bucketing (``fczero/runtime/eager_buckets.py``): from the second forward on, consecutive
gathers go out as one all-gather and their grads come back through one reduce-scatter,
with numerics unchanged."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.core.state import module_state, root_state
from fczero.runtime import eager_buckets, prefetch
from fczero.testing import parity
from fczero.testing.comm import CollectiveLog
from fczero.testing.distributed import run_on_ranks
from tests.models import ThreeBlocks, UnevenTiedMLP, block_batches, tiny_llama, token_batches

BLOCK = (512 * 512 + 512) * 4  # one ThreeBlocks block (weight + bias), fp32


def _step_log(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    x = torch.randn(4, 512, requires_grad=True)
    with CollectiveLog() as fwd:
        loss = model(x).sum()
    with CollectiveLog() as bwd:
        loss.backward()
    return fwd.ops, bwd.ops


@pytest.mark.parametrize(
    ("bucket_bytes", "forward", "reduces", "regathers"),
    [
        (128 * 2**20, 1, 1, 1),  # the default: the whole (3 MiB) model in one bucket
        (BLOCK + 16384, 3, 3, 3),  # a block each; the head (16 KiB) joins blocks.2
        (BLOCK - 1, 6, 6, 4),  # a weight and its bias no longer fit: only blocks.2.bias + head
    ],
)
def test_collectives_per_bucket(fake_pg, bucket_bytes, forward, reduces, regathers):
    """Backward regathers the 4 saved weights (blocks.0-2, head: bucketed along the saved
    order, from the first step); forward gathers and reduces are bucketed from the second."""
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(bucket_bytes=bucket_bytes))
    first_fwd, first_bwd = _step_log(model)  # records the order: one gather per param
    assert first_fwd.count("all_gather_into_tensor") == 7
    assert first_bwd.count("reduce_scatter_tensor") == 7
    assert first_bwd.count("all_gather_into_tensor") == regathers
    for _ in range(2):
        fwd, bwd = _step_log(model)
        assert fwd.count("all_gather_into_tensor") == forward
        assert bwd.count("reduce_scatter_tensor") == reduces
        assert bwd.count("all_gather_into_tensor") == regathers


def test_no_buckets_without_prefetch_or_bucket_bytes(fake_pg):
    for options in (fczero.CommPolicy(prefetch=0), fczero.CommPolicy(bucket_bytes=0)):
        model = fczero.parallelize(
            ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=options
        )
        _step_log(model)
        fwd, bwd = _step_log(model)
        assert fwd.count("all_gather_into_tensor") == 7, options
        assert bwd.count("reduce_scatter_tensor") == 7, options
        assert bwd.count("all_gather_into_tensor") == 4, options


def test_plan_follows_bytes_and_leaves_checkpointed_gathers_alone(fake_pg):
    """UnevenTiedMLP's recorded gathers: inp.weight (260 bytes), inp.bias (52),
    hidden.weight (364), hidden.bias (28), frozen.weight (196), out.weight (140), out.bias
    (20), back.weight (the tied inp.weight again, 260). The 0-d ``scale`` is replicated,
    never gathered, so it is not in the order."""
    model = fczero.parallelize(UnevenTiedMLP(), init_device_mesh("cpu", (2,)))
    model(torch.randn(4, 5)).sum().backward()
    order = root_state(model).prefetch.order
    assert [spec.unsharded_bytes(p) for spec, p, _ in order] == [260, 52, 364, 28, 196, 140, 20, 260]
    assert eager_buckets.plan(order, 10**9) == [list(range(8))]
    # 312 bytes: runs close when the next gather would not fit; runs of one are no bucket
    assert eager_buckets.plan(order, 312) == [[0, 1], [3, 4], [5, 6]]
    in_place = [(s, p, i == 4) for i, (s, p, _) in enumerate(order)]  # a checkpointed gather
    assert eager_buckets.plan(in_place, 10**9) == [[0, 1, 2, 3], [5, 6, 7]]
    assert eager_buckets.plan(order, 1) == []


def _train(rank: int, world_size: int) -> list[parity.Trace]:
    small = {"comm_policy": fczero.CommPolicy(bucket_bytes=700)}  # cuts inside modules: many buckets of 2-3 gathers
    return [
        parity.train_parallel(rank, world_size, UnevenTiedMLP, _mlp_batches(), parity.mse),
        parity.train_parallel(rank, world_size, UnevenTiedMLP, _mlp_batches(), parity.mse, **small),
        parity.train_parallel(
            rank, world_size, tiny_llama, token_batches(steps=4), parity.cross_entropy,
            optimizer="adamw", lr=1e-3, comm_policy=fczero.CommPolicy(bucket_bytes=40_000),
        ),  # fmt: skip
        parity.train_parallel(rank, world_size, ThreeBlocks, block_batches(steps=4), parity.mse),
    ]


def _mlp_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 5, generator=g), torch.randn(8, 13, generator=g)) for _ in range(4)]


def test_bucketed_training_matches_the_reference():
    """Four steps (three of them bucketed) on 2 gloo ranks: uneven shards, a tied weight,
    a 0-d and a frozen param, buckets cut inside modules, Llama with AdamW."""
    mlp, mlp_small, llama, blocks = run_on_ranks(_train, 2)[0]
    expected_mlp = parity.train_reference(UnevenTiedMLP, _mlp_batches(), parity.mse)
    parity.assert_close(mlp, expected_mlp, rtol=1e-5, atol=1e-6)
    parity.assert_close(mlp_small, expected_mlp, rtol=1e-5, atol=1e-6)
    expected = parity.train_reference(
        tiny_llama, token_batches(steps=4), parity.cross_entropy, optimizer="adamw", lr=1e-3
    )
    parity.assert_close(llama, expected, rtol=1e-5, atol=1e-6)
    expected = parity.train_reference(ThreeBlocks, block_batches(steps=4), parity.mse)
    parity.assert_close(blocks, expected, rtol=1e-5, atol=1e-6)


def test_bucket_members_are_plain_slices_waited_by_their_consumer(fake_pg):
    """[Note: plain bucket slices]: on an asynchronous group a bucket's members are plain
    slices of the one all-gather; whichever member is waited first waits for the
    collective, and nothing stays pending once every member was handed off."""
    from fczero.comm.collectives import wait_on
    from fczero.testing.distributed import pending_collectives

    def hand_off(spec, param, piece):  # what eager prefetch does with a bucket's member
        return prefetch.hand_over(spec, param, eager_buckets.unsharded(spec, piece))

    model = fczero.parallelize(ThreeBlocks(dim=64), init_device_mesh("cpu", (2,)))
    members = [
        (state.spec, model.blocks[0]._parameters[name])
        for name, state in module_state(model.blocks[0]).params.items()
    ]
    before = pending_collectives()
    with CollectiveLog() as log:
        pieces = eager_buckets.gather_bucket(members)
    assert log.count("all_gather_into_tensor") == 1
    assert all(type(p) is torch.Tensor for p in pieces)  # no subclass dispatch per op
    assert pending_collectives() == before + 1
    wait_on(pieces[-1])  # the last member first: it waits for the bucket's collective
    assert pending_collectives() == before
    for spec, param in members:
        full = hand_off(spec, param, pieces.pop(0))
        assert full.shape == spec.shape
    assert pending_collectives() == before
    pieces = eager_buckets.gather_bucket(members)  # handed off at once: waited there
    hand_off(*members[0], pieces[0])
    assert pending_collectives() == before
