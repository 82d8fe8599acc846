"""The collective building blocks (fczero/comm/collectives.py) against a hand computation
on 2 gloo ranks: padding, the gather and its backward (the averaged reduce), the waited
all-gather, and the eager c10d collectives."""

from __future__ import annotations

import torch

from fczero.comm import collectives
from fczero.testing.distributed import run_on_ranks


def test_pad_rows_appends_zero_rows_only_when_short():
    t = torch.arange(6.0).reshape(3, 2)
    padded = collectives.pad_rows(t, 5)
    assert padded.shape == (5, 2)
    assert torch.equal(padded[:3], t) and not padded[3:].any()
    assert collectives.pad_rows(t, 3) is t  # nothing to add: the same tensor, no copy
    assert collectives.pad_rows(torch.ones(2), 4).tolist() == [1.0, 1.0, 0.0, 0.0]


def _gather_and_reduce(rank: int, world_size: int) -> tuple:
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    shard = torch.full((2, 3), float(rank + 1), requires_grad=True)
    full = collectives.settle(collectives.gather_shard(shard, world_size, group, None, None))
    # d/d(full) of sum(full * weight): each rank's weight differs, the reduce averages them
    weight = torch.full_like(full, float(10 * (rank + 1)))
    (full * weight).sum().backward()
    waited = collectives.all_gather_waited(torch.tensor([rank]), world_size, group)
    return full.detach(), shard.grad, waited


def test_gather_then_averaged_reduce_on_two_ranks():
    results = run_on_ranks(_gather_and_reduce, 2)
    expected_full = torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)])
    for rank, (full, grad, waited) in enumerate(results):
        assert torch.equal(full, expected_full)
        # mean over ranks of the weights (10 and 20), this rank's rows of it
        assert torch.equal(grad, torch.full((2, 3), 15.0))
        assert waited.tolist() == [0, 1]


def _settle_together(rank: int, world_size: int) -> tuple:
    import torch.distributed as dist

    low = torch.tensor([5 - rank])
    collectives.reduce_in_place(low, dist.ReduceOp.MIN, None)
    first = torch.tensor([float(rank + 7)])
    collectives.broadcast_from_first(first, dist.group.WORLD)
    outcome = collectives.broadcast_object(f"rank {rank}")
    collectives.barrier()
    return low.item(), first.item(), outcome


def test_eager_collectives_settle_one_value_for_every_rank():
    assert run_on_ranks(_settle_together, 2) == [(4, 7.0, "rank 0")] * 2


def test_without_a_process_group_an_object_stays_and_the_barrier_returns():
    assert collectives.broadcast_object([1, 2]) == [1, 2]
    collectives.barrier()
