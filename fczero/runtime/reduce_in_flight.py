"""Eager reduce-scatters left in flight: a bucket's grads reach their params one bucket later.

[Note: a reduce-scatter in flight]
An eager bucket's backward (``eager_buckets``) reduce-scatters its members' grads. Waiting
for that reduce-scatter where it is issued makes the compute stream wait for it, so the
next block's backward kernels queue behind it and every reduce-scatter is exposed: on
2 x H200 with Hugging Face's Llama at 3B, each block compiled on its own, that was about
30 ms of a 286 ms step.

So the bucket's node issues the reduce-scatter, returns no grad to autograd, and leaves
the reduced shard here. When the next bucket's reduce-scatter has been issued (the block
before it has computed its grads meanwhile), or when backward ends (a callback on the
autograd engine), the compute stream waits for it and each member's grad is handed to
its param, as the leaf's ``AccumulateGrad`` and hook would have: set where the param
has none, added where it has one. Nothing reads the reduced shard before that wait, and
at most two reduce-scatters' inputs are alive at once (each is held by its collective
until waited).

Only waits move; every rank issues the same reduce-scatters in the same order. Under
HSDP the reduce-scatter is followed by an all-reduce over the replicas, which needs its
result, so those buckets still wait at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from fczero.comm import collectives
from fczero.core.spec import sharded_grad
from fczero.core.state import leaf_state

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


class _InFlight(NamedTuple):
    reduced: torch.Tensor  # this rank's reduced rows of the bucket
    waited: bool  # (over gloo a collective is waited where it is issued)
    pieces: Callable[[torch.Tensor], list[torch.Tensor]]  # its rows per member
    members: Sequence[torch.Tensor]  # what the bucket differentiated: leaves or params


_pending: list[_InFlight] = []  # (per process: backward runs one graph task at a time)


def reduce_later(
    flat: torch.Tensor,
    group_size: int,
    group_name: str,
    pieces: Callable[[torch.Tensor], list[torch.Tensor]],
    members: Sequence[torch.Tensor],
) -> None:
    """Issue the reduce-scatter of ``flat`` (summed; each rank keeps its slice) and hand
    ``pieces(reduced)[k]`` to ``members[k]``'s param once it is waited (see the note)."""
    reduced, waited = collectives.reduce_scatter_sum_in_flight(flat, group_size, group_name)
    earlier = list(_pending)
    _pending[:] = [_InFlight(reduced, waited, pieces, members)]
    if not earlier:
        torch.autograd.Variable._execution_engine.queue_callback(flush)
    for bucket in earlier:
        _deliver(bucket)


def flush() -> None:
    """Wait for every reduce-scatter left in flight and hand over its grads (backward's end)."""
    earlier = list(_pending)
    _pending.clear()
    for bucket in earlier:
        _deliver(bucket)


def _deliver(bucket: _InFlight) -> None:
    reduced = bucket.reduced if bucket.waited else collectives.wait(bucket.reduced)
    for member, grad in zip(bucket.members, bucket.pieces(reduced)):
        if member.requires_grad:
            _accumulate(member, grad)


def _accumulate(member: torch.Tensor, grad: torch.Tensor) -> None:
    """``grad`` (this rank's rows) into the param ``member`` stands for, as autograd would."""
    if isinstance(member, DTensor):
        param = member
    else:
        state = leaf_state(member)
        if state is None:  # (the model is gone)
            return
        param = state.param
    held = param.grad
    if held is None:
        param.grad = sharded_grad(grad, param._spec)
    else:  # accumulated over steps without zero_grad, as AccumulateGrad would
        held._local_tensor.add_(grad)
