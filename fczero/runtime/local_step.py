"""The optimizer step on local shards, for optimizers whose update is elementwise.

[Note: local step]
Every optimizer holds sharded params (DTensors), so each ``step()`` goes through
DTensor's dispatch: one fused AdamW call over a model's params, grads and states
propagates the sharding of every one of them. On one H100 (the 953M benchmark model,
115 params, fused AdamW) that host work kept the GPU idle for most of the update: the
update phase took 13.2 ms of host time against 3.0 ms for the same step on plain
tensors (``bench.phases``, 2026-11-24).

For an optimizer whose new value of each element depends only on the same element of
the param, its grad and its states (plus per-param scalars such as the step count),
updating each rank's local shard is the same computation. Around the step of such an
optimizer (an exact type of ``ELEMENTWISE``) fczero puts each sharded param's local
tensor (the same storage) in its place in the param groups, with the local tensor of
its grad as ``.grad``, and puts a mapping from local tensors to their local states in
place of ``optimizer.state``. After the step everything is put back: the same param
objects, grads, state mapping and state dicts, and a state value the step replaced is
wrapped as a DTensor laid out like its param, as DTensor's own step would have left it.
Nothing is copied and no collective runs.

The local view (the local param lists, state dicts and mapping) is built once and kept
on the optimizer's record: each step checks, by identity, that the optimizer still holds
the same params, groups, state mapping, state dicts and values, and builds it again if
not (``load_state_dict``, a new param group, a state replaced). On the 953M benchmark
model (115 params, one H100, compiled, regime M), with the view rebuilt on every step the
update phase took 5.2 ms of host time against the plain model's 2.2 ms; with the kept
view, 2.7 against 2.0 ms (another call, another machine).

A param's first step, which creates its states, runs on DTensors: DTensor's own step
decides which states are DTensors (``exp_avg``) and which stay plain (``step``), which a
0-d param's states alone could not tell. Should a later local step add a state (no
``torch.optim`` optimizer listed here does), a tensor shaped like the local shard is
wrapped like the param and anything else stays as it is.

The step runs on DTensors as before when any param of the optimizer is not a sharded
param of a parallelized model, when a param with a grad has no state yet, when a grad
or state is laid out unlike its param, when the optimizer's type is not listed (a
subclass may change the math: it is not assumed elementwise), under ``torch.compile``,
and while optimizer-state offload manages the optimizer (it moves state tensors itself).

If the step raises, the local tensors stay in the groups until the next step of that
optimizer (or ``restore``) puts the params back.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from itertools import chain, repeat
from operator import attrgetter, is_

import torch
from torch.distributed.tensor import DTensor

from fczero.core.state import LocalStates, LocalView, OptimizerState, optimizer_state

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
)
"""Optimizer types (exact) whose update is elementwise: they step on local shards."""


# [Note: checking the view in bulk]
# The checks compare whole sequences of objects by identity (``_same_objects``) instead
# of looking each param up in ``optimizer.state``: a tensor key hashes through Python
# (``Tensor.__hash__``), and a loop of per-param lookups and comparisons cost 53 us of
# the 157 us that entering and leaving a local step took on the 115-param toy of
# ``bench.host_cost`` (2-core CPU, torch 2.13). ``optimizer.state``'s keys and per-param
# dicts, in order, and every value of those dicts, flat, stand for the mapping:
# replacing, adding or removing any of them changes one of the sequences or its length.

_local_of = attrgetter("_local_tensor")
_spec_of = attrgetter("_spec")
_grad_of = attrgetter("grad")


def _same_objects(found: Iterable, expected: tuple, count: int) -> bool:
    """``found`` (``count`` objects) holds exactly ``expected``'s objects, in order."""
    return count == len(expected) and all(map(is_, found, expected))


def _flat_values(dicts: tuple[dict, ...]) -> tuple:
    """Every value of ``dicts``, in order."""
    return tuple(chain.from_iterable(map(dict.values, dicts)))


def _values_unchanged(dicts: tuple[dict, ...], flat: tuple) -> bool:
    """``dicts`` hold exactly ``flat``'s values (the same objects, in order)."""
    return _same_objects(chain.from_iterable(map(dict.values, dicts)), flat, sum(map(len, dicts)))


def _same_layout(t: torch.Tensor, param: DTensor) -> bool:
    """Same mesh and placements (a shape mismatch fails in the step itself, as on DTensors)."""
    if not isinstance(t, DTensor):
        return False
    ts, ps = t._spec, param._spec
    if ts is ps:  # a grad fczero wrapped (``spec.sharded_grad`` shares the param's spec)
        return True
    return ts.mesh is ps.mesh and (ts.placements is ps.placements or ts.placements == ps.placements)


def _build(
    optimizer: torch.optim.Optimizer, params: tuple, sharded: frozenset[int]
) -> LocalView | None:
    """The view of ``optimizer``, or None if its step must run on DTensors: a param that is
    not a sharded param, a state laid out unlike its param, or per-param states that are
    not plain dicts."""
    if any(id(p) not in sharded for p in params):
        return None
    groups = [group["params"] for group in optimizer.param_groups]
    state = optimizer.state
    dicts = tuple(state.values())
    if any(type(d) is not dict for d in dicts):
        return None
    entries: list[LocalStates | None] = []
    local_state = type(state)(dict) if isinstance(state, defaultdict) else {}
    for p in params:
        states = state.get(p)
        if not states:
            entries.append(None)
            continue
        if any(isinstance(v, DTensor) and not _same_layout(v, p) for v in states.values()):
            return None
        local = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in states.items()}
        entries.append(LocalStates(states, local))
        local_state[p._local_tensor] = local
    local_dicts = tuple(e.local for e in entries if e is not None)
    return LocalView(
        params=params,
        state=state,
        keys=tuple(state),
        dicts=dicts,
        values=_flat_values(dicts),
        groups=groups,
        sizes=[len(g) for g in groups],
        local_groups=[[p._local_tensor for p in g] for g in groups],
        locals_=tuple(map(_local_of, params)),
        entries=entries,
        local_dicts=local_dicts,
        local_values=_flat_values(local_dicts),
        local_state=local_state,
        with_states=len(local_state),
    )


