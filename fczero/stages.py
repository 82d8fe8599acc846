"""ZeRO stages 1 and 2, and the per-param state that gradient accumulation uses.

[Note: whole copies]
In every stage the module owns the sharded param and every optimizer sees only
shards, so optimizer state is always sharded. In stages 1 and 2 each rank also keeps
a *whole copy* of every param (in ``param_dtype`` if set), which is what the module
reads: no all-gather in forward or backward. Its backward reduces the whole grad to
the sharded grad (``fczero.reducer``): a reduce-scatter in stage 2, a bucketed
all-reduce in stage 1.

The whole copies are refreshed in place, by a bucketed all-gather of the updated
shards, right after each ``optimizer.step()`` (a global optimizer step post-hook) for
the params that optimizer holds, in the model's param order: every rank runs the same
step over the same params, so every rank issues the same all-gathers. Refreshing in
place keeps each copy the same tensor, so compiled graphs that read it are not
recompiled. After changing shards any other way, call ``fczero.refresh_params``.

Every managed param gets a ``ParamState`` (stage 3 too): the unsharded-param property
asks it for the unsharded param, and it sends the plain case (stage 3, gradient sync
on, nothing accumulated) to ``ShardSpec.unshard`` unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.checkpoint import checkpoint
from torch.utils.weak import WeakIdKeyDictionary

from fczero import collectives, local_step, resharding, unsharding
from fczero.offload import params as param_offload
from fczero.reducer import REDUCERS, Reducer, Route, whole_param
from fczero.sharding import STATE_ATTR, _local, _recompute_everything, mesh_device

if TYPE_CHECKING:
    from fczero.config import Options
    from fczero.sharding import ShardSpec

logger = logging.getLogger("fczero")

#: Attribute on the root module: its ``RootState``.
ROOT_STATE_ATTR = "_fczero_root_state"

_c10d = torch.ops._c10d_functional


class RootState:
    """What one parallelized root shares with its params: the sync flag and the order."""

    def __init__(self, options: Options, mesh: DeviceMesh) -> None:
        self.options = options
        self.mesh = mesh
        self._sync = True
        self.in_forward = False  # an eager forward of the root is running
        self.params: list[ParamState] = []  # registration order, identical on every rank
        self.reducer: Reducer | None = None
        self.reducer_key = -1
        # selective unsharding: the plan from keep_unsharded bytes, or the automatic one
        self.kept: unsharding.KeptPlan | None = None
        self.auto_unsharding: unsharding.AutoUnsharding | None = None


    @property
    def sync(self) -> bool:
        """Reduce grads in backward (False: accumulate, see ``fczero.accumulation``)."""
        return self._sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self._sync = value
        for state in self.params:  # each param reads its own copy when traced
            state.sync = value


class ParamState:
    """One sharded param: its whole copy (stages 1/2) and its accumulated grads."""

    def __init__(self, root: RootState, spec: ShardSpec, param: nn.Parameter) -> None:
        self.root = root
        self.spec = spec
        self.param = param
        self.sync = root.sync  # the root's flag ([Note: what a compiled gather reads])
        self.whole: torch.Tensor | None = None  # stages 1/2 (not 0-d): the kept whole copy
        self.acc: torch.Tensor | None = None  # leaf whose .grad accumulates while unsynced
        self.route: Route | None = None
        # a kept param's gather, reused by the micro-batches of one accumulation, and the
        # sharded param's version counter when gathered (-1: gathered in a compiled graph)
        self.reused: torch.Tensor | None = None
        self.reused_version = -1

    def unshard(self, param: torch.Tensor) -> torch.Tensor:
        """The unsharded param a module computes with (called on every access)."""
        spec = self.spec
        grad_path = param.requires_grad and torch.is_grad_enabled()
        accumulating = grad_path and not self.sync
        pending = None
        if grad_path and self.sync and self.acc is not None:
            # The first synced use after accumulating: its backward adds what no_sync summed.
            pending, self.acc = self.acc.grad, None
        if self.whole is None and not accumulating and pending is None:
            # only kept params ever hold a reused gather: the others skip the attribute
            # (under compile each read would be one more guard, each write a side effect)
            if spec.keep_unsharded and self.reused is not None:
                self.reused = None
            return spec.unshard(param)
        if self.whole is not None:
            if not grad_path:
                return self.whole
            whole = self.whole
        else:
            whole = self._gather_without_grad(param)
            if pending is not None and spec.keep_unsharded:
                self.reused = None  # the accumulation's last micro-batch: the step follows
        route, reducer = self.route, self.root.reducer
        eager_stage1 = reducer is not None and route.index >= 0
        if eager_stage1 and not accumulating and not collectives._tracing():
            reducer.expect(route.index)  # one more grad for its bucket to wait for
        local = self.spec._on_device(_local(param))  # (param offload: from the host)
        return whole_param(local, whole, self.acc if accumulating else None, pending, route)

    def _gather_without_grad(self, param: torch.Tensor) -> torch.Tensor:
        """Stage 3 (or a 0-d param) while accumulating: the whole param, without the reduce
        that the core gather's backward would issue."""
        spec = self.spec
        local = _local(param).detach()
        if spec.is_scalar:
            return collectives._to(spec._on_device(local), spec.param_dtype)
        if spec.keep_unsharded:
            return self._reuse_or_gather(local, param)
        if torch.compiler.is_compiling():
            return checkpoint(
                spec._gather, local, use_reentrant=False, context_fn=_recompute_everything
            )
        full = spec._gather(local)
        resharding.register_gathered(full, spec, param)  # saved views regather in backward
        return full

    def _reuse_or_gather(self, local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """Selective unsharding while accumulating: the first micro-batch's gather serves
        every later one, up to the synced micro-batch, which drops it. Eager also gathers
        again when the sharded param changed in between (its version counter moved: the
        DTensor's own, since in-place ops on a DTensor leave its local tensor's counter
        alone); a compiled graph cannot read the counter and relies on the drop alone.
        Under compile the first micro-batch's graph returns the gather (stored here) and
        the later ones take it as an input."""
        compiling = torch.compiler.is_compiling()
        version = -1 if compiling else param._version
        if self.reused is not None and (compiling or self.reused_version == version):
            return self.reused
        full = self.spec._gather(local)
        self.reused, self.reused_version = full, version
        return full

    def new_accumulator(self) -> None:
        """A leaf whose ``.grad`` collects this param's whole grads (reduce_dtype); the leaf
        itself is one element broadcast to the whole shape."""
        if self.acc is not None or not self.param.requires_grad:
            return
        route = self.route
        device = self.spec.compute_device or self.param.device  # (param offload: the device's)
        one = torch.zeros((), dtype=route.reduce_dtype, device=device)
        self.acc = one.expand(self.spec.shape).detach().requires_grad_(True)


#: Sharded param -> weak reference to its state (for the optimizer hooks). Both weak: the
#: model alone keeps its states (and so its params) alive.
_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: optimizer -> (its params when looked up, weak references to their states): ``_states_of``
_OPTIMIZER_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_hooks_installed = False


def attach(
    model: nn.Module,
    params: list[tuple[torch.Tensor, nn.Parameter, ShardSpec]],
    wiring: dict[nn.Module, dict[str, ShardSpec]],
    options: Options,
    mesh: DeviceMesh,
) -> RootState:
    """Give every sharded param its state (stages 1/2: its whole copy, from the original
    tensor, which is the same on every rank, so no collective is needed)."""
    root = RootState(options, mesh)
    rank = mesh.get_local_rank()
    device = mesh_device(mesh)
    by_param: dict[int, ParamState] = {}
    reducer_slots: list[tuple[nn.Parameter, Route, torch.Size]] = []
    for original, sharded, spec in params:
        state = ParamState(root, spec, sharded)
        shard_dtype = sharded.dtype
        grad_dtype = options.mp.param_dtype or shard_dtype
        kind = "all" if spec.is_scalar else ("rows" if options.stage == 1 else "scatter")
        reducer_index = -1
        if kind == "rows" and sharded.requires_grad:
            reducer_index = len(reducer_slots)
        state.route = Route(
            kind=kind,
            group_size=spec.group_size,
            group_name=spec.group_name,
            rows_per_rank=spec.rows_per_rank,
            local_rows=spec.local_rows,
            start=min(rank * spec.rows_per_rank, spec.shape[0]) if spec.shape else 0,
            reduce_dtype=options.mp.reduce_dtype or grad_dtype,
            shard_dtype=shard_dtype,
            reducer=-1,  # set below once the Reducer exists
            index=reducer_index,
        )
        if reducer_index >= 0:
            reducer_slots.append((sharded, state.route, spec.shape))
        if options.stage < 3 and not spec.is_scalar:
            whole = original.detach().to(device=device, dtype=grad_dtype, copy=True)
            state.whole = whole
        root.params.append(state)
        by_param[id(sharded)] = state
        _STATES[sharded] = weakref.ref(state)
    if reducer_slots:
        reducer = Reducer(reducer_slots, options.comm.bucket_bytes)
        root.reducer = reducer  # REDUCERS holds it weakly
        root.reducer_key = id(reducer)
        REDUCERS[root.reducer_key] = reducer
        for state in root.params:
            if state.route.index >= 0:
                state.route = _with_reducer(state.route, root.reducer_key)
        for slot, state in enumerate(s for s in root.params if s.route.index >= 0):
            reducer.params[slot] = (state.param, state.route, state.spec.shape)
    for module, specs in wiring.items():
        module.__dict__[STATE_ATTR] = {
            name: by_param[id(module._parameters[name])] for name in specs
        }
    model.__dict__[ROOT_STATE_ATTR] = root
    model.register_forward_pre_hook(_enter_forward)
    model.register_forward_hook(_leave_forward, always_call=True)
    _install_optimizer_hooks()
    return root


def _with_reducer(route: Route, key: int) -> Route:
    fields = dict(route.__dict__)
    fields["reducer"] = key
    return Route(**fields)


def _enter_forward(module: nn.Module, args: tuple) -> None:
    if not torch.compiler.is_compiling():
        module.__dict__[ROOT_STATE_ATTR].in_forward = True


def _leave_forward(module: nn.Module, args: tuple, output: object) -> None:
    if not torch.compiler.is_compiling():
        module.__dict__[ROOT_STATE_ATTR].in_forward = False


def root_state(model: nn.Module) -> RootState | None:
    """The ``RootState`` of a parallelized root (None for any other module)."""
    return model.__dict__.get(ROOT_STATE_ATTR)


def refresh(states: list[ParamState]) -> None:
    """All-gather the current shards into the whole copies, bucketed (same order on every
    rank: the caller passes states in their root's order)."""
    states = [s for s in states if s.whole is not None and math.prod(s.spec.shape) > 0]
    if not states:
        return
    cap = states[0].root.options.comm.bucket_bytes
    bucket: list[ParamState] = []
    size = 0
    for state in states:
        nbytes = state.whole.numel() * state.whole.element_size()
        if bucket and (state.whole.dtype != bucket[0].whole.dtype or size + nbytes > cap):
            _gather_into_wholes(bucket)
            bucket, size = [], 0
        bucket.append(state)
        size += nbytes
    _gather_into_wholes(bucket)


@torch.no_grad()
def _gather_into_wholes(bucket: list[ParamState]) -> None:
    spec0 = bucket[0].spec
    world = spec0.group_size
    pieces = []
    for state in bucket:
        spec = state.spec
        local = state.param.to_local().to(state.whole.dtype)
        pad = spec.rows_per_rank - spec.local_rows
        if pad:
            local = F.pad(local, [0, 0] * (local.dim() - 1) + [0, pad])
        pieces.append(local.reshape(-1))
    flat = torch.cat(pieces)
    out = _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, world, spec0.group_name))
    by_rank = out.view(world, -1)
    offset = 0
    for state, piece in zip(bucket, pieces):
        n = piece.numel()
        spec = state.spec
        full = by_rank[:, offset : offset + n].reshape(world * spec.rows_per_rank, *spec.shape[1:])
        state.whole.copy_(full.narrow(0, 0, spec.shape[0]))
        offset += n


