"""The gradient side of stages 1 and 2 and of gradient accumulation.

``whole_param`` hands a module a whole param that is already on this rank (stage 1/2:
the kept whole copy; stage 3 while accumulating: a gather made without autograd).
Its backward turns the whole grad into this rank's sharded grad:

    accumulate: the grad (in reduce_dtype) goes to an accumulator leaf, nothing is reduced
    "scatter":  grad (+ what was accumulated) / world -> reduce-scatter -> this rank's rows
    "rows":     grad (+ what was accumulated) / world -> all-reduce -> this rank's rows
    "all":      grad (+ what was accumulated) / world -> all-reduce (0-d params)

In eager mode "rows" (stage 1) goes through ``Reducer``: grads are collected into
buckets of at most ``bucket_bytes``, in a fixed order that every rank computes from
the param list alone (the reverse of registration order, as DDP does, since backward
visits the last layers first). A bucket is all-reduced as soon as every one of its
params has received all the grads its forward uses promised, and only after every
earlier bucket, so every rank issues the same all-reduces in the same order. When
backward ends, the buckets still open are reduced (params that got no grad on this
rank add zeros) and each param's rows are written to its sharded ``.grad``. Under
``torch.compile`` each param's grad is all-reduced in the graph instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Shard

from fczero.comm import collectives
from fczero.comm.buckets import plan_items

logger = logging.getLogger("fczero")



@dataclass(frozen=True)
class Route:
    """How one param's whole grad becomes its sharded grad (constants only: Dynamo-safe)."""

    kind: str  # "scatter", "rows" or "all"
    group_size: int
    group_name: str
    rows_per_rank: int
    local_rows: int
    start: int  # first row this rank holds
    reduce_dtype: torch.dtype
    shard_dtype: torch.dtype
    index: int  # this param's slot in its root's eager Reducer (stage 1), -1 for none


def reduce_whole_grad(grad: torch.Tensor, route: Route) -> torch.Tensor:
    """Averaged reduce of one whole grad (already in reduce_dtype) -> this rank's rows."""
    grad = grad / route.group_size
    if route.kind == "scatter":
        grad = collectives.pad_rows(grad, route.rows_per_rank * route.group_size)
        out = collectives.reduce_scatter_sum(grad, route.group_size, route.group_name)
        if route.local_rows != route.rows_per_rank:
            out = out.narrow(0, 0, route.local_rows)
    elif route.kind == "rows":
        out = collectives.all_reduce_sum(grad, route.group_name)
        out = out.narrow(0, route.start, route.local_rows).clone()  # the whole sum is freed
    else:
        out = collectives.all_reduce_sum(grad, route.group_name)
    return out.to(route.shard_dtype)


class _WholeParam(torch.autograd.Function):
    """Forward: the whole param (no collective). Backward: see the module docstring."""

    @staticmethod
    def forward(ctx, local, whole, acc, pending, route, reducer):  # type: ignore[override]
        ctx.route = route
        ctx.reducer = reducer
        ctx.accumulate = acc is not None
        # an attribute, not a saved tensor: activation checkpointing counts the tensors a
        # region saves, and its recompute in backward, after ``pending`` was consumed, reads
        # the param without it (CheckpointError: "a different number of tensors")
        ctx.pending = pending
        return whole.view_as(whole)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        route: Route = ctx.route
        grad = grad.to(route.reduce_dtype)
        if ctx.accumulate:
            return None, None, grad, None, None, None
        if ctx.pending is not None:
            grad = grad + ctx.pending
        if ctx.reducer is not None:
            ctx.reducer.ready(route.index, grad)
            return None, None, None, None, None, None  # the Reducer writes the sharded .grad
        return reduce_whole_grad(grad, route), None, None, None, None, None


def whole_param(
    local: torch.Tensor,
    whole: torch.Tensor,
    acc: torch.Tensor | None,
    pending: torch.Tensor | None,
    route: Route,
    reducer: Reducer | None = None,
) -> torch.Tensor:
    """``whole`` for forward; backward reduces into ``local``'s grad, or accumulates into
    ``acc.grad`` when ``acc`` is given; ``pending`` (accumulated earlier) joins the reduce.
    ``reducer``: eager stage 1, the root's ``Reducer``, which takes the grad instead (None
    in a compiled graph, which all-reduces each grad itself)."""
    return _WholeParam.apply(local, whole, acc, pending, route, reducer)


