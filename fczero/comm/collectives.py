"""The gather and the reduce: the only module that issues collective ops.

A sharded param becomes an unsharded param through one differentiable step,
``gather_shard``, whose backward is the reduce:

    forward:  shard -> cast(param_dtype) -> all_gather_into_tensor -> wait
    backward: grad  -> cast(reduce_dtype) -> divide by the group size -> reduce_scatter_tensor(sum)
              -> wait -> cast(shard dtype)

Data parallelism averages gradients over ranks. Dividing before the sum lets the
compiler fuse the division into the cast and bucket copy that precede the
reduce-scatter, so the reduced shards come out as plain views (no kernel per param).

HSDP (a replicate axis, see ``fczero.comm.meshes``) adds one step to the backward: the
reduce-scattered shard is summed over the replicate group with an all-reduce, and
the division covers both groups, so the grad is averaged over every rank.

Both directions call ``torch.ops._c10d_functional`` ops, so eager mode returns an
``AsyncCollectiveTensor`` that waits on first use, and a traced graph holds explicit
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` / ``wait_tensor`` nodes that
the compiler can move. A 0-d param cannot be split along dim 0; it is replicated and
its grad is all-reduced instead (``replicate_scalar``).

The last section holds the eager c10d collectives with which ranks decide something
together outside any graph (a minimum headroom, a finite-grad flag, the grad norm, rank
0's value of a replicated param, a checkpoint's outcome).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.distributed_c10d import _resolve_process_group

from fczero.comm.flat import FlatLayout, padded

_c10d = torch.ops._c10d_functional


def tracing() -> bool:
    """True while Dynamo or AOT autograd trace (fake tensors or a proxy mode are active)."""
    if torch.compiler.is_compiling():
        return True
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return True
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def _async(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """In eager, defer the wait to hand-off (or, on gloo, wait now: see
    ``one_at_a_time``); in a traced graph, emit ``wait_tensor``."""
    if tracing() or one_at_a_time(group_name):
        return _c10d.wait_tensor(t)
    return AsyncCollectiveTensor(t)


def one_at_a_time(group_name: str) -> bool:
    """True when an eager collective on this group must be waited before the next is issued.

    [Note: one gloo collective in flight]
    With two ``_c10d_functional`` all-gathers in flight on a gloo group, both waited,
    a 2-rank loop of 3,000 steps aborted in ``malloc`` ("unaligned tcache chunk") or
    failed with a size mismatch in 2 of 8 runs and 5 of 10 (torch 2.13 CPU; keeping the
    inputs alive did not help). Waiting for each before the next never failed. So on
    gloo every eager collective fczero issues is waited at once. Prefetch and the
    stage-1 reducer keep their logic (what is issued, when, and which result is used),
    so CPU tests still exercise it, but nothing overlaps on gloo. NCCL is not affected.
    """
    return backend_of(group_name) == "gloo"


def backend_of(group_name: str) -> str:
    """The backend of the process group named ``group_name`` (``"nccl"``, ``"gloo"``, ...).
    Not cached by name: a name is reused when process groups are destroyed and made again."""
    return dist.get_backend(_resolve_process_group(group_name))


def settle(t: torch.Tensor) -> torch.Tensor:
    """Wait for the collective behind an eager ``AsyncCollectiveTensor`` now; return ``t``.

    The result stays the same autograd-linked tensor; later ops on it do not wait again.
    An eager gather whose result is never used (a param read only for ``.shape``, a
    recompute that checkpointing stops early or serves from its cache) would otherwise
    never be waited: its work stays registered for the life of the process, holding the
    unsharded buffer, and stays in flight beside later collectives (see
    [Note: one gloo collective in flight]). Every eager gather fczero hands to a module
    is settled first.
    """
    if isinstance(t, AsyncCollectiveTensor):
        t.trigger_wait()
    return t


def wait_on(t: torch.Tensor) -> torch.Tensor:
    """Wait (eagerly) for the collective whose plain result is ``t``; return ``t``.

    [Note: plain bucket slices]
    An eager bucket (``fczero.runtime.eager_buckets``) keeps its all-gather's result as a plain
    tensor rather than an ``AsyncCollectiveTensor``, whose every op is a Python
    dispatch, and waits for it once, when its first member is asked for. The collective
    is registered by its result's storage, so ``wait_tensor`` on the result waits for it,
    and a second call finds nothing left to wait. The wait skips autograd: torch
    registers a Python autograd kernel for ``wait_tensor`` (an identity), and a plain
    result needs no grad link.
    """
    wait_all((t,))
    return t


def wait_all(ts: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
    """``wait_on`` for each of ``ts`` (the outputs of one coalesced collective), with one
    check of the tracing state and one trip below autograd for all of them."""
    if tracing():
        return
    with torch._C._AutoDispatchBelowAutograd():
        for t in ts:
            _c10d.wait_tensor(t)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended along dim 0 up to ``rows`` (itself when it has them):
    every rank's shard padded to the same size, so all ranks gather equal elements."""
    pad = rows - t.shape[0]
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, pad]) if pad > 0 else t