def refresh_params(model: nn.Module) -> None:
    """Refresh the whole copies of a stage-1/2 model from its shards (one bucketed
    all-gather pass); ``optimizer.step()`` does it by itself. Call it on every rank after
    changing sharded params in any other way (e.g. ``load_state_dict``)."""
    root = root_state(model)
    if root is None:
        raise ValueError(
            "fczero.refresh_params needs the root module that fczero.parallelize returned."
        )
    refresh(root.params)


def _state_of(param: torch.Tensor) -> ParamState | None:
    ref = _STATES.get(param)
    return ref() if ref is not None else None


def options_of(param: torch.Tensor) -> Options | None:
    """The ``parallelize`` options of the model that owns sharded ``param`` (else None)."""
    state = _state_of(param)
    return state.root.options if state is not None else None


def compute_device_of(param: torch.Tensor) -> torch.device | None:
    """The device a param-offloaded sharded ``param`` is gathered to (None: its shard is
    where its compute is, or it is not fczero's)."""
    state = _state_of(param)
    return state.spec.compute_device if state is not None else None


_IN_PARTS = "_fczero_step_in_parts"  # set on an optimizer while it steps part of its params


@contextlib.contextmanager
def one_step_in_parts(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """One optimizer step made of several ``optimizer.step()`` calls, each on a part of the
    params (the chunked step of optimizer-state offload): fczero's global step hooks run
    once, over all params, before the first part and after the last, and not around each
    part (where they would check, wait or count per part)."""
    from fczero import guards  # (guards is imported after this module)

    guards.check_optimizer(optimizer, (), {})
    _before_step(optimizer, (), {})
    optimizer.__dict__[_IN_PARTS] = True
    try:
        yield
    finally:
        del optimizer.__dict__[_IN_PARTS]
    _after_step(optimizer, (), {})


def _states_of(optimizer: torch.optim.Optimizer) -> list[ParamState]:
    """The fczero params ``optimizer`` holds, looked up again only when its params change."""
    params = tuple(p for group in optimizer.param_groups for p in group["params"])
    cached = _OPTIMIZER_STATES.get(optimizer)
    # (the key holds its params alive, so identity cannot be reused by another tensor; the
    # states are held weakly, as in _STATES: the model alone keeps them alive)
    if cached is not None and len(cached[0]) == len(params):
        if all(a is b for a, b in zip(cached[0], params)):
            states = [ref() for ref in cached[1]]
            if None not in states:
                return states
    states = [s for s in map(_state_of, params) if s is not None]
    _OPTIMIZER_STATES[optimizer] = (params, [weakref.ref(s) for s in states])
    return states


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Refuse grads accumulated but never reduced; under param offload, wait for the
    device, since the step writes host shards that device copies may still read."""
    from fczero import accumulation  # (it imports this module)

    if optimizer.__dict__.get(_IN_PARTS):
        return
    states = _states_of(optimizer)
    accumulation.check_before_step(states)
    devices = {s.spec.compute_device for s in states} - {None}
    if devices:
        param_offload.wait_for_device(devices)
    local_step.enter(optimizer, [s.param for s in states])


def _after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    local_step.restore(optimizer)
    if optimizer.__dict__.get(_IN_PARTS):
        return
    roots: dict[int, tuple[RootState, set[int]]] = {}
    for state in _states_of(optimizer):
        wholes = roots.setdefault(id(state.root), (state.root, set()))[1]
        if state.whole is not None:
            wholes.add(id(state))
    for root, ids in roots.values():
        if ids:  # stages 1/2: refreshed in the root's order, not the optimizer's
            refresh([s for s in root.params if id(s) in ids])
        if root.auto_unsharding is not None:
            root.auto_unsharding.after_step()


def _install_optimizer_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    register_optimizer_step_pre_hook(_before_step)
    register_optimizer_step_post_hook(_after_step)
    _hooks_installed = True