def _still_holds(view: LocalView, optimizer: torch.optim.Optimizer, params: tuple) -> bool:
    """Is ``view`` still a view of ``optimizer``: the same param tuple, groups, state
    mapping, per-param state dicts and values, and local tensors ([Note: checking the
    view in bulk])?"""
    if view.params is not params or optimizer.state is not view.state:
        return False
    groups = optimizer.param_groups
    if len(groups) != len(view.groups):
        return False
    for group, own, size in zip(groups, view.groups, view.sizes):
        if group["params"] is not own or len(own) != size:
            return False
    state, dicts = view.state, view.dicts
    return (
        _same_objects(state, view.keys, len(state))
        and _same_objects(state.values(), dicts, len(state))
        and _values_unchanged(dicts, view.values)
        and all(map(is_, map(_local_of, params), view.locals_))
    )


def enter(optimizer: torch.optim.Optimizer, params: tuple, sharded: frozenset[int]) -> None:
    """Before ``optimizer.step()``: swap in local tensors if the step may run on them
    ([Note: local step]). ``params``: the optimizer's params, flat; ``sharded``: the ids
    of those that are fczero sharded params."""
    restore(optimizer)  # an earlier step that raised
    if not params or type(optimizer) not in ELEMENTWISE or torch.compiler.is_compiling():
        return
    record = OptimizerState.of(optimizer)
    if record.offload:
        return  # optimizer-state offload points state tensors at its own buffers
    view = record.view
    if view is None or not _still_holds(view, optimizer, params):
        view = _build(optimizer, params, sharded)
        optimizer_state(optimizer).view = view
        if view is None:
            return
    grads = list(map(_grad_of, params))
    if not (view.with_states == len(params) and _wrapped_by_fczero(grads, params)):
        for p, entry, grad in zip(params, view.entries, grads):
            if grad is not None and (entry is None or not _same_layout(grad, p)):
                return  # no states yet (this step makes them, on DTensors), or a foreign grad
    _set_grads(view.locals_, [None if g is None else g._local_tensor for g in grads])
    for group, local_params in zip(optimizer.param_groups, view.local_groups):
        group["params"] = local_params
    optimizer.state = view.local_state
    record.swap = view


def _wrapped_by_fczero(grads: list, params: tuple) -> bool:
    """Every grad is a DTensor with its param's own spec (``spec.sharded_grad``'s), the
    common case, checked in one pass; anything else (a missing grad, a plain tensor, a spec
    of its own) goes through the per-param checks."""
    try:
        return all(map(is_, map(_spec_of, grads), map(_spec_of, params)))
    except AttributeError:  # a grad that is None or a plain tensor
        return False


def _set_grads(tensors: Iterable[torch.Tensor], grads: Iterable[torch.Tensor | None]) -> None:
    """``t.grad = g`` for each pair, without a bytecode loop."""
    deque(map(setattr, tensors, repeat("grad"), grads), maxlen=0)


def restore(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.step()``: put the sharded params, grads and states back."""
    record = OptimizerState.of(optimizer)
    view, record.swap = record.swap, None
    if view is None:
        return
    for group, own in zip(optimizer.param_groups, view.groups):
        group["params"] = own
    optimizer.state = view.state
    _set_grads(view.locals_, repeat(None))
    if not _values_unchanged(view.local_dicts, view.local_values):
        # (rare: each entry writes back only the values that differ from its DTensor's)
        for p, entry in zip(view.params, view.entries):
            if entry is not None:
                _write_back(p, entry)
        view.values = _flat_values(view.dicts)
        view.local_values = _flat_values(view.local_dicts)
    if len(view.local_state) != view.with_states:
        record.view = None  # the step gave a param its first states: build again
        for p, local in zip(view.params, view.locals_):
            made = view.local_state.get(local)
            if made is not None and p not in view.state:
                view.state[p] = {k: _as_state_of(p, v, None) for k, v in made.items()}


def _write_back(param: DTensor, entry: LocalStates) -> None:
    """Give the optimizer's dict the DTensor (or plain) counterpart of each state value the
    step replaced or added (``restore`` then refreshes the view's flat sequences)."""
    for key, value in entry.local.items():
        before = entry.states.get(key)
        if (
            not (isinstance(before, DTensor) and value is before._local_tensor)
            and value is not before
        ):
            entry.states[key] = _as_state_of(param, value, before)


def _as_state_of(param: DTensor, value: object, before: object) -> object:
    """A state value after a local step: the DTensor it was (the step wrote into its local
    tensor), a new param-shaped tensor wrapped like ``param``, or the value as it is."""
    if isinstance(before, DTensor) and value is before._local_tensor:
        return before
    if isinstance(value, torch.Tensor) and value.shape == param._local_tensor.shape and value.dim():
        return DTensor.from_local(
            value,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return value
