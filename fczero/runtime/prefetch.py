"""Eager prefetch: the gather of the next params is in flight while this module computes.

The first eager forward of a parallelized root records the order in which params
are gathered (every rank runs the same code, so every rank records the same order).
Later forwards replay it: when the n-th gather is asked for, the gathers that follow
it are issued too, up to ``window`` bytes of unsharded params ahead; each returns an
``AsyncCollectiveTensor`` at once, so the all-gather runs on the communication
stream while the current module computes; it is waited when handed to the module.

If a forward asks for params in another order than recorded (a data-dependent
branch), prefetching stops for that forward and the order is recorded anew.

Replayed gathers are bucketed (``fczero.runtime.eager_buckets``): consecutive gathers up to
``bucket_bytes`` go out as one all-gather, and their grads come back through one
reduce-scatter.

Gathers inside a selective activation-checkpointing region are never prefetched nor
issue others: selective checkpointing records the ops a region runs in forward and
expects the same ops when backward recomputes it, where nothing is prefetched. Such
gathers are marked in the recorded order and run in place.

One forward's prefetch, reshard scope and collective log travel together in an
``EagerContext``, which the root's forward hooks open and close (``enter_forward``,
``exit_forward``: [Note: the eager context of a forward]); every eager read of a sharded
param goes through ``gather_eagerly``, which finds it on the param's root.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple, cast

import torch

from fczero.comm import collectives, consistency
from fczero.core.spec import eager_local, local_shard
from fczero.core.state import EagerForward, GatherOrder
from fczero.runtime import eager_buckets, recompute, resharding

if TYPE_CHECKING:
    from fczero.core.spec import ShardSpec
    from fczero.core.state import ParamState, RootState

logger = logging.getLogger("fczero")

# One recorded gather: the param's spec, the param, and whether it ran inside a
# selective-checkpoint region (then it is never prefetched; see the module docstring).
Recorded = tuple["ShardSpec", torch.Tensor, bool]


class _Member(NamedTuple):
    """A prefetched gather that is one member of an issued bucket."""

    bucket: eager_buckets.Bucket
    index: int


class EagerPrefetch(GatherOrder):
    """A root's gather order (the record it extends) and the replay of one forward's
    gathers: the prefetched ones, and where the forward stands in the order."""

    def __init__(self, window: int, bucket_bytes: int = 0) -> None:
        super().__init__(window, bucket_bytes)
        # the regather buckets of backward, kept from one reshard scope to the next
        self.regather_plans = resharding.RegatherPlans(bucket_bytes)
        # this forward's gathers where they part from ``order`` (None while they follow it)
        self._seen: list[Recorded] | None = None
        self._ready: dict[int, torch.Tensor | _Member] = {}  # issued ahead, not handed over
        self._cursor = 0
        self._issued = 0
        self._ahead = 0  # unsharded bytes issued ahead and not handed over yet
        self._replaying = False

    def start(self) -> None:
        self._seen = None if self.order is not None else []
        self._ready, self._cursor, self._issued, self._ahead = {}, 0, 0, 0
        self._replaying = self.order is not None and self.window > 0

    def gather(self, spec: ShardSpec, param: torch.Tensor, context: EagerContext) -> torch.Tensor:
        n = self._cursor
        self._cursor += 1
        in_place = recompute.in_selective_checkpoint()
        self._record(n, spec, param, in_place)
        if in_place or not self._replaying:
            return context.gather_now(spec, param)
        if self._seen is not None:  # (``_record``: this forward left the order by gather n)
            logger.info(
                "fczero: gather order changed at gather %d; eager prefetch off this step", n
            )
            self._replaying = False  # what was prefetched belongs to other gathers: never use it
            return context.gather_now(spec, param)
        if n in self.bucket_of and n not in self._ready:
            self._issue(n, context)  # the first member of a bucket not issued yet
        ready = self._ready.pop(n, None)
        if ready is None:
            full = context.gather_now(spec, param)
        else:
            self._ahead -= self.sizes[n]
            if isinstance(ready, _Member):
                full = context.hand_over(spec, param, ready.bucket.member(ready.index))
            else:
                full = ready
        self._issue_ahead(n, context)
        return full

    def _record(self, n: int, spec: ShardSpec, param: torch.Tensor, in_place: bool) -> None:
        """Note the n-th gather. A forward that repeats the recorded order builds nothing
        (no tuple per gather per step for the garbage collector to track); the first gather
        that differs starts a new order, from a copy of what came before it."""
        if self._seen is None:
            order = self.order
            if n < len(order):
                was_spec, was_param, was_in_place = order[n]
                if was_param is param and was_spec is spec and was_in_place == in_place:
                    return
            self._seen = order[:n]
        self._seen.append((spec, param, in_place))

    def _issue(self, j: int, context: EagerContext) -> int:
        """Issue the j-th gather, or its whole bucket; returns the next position after it."""
        bucket = self.bucket_of.get(j)
        if bucket is None:
            spec, param, _ = self.order[j]
            self._ready[j] = context.gather_now(spec, param)
            self._ahead += self.sizes[j]
            return j + 1
        issued = eager_buckets.gather_bucket([(self.order[i][0], self.order[i][1]) for i in bucket])
        for k, i in enumerate(bucket):
            self._ready[i] = _Member(issued, k)
            self._ahead += self.sizes[i]
        return bucket[-1] + 1

    def _issue_ahead(self, n: int, context: EagerContext) -> None:
        """Issue the gathers after the n-th while they fit in the window (at least one),
        and the rest of a unit whose first gathers are issued.

        [Note: the next unit goes out whole]
        A unit asks for all its params when its forward begins, so a unit larger than the
        window (two buckets of Hugging Face's 3B Llama block: 192 MiB against 128) would
        issue its second bucket there and wait for it at once. In regime R with each block
        compiled that left half a block's all-gather exposed per block. So once a unit's
        first bucket is issued ahead, the rest of that unit goes out with it: in flight
        are at most the window and one unit, as FSDP2 prefetches the next block whole."""
        issue_bytes = self.issue_bytes
        ahead = self._ahead  # what _ready holds: every position in it is after n
        j = max(self._issued, n + 1)
        while j < len(self.order):
            if self.order[j][2] or j in self._ready:  # in place; or issued with its bucket
                j += 1
                continue
            size = issue_bytes[j]
            if not (eager_buckets.fits(ahead, size, self.window) or self.unit_goes_on[j]):
                break
            j = self._issue(j, context)
            ahead += size
        self._issued = j

    def finish(self) -> None:
        """End of forward: keep the order seen; wait for (and drop) unused prefetches."""
        if self._cursor and (self._seen is not None or self._cursor < len(self.order)):
            # a new order, or one that ended early: keep it and plan its buckets
            self.order = self._seen if self._seen is not None else self.order[: self._cursor]
            self.sizes = [spec.unsharded_bytes(param) for spec, param, _ in self.order]
            self.bucket_of, self.issue_bytes = eager_buckets.positions(
                self.order, self.bucket_bytes, self.sizes
            )
            self.unit_goes_on = eager_buckets.unit_goes_on(self.order)
        for ready in self._ready.values():
            if isinstance(ready, _Member):
                ready.bucket.settle()
            else:
                collectives.settle(ready)
        self._ready, self._seen, self._replaying = {}, None, False


class EagerContext(EagerForward):
    """What one eager forward of a parallelized root runs in: the record it extends (the
    root, the collective log of a checked forward, the params held to the end), the root's
    ``EagerPrefetch`` and the reshard scope of this forward (stage 3 that frees params
    after forward; else None).

    The root's forward pre-hook makes one and ``open``s it; its forward hook ``close``s it,
    also when the forward raised. A root whose forward starts inside an open context's
    forward (it is called from another root's forward) joins that context instead of
    making its own (``find_open``), so the outermost root's prefetch and scope serve both.
    Each param's state reaches the context through its root (``fczero.core.state``)."""

    def __init__(
        self,
        owner: RootState,
        prefetch: EagerPrefetch,
        scope: resharding.ReshardScope | None = None,
        log: consistency.EagerLog | None = None,
    ) -> None:
        super().__init__(owner, log)
        self.prefetch = prefetch
        self.scope = scope

    def open(self) -> None:
        self.prefetch.start()
        if self.scope is not None:
            self.scope.open(self)
        if self.log is not None:
            self.log.start()

    def close(self, raised: bool) -> None:
        """End of the owner's forward: drop unused prefetches, remove the reshard hooks and
        (unless the forward raised: that error goes up) compare the gathers across ranks."""
        for state in self.held:
            state.current = None
        self.held = []
        try:
            self.prefetch.finish()
        finally:
            if self.scope is not None:
                self.scope.close()
        if self.log is not None and not raised:
            self.log.finish()

    def gather(self, spec: ShardSpec, param: torch.Tensor) -> torch.Tensor:
        """The eager gather of a sharded param with rows: issued now (or earlier, when the
        prefetch issued it ahead) and waited here, as it is handed to the module. A checked
        forward compares it across ranks first (checking turns the prefetch off)."""
        if self.log is not None:
            self.log.note(spec.shape, spec.param_dtype, param)
        return collectives.settle(self.prefetch.gather(spec, param, self))

    def gather_now(self, spec: ShardSpec, param: torch.Tensor) -> torch.Tensor:
        return self.hand_over(spec, param, spec.gather(eager_local(param)))

    def hand_over(self, spec: ShardSpec, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """An eager gather on its way to the module: (stage 3) recorded so that saving it packs a recipe (``fczero.runtime.resharding``)."""
        if not spec.keep_unsharded:
            self.register(full, spec, param)
        return full

    def register(self, full: torch.Tensor, spec: ShardSpec, param: torch.Tensor) -> None:
        """Saved views of ``full`` regather in backward (when this forward reshards)."""
        if self.scope is not None:
            self.scope.register(full, spec, param)


def gather_eagerly(state: ParamState, param: torch.Tensor) -> torch.Tensor:
    """An eager read's gather of sharded ``param`` (the module getter's, outside compiled
    graphs): through the eager context of the param's root's running forward (its
    prefetch, reshard scope and log), or alone outside one (activation checkpointing's
    recompute in backward, a submodule called outside its root's forward). A plain tensor,
    or for a tensor-parallel param the tensor-parallel DTensor (``fczero.comm.meshes``)."""
    spec = state.spec
    if spec.is_scalar:
        return spec.gather_scalar(local_shard(param))
    param = state.differentiated(param)
    context = running(state.root)
    if context is not None:
        full = context.gather(spec, param)
    else:
        full = collectives.settle(spec.gather(eager_local(param)))
    return full if spec.tensor_parallel is None else spec.tensor_parallel.wrap(full)


def running(root: RootState) -> EagerContext | None:
    """The context of ``root``'s running eager forward (None between forwards): an
    ``EagerContext``, the only kind ``enter_forward`` puts on ``RootState.forwards``."""
    return cast("EagerContext | None", root.context)


def prefetch_of(root: RootState) -> EagerPrefetch:
    """``root``'s gather order as the runtime runs it: the ``EagerPrefetch`` that
    ``parallelize`` gives every root."""
    return cast(EagerPrefetch, root.prefetch)


def find_open() -> EagerContext | None:
    """The context of the forward running around this point, found through its reshard
    scope, the innermost saved-tensor hooks (None: no root that reshards is running, or
    something installed hooks of its own inside its forward)."""
    scope = resharding.open_scope()
    owner = scope.owner if scope is not None else None
    return owner if isinstance(owner, EagerContext) else None


def enter_forward(root: RootState) -> None:
    """A root's eager forward starts: open its context, or join the one running.

    [Note: the eager context of a forward]
    The eager runtime a gather goes through belongs to the forward that is running: the
    root's forward pre-hook calls ``enter_forward`` (here), which opens an ``EagerContext``
    with the root's prefetch, a fresh reshard scope (stage 3 that
    frees params after forward) and its collective log (``check_policy``), and pushes it
    on its ``RootState.forwards``; the forward hook calls ``exit_forward``, which pops and closes it,
    also when the forward raised. Each param's getter reaches it as
    ``ParamState.root.context``: no gather looks anywhere else, so two models never meet.
    
    A root whose forward starts while another root's forward is running (one calls the
    other) joins the outer context instead of opening its own, as one forward: the
    outermost root's prefetch records and replays both, its scope frees both, and a checked
    inner root logs its gathers there while the outer root logs none. The outer context is
    found through torch's own per-thread stack of saved-tensor hooks, where its reshard
    scope is the innermost (``find_open``); an outer root that reshards nothing
    installs no hooks, and the inner root then opens a context of its own. A root that
    calls itself joins its own context.
    """
    context = find_open()
    opened = context is None
    if opened:
        prefetch = prefetch_of(root)
        scope = None
        if root.options.selective_unsharding:  # stages 1/2 gather nothing
            scope = resharding.ReshardScope(prefetch.window, prefetch.regather_plans)
        context = EagerContext(root, prefetch, scope, root.eager_log)
    logs = not opened and context.log is None and root.eager_log is not None
    if logs:  # checked, inside a forward that is not: log the gathers from here on
        context.log = root.eager_log
    root.forwards.append((context, opened, logs))
    if opened:
        context.open()
    elif logs:
        context.log.start()


def exit_forward(root: RootState, raised: bool) -> None:
    """A root's eager forward ended (``raised``: by an exception): close what it opened."""
    if not root.forwards:
        return  # (its pre-hook never ran: an earlier hook raised)
    record, opened, logs = root.forwards.pop()
    context = cast(EagerContext, record)  # (what enter_forward pushed)
    if opened:
        context.close(raised)
    elif logs:
        context.log = None
        if not raised:
            root.eager_log.finish()