def alone(group_size: int) -> bool:
    """Whether a collective over ``group_size`` ranks is skipped here: one rank, in eager.

    [Note: one rank communicates nothing in eager]
    Over a group of one rank an all-gather and a reduce-scatter each return their input,
    yet each call still costs host time: the dispatcher, torch's Python autograd kernel
    for the functional collectives, NCCL's launch and its flight recorder (14-56 us a
    pair on one H100, docs/benchmarks.md, earlier results), and the eager result is an
    ``AsyncCollectiveTensor``. So in eager ``all_gather``, ``all_gather_waited`` and
    ``reduce_scatter_sum`` return their (contiguous) input without a collective, as FSDP2
    does at world size 1; ``_GatherShard`` copies it where it would alias the shard. The
    all-reduces, which know only their group's name (stage 1's reducer, 0-d params, HSDP's
    replicas), are still issued. A traced graph keeps its collectives: the graph passes
    plan them the same way at any world size, and at one rank the in-place pass makes
    each reduce an all-reduce in place (docs/passes.md, pass 7).
    """
    return group_size == 1 and not tracing()


def all_gather(shard: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Concatenate every rank's ``shard`` along dim 0 (asynchronous in eager; over one
    rank in eager ``shard`` itself, contiguous: [Note: one rank communicates nothing in eager])."""
    if alone(group_size):
        return shard.contiguous()
    out = _c10d.all_gather_into_tensor(shard.contiguous(), group_size, group_name)
    return _async(out, group_name)


def all_gather_waited(shard: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Concatenate every rank's ``shard`` along dim 0, waited (a plain tensor)."""
    if alone(group_size):
        return shard.contiguous()
    out = _c10d.all_gather_into_tensor(shard.contiguous(), group_size, group_name)
    return _c10d.wait_tensor(out)


def wait(t: torch.Tensor) -> torch.Tensor:
    """The result of a collective issued earlier, waited."""
    return _c10d.wait_tensor(t)