class Reducer:
    """Eager stage 1: bucketed, ordered all-reduce of whole grads (see the module docstring)."""

    def __init__(
        self,
        params: list[tuple[DTensor, Route, torch.Size]],
        bucket_bytes: int,
    ) -> None:
        self.params = params  # slot i: (sharded param, route, whole shape)
        self.buckets = _plan(params, bucket_bytes)
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.late: dict[int, torch.Tensor] = {}
        self.uses = [0] * len(params)
        self.grads: list[torch.Tensor | None] = [None] * len(params)
        self.used = [False] * len(params)
        self.launched: list[tuple[int, torch.Tensor]] = []
        self.armed = False

    def expect(self, index: int) -> None:
        """An eager forward read param ``index`` with autograd on: one more grad to await."""
        self.uses[index] += 1
        self.used[index] = True

    def ready(self, index: int, grad: torch.Tensor) -> None:
        if not self.armed:  # first grad of this backward: reduce what is left when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.armed = True
        self.uses[index] -= 1
        self.used[index] = True
        if self.bucket_of[index] < len(self.launched):
            # More grads than this backward's reads announced (e.g. two forwards, then two
            # separate backwards): the bucket is gone, so this grad is reduced at the end.
            slot = self.late.get(index)
            self.late[index] = grad if slot is None else slot + grad
            return
        slot = self.grads[index]
        self.grads[index] = grad if slot is None else slot + grad
        while len(self.launched) < len(self.buckets) and all(
            self.uses[i] <= 0 for i in self.buckets[len(self.launched)]
        ):
            self._launch(len(self.launched))

    def _launch(self, b: int) -> None:
        members = self.buckets[b]
        pieces = []
        for i in members:
            _, route, shape = self.params[i]
            g = self.grads[i]
            if g is None:  # no grad here (maybe on another rank): add zeros
                g = torch.zeros(shape, dtype=route.reduce_dtype, device=self.params[i][0].device)
            pieces.append(g.reshape(-1))
            self.grads[i] = None
        route = self.params[members[0]][1]
        flat = torch.cat(pieces) / route.group_size
        self.launched.append((b, collectives.all_reduce_sum_in_flight(flat, route.group_name)))

    def finish(self) -> None:
        """End of backward: reduce the open buckets in order, write every sharded grad."""
        while len(self.launched) < len(self.buckets):
            self._launch(len(self.launched))
        with torch.no_grad():
            for b, out in self.launched:
                flat = collectives.wait(out)
                offset = 0
                for i in self.buckets[b]:
                    param, route, shape = self.params[i]
                    numel = shape.numel()
                    if self.used[i]:
                        whole = flat[offset : offset + numel].view(shape)
                        rows = whole.narrow(0, route.start, route.local_rows)
                        _add_grad(param, rows.to(route.shard_dtype).clone())
                    offset += numel
            for i in sorted(self.late):  # same arrivals, hence same order, on every rank
                param, route, shape = self.params[i]
                whole = collectives.all_reduce_sum(
                    self.late[i] / route.group_size, route.group_name
                )
                rows = whole.narrow(0, route.start, route.local_rows)
                _add_grad(param, rows.to(route.shard_dtype).clone())
        self.launched, self.armed, self.late = [], False, {}
        self.uses = [0] * len(self.params)
        self.used = [False] * len(self.params)


def _add_grad(param: DTensor, local_grad: torch.Tensor) -> None:
    grad = DTensor.from_local(
        local_grad,
        param.device_mesh,
        [Shard(0)],
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def _plan(params: list[tuple[DTensor, Route, torch.Size]], bucket_bytes: int) -> list[list[int]]:
    """Slots in reverse registration order, cut into buckets of at most ``bucket_bytes``
    (a param larger than the cap gets a bucket of its own); dtypes never mix."""
    order = list(reversed(range(len(params))))
    items = [
        (params[i][1].reduce_dtype, params[i][2].numel() * params[i][1].reduce_dtype.itemsize)
        for i in order
    ]
    return [[order[j] for j in bucket] for bucket in plan_items(items, bucket_bytes)]
