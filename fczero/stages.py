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

``attach`` gives every managed param its ``ParamState`` (``fczero.state``) and every
managed module its ``ModuleState``; the optimizer step hooks here serve every stage
(accumulation checks, param-offload waits, the local step, the refresh).
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
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from fczero import accumulation, collectives, guards, local_step
from fczero.offload import host_memory
from fczero.offload import params as param_offload
from fczero.reducer import Reducer, Route
from fczero.spec import mesh_device
from fczero.state import (
    OptimizerState,
    ParamState,
    RootState,
    module_state,
    optimizer_state,
    remember,
    root_state,
    state_of,
)

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from fczero.config import Options
    from fczero.spec import ShardSpec

logger = logging.getLogger("fczero")

def attach(
    model: nn.Module,
    params: list[tuple[torch.Tensor, nn.Parameter, ShardSpec]],
    wiring: dict[nn.Module, list[str]],
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
            index=reducer_index,
        )
        if reducer_index >= 0:
            reducer_slots.append((sharded, state.route, spec.shape))
        if options.stage < 3 and not spec.is_scalar:
            whole = original.detach().to(device=device, dtype=grad_dtype, copy=True)
            state.whole = whole
        root.params.append(state)
        by_param[id(sharded)] = state
        remember(state)
    if reducer_slots:
        root.reducer = Reducer(reducer_slots, options.comm.bucket_bytes)
    for module, names in wiring.items():
        module_state(module, create=True).params = {
            name: by_param[id(module._parameters[name])] for name in names
        }
    module_state(model, create=True).root = root
    _install_optimizer_hooks()
    return root


def refresh(states: list[ParamState]) -> None:
    """All-gather the current shards into the whole copies, bucketed (same order on every
    rank: the caller passes states in their root's order)."""
    states = [s for s in states if s.whole is not None and math.prod(s.spec.shape) > 0]
    if not states:
        return
    items = [(s.whole.dtype, s.whole.numel() * s.whole.element_size()) for s in states]
    for bucket in collectives.plan_buckets(items, states[0].root.options.comm.bucket_bytes):
        _gather_into_wholes([states[i] for i in bucket])


@torch.no_grad()
def _gather_into_wholes(bucket: list[ParamState]) -> None:
    spec0 = bucket[0].spec
    world = spec0.group_size
    pieces = []
    for state in bucket:
        spec = state.spec
        local = state.param.to_local().to(state.whole.dtype)
        pieces.append(collectives.pad_rows(local, spec.rows_per_rank).reshape(-1))
    flat = torch.cat(pieces)
    out = collectives.all_gather_waited(flat, world, spec0.group_name)
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


@contextlib.contextmanager
def one_step_in_parts(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """One optimizer step made of several ``optimizer.step()`` calls, each on a part of the
    params (the chunked step of optimizer-state offload): fczero's global step hooks run
    once, over all params, before the first part and after the last, and not around each
    part (where they would check, wait or count per part)."""
    _before_step(optimizer, (), {})
    record = optimizer_state(optimizer)
    record.in_parts = True
    try:
        yield
    finally:
        record.in_parts = False
    _after_step(optimizer, (), {})


def _states_of(optimizer: torch.optim.Optimizer) -> list[ParamState]:
    """The fczero params ``optimizer`` holds, looked up again (and checked for params that
    ``parallelize`` replaced) only when its params change."""
    params = tuple(p for group in optimizer.param_groups for p in group["params"])
    record = OptimizerState.of(optimizer)
    # (the record holds its params alive, so identity cannot be reused by another tensor;
    # the states are held weakly: the model alone keeps them alive)
    if len(record.params) == len(params) and all(a is b for a, b in zip(record.params, params)):
        states = [ref() for ref in record.states]
        if None not in states:
            return states
    guards.check_optimizer(optimizer, params)
    states = [s for s in map(state_of, params) if s is not None]
    if states:  # an optimizer of other params gets no fczero attribute
        record = optimizer_state(optimizer)
        record.params, record.states = params, [weakref.ref(s) for s in states]
    return states


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Refuse grads accumulated but never reduced; under param offload, wait for the
    device, since the step writes host shards that device copies may still read."""
    if OptimizerState.of(optimizer).in_parts:
        return
    states = _states_of(optimizer)
    accumulation.check_before_step(states)
    devices = {s.spec.compute_device for s in states} - {None}
    if devices:
        host_memory.check_host_step(optimizer, [s.param for s in states if s.spec.compute_device])
        param_offload.wait_for_device(devices)
    local_step.enter(optimizer, [s.param for s in states])


def _after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    local_step.restore(optimizer)
    if OptimizerState.of(optimizer).in_parts:
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


#: The handles of fczero's one pair of global optimizer step hooks: torch keeps such hooks
#: per process, so they are installed once, by the first ``parallelize``, and serve every
#: model (each hook finds its states through the optimizer it is called for).
_STEP_HOOKS: list[RemovableHandle] = []


def _install_optimizer_hooks() -> None:
    if not _STEP_HOOKS:
        _STEP_HOOKS.append(register_optimizer_step_pre_hook(_before_step))
        _STEP_HOOKS.append(register_optimizer_step_post_hook(_after_step))