def reduce_scatter_sum(full: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Sum ``full`` over ranks and keep this rank's dim-0 slice (waited; over one rank
    in eager ``full`` itself, contiguous)."""
    if alone(group_size):
        return full.contiguous()
    out = _c10d.reduce_scatter_tensor(full.contiguous(), "sum", group_size, group_name)
    return _c10d.wait_tensor(out)


def all_gather_coalesced(
    shards: list[torch.Tensor], layouts: tuple[FlatLayout, ...], dtype: torch.dtype,
    group_size: int, group_name: str,
) -> list[torch.Tensor]:
    """Each shard cast to ``dtype``, padded to its rows per rank (``flat.padded``) and
    concatenated over ranks along dim 0, all in one collective
    (``all_gather_into_tensor_coalesced``): plain tensors, left in flight for the caller
    to wait (``wait_all``), waited here on gloo ([Note: one gloo collective in flight]).
    A shard that needs no cast or padding is its own input: nothing writes a shard while
    its gather is in flight. Eager only.

    [Note: coalesced collectives below autograd]
    The eager coalesced collectives are issued below autograd, as ``wait_on`` waits:
    nothing differentiates through them (a bucket's autograd node is its own), and torch
    registers a Python autograd kernel for the functional collectives that every call
    would otherwise pass through. With this and ``wait_all``, a step of a 16-block toy
    with each block compiled (CPU, fake group of 2, ``bench.host_cost``'s model) made
    28,218 Python calls under cProfile, against 30,281 with each call through autograd
    and each wait on its own (and 28,867 with the flat buckets before them)."""
    inputs = padded(shards, layouts, dtype, ranks=1, reuse=True)
    with torch._C._AutoDispatchBelowAutograd():
        outs = _c10d.all_gather_into_tensor_coalesced(inputs, group_size, group_name)
    if one_at_a_time(group_name):
        wait_all(outs)
    return outs


def reduce_scatter_mean_coalesced(
    grads: tuple[torch.Tensor, ...],
    layouts: tuple[FlatLayout, ...],
    dtype: torch.dtype,
    group_size: int,
    group_name: str,
    replicate: tuple[int, str] | None = None,
    *,
    in_flight: bool = True,
) -> list[torch.Tensor]:
    """Each grad's mean over ranks (HSDP: over the replicas too), cast to ``dtype`` and
    padded to ``group_size`` times its rows per rank (``flat.padded``), this rank's dim-0
    slice of each, in one collective (``reduce_scatter_tensor_coalesced``). Eager only.

    With ``in_flight`` and no replicas the results are left in flight for the caller to
    wait (``wait_all``; on gloo they are waited here). On NCCL the collective then
    averages, so no division kernel runs on the compute stream (in regime R's per-block
    profile, 2 x H200, Hugging Face's Llama at 3B, dividing every bucket's fp32 grads
    before their reduce-scatter took 6.1 ms a step), and a grad that needs no cast or
    padding is its own input, since the collective only reads it. Elsewhere (gloo has no
    average), and with replicas, the inputs are copies, divided in place and summed; with
    replicas the sums are waited and summed over the replicas by one coalesced
    all-reduce, as is anything not ``in_flight``."""
    below = torch._C._AutoDispatchBelowAutograd  # ([Note: coalesced collectives below autograd])
    averages = in_flight and replicate is None and backend_of(group_name) == "nccl"
    inputs = padded(grads, layouts, dtype, ranks=group_size, reuse=averages)
    if averages:
        with below():
            return _c10d.reduce_scatter_tensor_coalesced(inputs, "avg", group_size, group_name)
    ranks = _ranks_averaged(group_size, replicate)
    if ranks != 1:
        torch._foreach_div_(inputs, ranks)
    with below():
        outs = _c10d.reduce_scatter_tensor_coalesced(inputs, "sum", group_size, group_name)
    if not in_flight or replicate is not None or one_at_a_time(group_name):
        wait_all(outs)
    if replicate is not None:
        with below():
            outs = _c10d.all_reduce_coalesced(outs, "sum", replicate[1])
        wait_all(outs)
    return outs


class _ReduceInFlight:
    """The reduce-scatters of the last unit whose grads an eager backward reduced, left in
    flight.

    [Note: a reduce-scatter left in flight]
    An eager bucket's backward (``fczero.runtime.eager_buckets``) returns its members'
    grads as views of its reduce-scatter's output before the collective has run. Waiting
    there (``wait_tensor`` puts the wait on the compute stream) held the backward of the
    block before it until the reduce was done: in regime R with each block compiled (2 x
    H200, Hugging Face's Llama at 3B) fczero's exposed communication was 49.0 ms a step
    against FSDP2's 29.0, whose reduce-scatters run beside the next block's backward. So
    the reduces stay in flight, and are waited when a bucket of another unit issues its own
    and, for the last unit, when the backward ends (an autograd engine callback): one
    unit's reduces in flight at a time, as FSDP2 keeps one block's (their inputs, a block's
    grads in the reduce dtype, are freed then). A block of two buckets reduces both at the
    end of its backward (two reduce-scatters 0.5 ms apart in that regime's profile).
    Waiting for the first when the second issued stalled the compute stream for the
    first's whole run: 0.3 ms of each block's backward, 12.2 ms of exposed reduce-scatter
    a step in that regime (2 x H200, torch 2.11). Compiled graphs wait by the same rule
    (``fczero.passes.schedule``: a reduce is waited before the next block's reduces start).
    A bucket in no unit waits for all before it. Every rank waits for the same collectives
    in the same order; a wait orders streams, it does not block the host.

    Nothing reads the grads before their wait: autograd hands each to its leaf without a
    copy, and the leaf's hook (``fczero.core.state``) only wraps it for the param, except
    where it adds it to a grad it accumulates: it waits first (``settle_in_flight``). A
    bucket whose rows are cast waits at once, and so do a backward that builds a graph of
    its grads (``create_graph``) and an HSDP bucket (its all-reduce reads the rows). On
    gloo the collective is waited when issued ([Note: one gloo collective in flight]) and
    the bookkeeping runs as on NCCL.

    One record for the process, not one per thread: autograd may run the engine's final
    callback on another thread than the node that issued the reduce (a device's worker
    thread, or the caller's), and the callback must find the reduce. A wait too early is
    only slower; a missed one would let the optimizer read a grad still being reduced."""

    def __init__(self) -> None:
        self.held: list[torch.Tensor] = []
        self.unit: str | None = None  # the unit whose reduces ``held`` are
        self.task: int | None = None  # the backward (graph task) whose end settles ``held``

    def hold(self, reduced: list[torch.Tensor], unit: str | None) -> None:
        if unit is None or unit != self.unit:
            self._wait_held()
        task = torch._C._current_graph_task_id()
        if task != self.task:  # the first of this backward: settle when it ends at latest
            # (keyed on the backward, not on ``held``: a backward that raised ran no
            # callback and left its last reduces here; the next one must still queue its own)
            torch.autograd.Variable._execution_engine.queue_callback(self.settle)
            self.task = task
        self.held.extend(reduced)
        self.unit = unit

    def _wait_held(self) -> None:
        held = list(self.held)
        self.held.clear()  # (one list for the process's life: nothing is rebound)
        self.unit = None
        wait_all(held)

    def settle(self) -> None:
        self.task = None
        self._wait_held()


_IN_FLIGHT = _ReduceInFlight()


def hold_in_flight(reduced: list[torch.Tensor], unit: str | None) -> None:
    """Leave ``reduced`` (an eager reduce-scatter's outputs, issued in a backward for a
    bucket of ``unit``, None for a bucket in no unit) in flight until a bucket of another
    unit issues its reduce or the backward ends (see the note)."""
    _IN_FLIGHT.hold(reduced, unit)


def settle_in_flight() -> None:
    """Wait now for the reduces left in flight, if any (before a grad is read in backward)."""
    if _IN_FLIGHT.held:
        _IN_FLIGHT.settle()


def all_reduce_sum_in_flight(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """Issue the sum of ``t`` over ranks and leave it in flight for the caller to wait
    (``wait_tensor``); on gloo it is waited here (see ``one_at_a_time``)."""
    out = _c10d.all_reduce(t.contiguous(), "sum", group_name)
    return _c10d.wait_tensor(out) if one_at_a_time(group_name) else out


def all_reduce_sum(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum ``t`` over ranks (waited)."""
    return _c10d.wait_tensor(_c10d.all_reduce(t.contiguous(), "sum", group_name))


def _ranks_averaged(group_size: int, replicate: tuple[int, str] | None) -> int:
    """How many ranks a grad is averaged over: the group's, times the replicas' under HSDP."""
    return group_size * (replicate[0] if replicate else 1)


def _average(
    grad: torch.Tensor, group_size: int, replicate: tuple[int, str] | None
) -> torch.Tensor:
    """The grad's mean over ranks; over one rank the grad itself (a division by one would
    still cost a pass over it in compiled graphs, where Inductor keeps it)."""
    ranks = _ranks_averaged(group_size, replicate)
    return grad / ranks if ranks != 1 else grad


def over_replicas(t: torch.Tensor, replicate: tuple[int, str] | None) -> torch.Tensor:
    return t if replicate is None else all_reduce_sum(t, replicate[1])


def cast_to(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def reduce_dtype_of(grad: torch.Tensor, reduce_dtype: torch.dtype | None) -> torch.dtype:
    return grad.dtype if reduce_dtype is None else reduce_dtype


class _GatherShard(torch.autograd.Function):
    """All-gather in forward, reduce-scatter (averaged) in backward. See the module docstring."""

    @staticmethod
    def forward(ctx, shard, group_size, group_name, param_dtype, reduce_dtype, replicate, reduce_group):  # type: ignore[override]
        ctx.meta = (group_size, reduce_group or group_name, reduce_dtype, shard.dtype, replicate)
        full = all_gather(cast_to(shard, param_dtype), group_size, group_name)
        return full.clone() if full is shard else full  # (one rank, no cast: storage of its own)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        group_size, reduce_group, reduce_dtype, shard_dtype, replicate = ctx.meta
        grad = _average(cast_to(grad, reduce_dtype_of(grad, reduce_dtype)), group_size, replicate)
        reduced = over_replicas(reduce_scatter_sum(grad, group_size, reduce_group), replicate)
        return cast_to(reduced, shard_dtype), None, None, None, None, None, None


class _ReplicateScalar(torch.autograd.Function):
    """Identity (with the param_dtype cast) in forward, averaged all-reduce in backward."""

    @staticmethod
    def forward(ctx, local, group_size, group_name, param_dtype, reduce_dtype, replicate):  # type: ignore[override]
        ctx.meta = (group_size, group_name, reduce_dtype, local.dtype, replicate)
        return cast_to(local, param_dtype).clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        group_size, group_name, reduce_dtype, local_dtype, replicate = ctx.meta
        grad = _average(cast_to(grad, reduce_dtype_of(grad, reduce_dtype)), group_size, replicate)
        reduced = over_replicas(all_reduce_sum(grad, group_name), replicate)
        return cast_to(reduced, local_dtype), None, None, None, None, None


def gather_shard(
    shard: torch.Tensor,
    group_size: int,
    group_name: str,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    replicate: tuple[int, str] | None = None,
    reduce_group: str | None = None,
) -> torch.Tensor:
    """The gather of a padded shard (equal size on every rank); backward is the reduce, on
    ``reduce_group`` (another name of the same ranks) where given, else on ``group_name``
    (then, under HSDP, the all-reduce over ``replicate = (size, group name)``)."""
    return _GatherShard.apply(
        shard, group_size, group_name, param_dtype, reduce_dtype, replicate, reduce_group
    )


# [Note: Dynamo calls the gather, AOT autograd traces it]
# Dynamo would inline ``_GatherShard`` at every read: its forward, then its backward (to
# check it can be traced), then a subgraph pair for each. That took about 30 ms a param
# on the CPU, so a whole-model compile of an 8-layer Llama (75 params) spent 5.0 s in
# Dynamo against the plain model's 1.8 s. Allowed in the graph, ``gather_shard`` is one
# call node in Dynamo's graph (its arguments are the shard and Python literals), and AOT
# autograd, which runs that graph under its own tracer, records the same all-gather,
# wait and reduce-scatter nodes as before: the graphs fczero's passes see do not change
# (tests/e2e/test_graphs.py). AOT autograd's cache would refuse a graph calling an
# unknown function; ``fczero.passes.install.cache_fczero_graphs`` names it cacheable,
# keyed by this module's source, so a changed gather misses the cache.
torch.compiler.allow_in_graph(gather_shard)


def replicate_scalar(
    local: torch.Tensor,
    group_size: int,
    group_name: str,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    replicate: tuple[int, str] | None = None,
) -> torch.Tensor:
    """The 'gather' of a replicated 0-d param; backward all-reduces its grad (over both
    groups under HSDP)."""
    return _ReplicateScalar.apply(
        local, group_size, group_name, param_dtype, reduce_dtype, replicate
    )


# ---- eager c10d collectives: values the ranks settle together, never in a graph ----


def reduce_in_place(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    """Replace ``t`` with its reduction by ``op`` over ``group`` (None: the default group)."""
    dist.all_reduce(t, op=op, group=group)


def broadcast_from_first(t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Replace ``t`` with the value that the first rank of ``group`` holds."""
    dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)


def broadcast_object(value: object) -> object:
    """Rank 0's ``value`` on every rank (``value`` itself without a process group)."""
    if not dist.is_initialized():
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def barrier() -> None:
    """Wait for every rank of the default group (nothing without a process group)."""
    if dist.is_initialized():
        dist.barrier()
