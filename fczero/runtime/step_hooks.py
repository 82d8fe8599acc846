"""fczero's optimizer step hooks: what runs around every ``optimizer.step()``.

torch's optimizer step hooks are global, so fczero registers one pre-hook and one
post-hook per process (``install``), and each finds the fczero params of the optimizer
that is stepping (its ``OptimizerState``, made on first use):

    before: the misuse guards, the accumulation check, under param offload the host
            memory check and a wait for the device's copies, the local step's swap
    after:  the local step's restore, stages 1/2's refresh of the whole copies (in each
            root's param order), automatic selective unsharding's step count

``one_step_in_parts`` runs them once around a step made of several ``step()`` calls (the
chunked step of optimizer-state offload).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from itertools import chain
from operator import is_
from typing import TYPE_CHECKING

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from fczero.core import offload_sizing, streams, unsharding
from fczero.core.state import (
    OptimizerState,
    ParamState,
    RootState,
    any_sharded,
    optimizer_state,
    state_of,
)
from fczero.runtime import accumulation, guards, local_step
from fczero.runtime.param_states import refresh

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle


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
    params = tuple(chain.from_iterable(group["params"] for group in optimizer.param_groups))
    record = OptimizerState.of(optimizer)
    # (the record holds its params alive, so identity cannot be reused by another tensor;
    # the states are held weakly: the model alone keeps them alive)
    if len(record.params) == len(params) and all(map(is_, record.params, params)):
        states = [ref() for ref in record.states]
        if None not in states:
            return states
    if not (any_sharded(params) or guards.any_replaced(params)):
        return []  # an optimizer of other params: cleared in one pass over its params' ids
    guards.check_optimizer(optimizer, params)
    states = [s for s in map(state_of, params) if s is not None]
    if states:  # an optimizer of other params gets no fczero attribute
        record = optimizer_state(optimizer)
        record.params, record.states = params, [weakref.ref(s) for s in states]
        record.sharded = frozenset(id(s.param) for s in states)
        record.devices = frozenset(s.spec.compute_device for s in states) - {None}
        roots = {id(s.root): s.root for s in states}  # (in order of first param)
        record.roots = [weakref.ref(r) for r in roots.values()]
    return states


def roots_of(optimizer: torch.optim.Optimizer) -> list[RootState]:
    """The roots of the fczero params ``optimizer`` holds, in the order of their first param."""
    return list({id(s.root): s.root for s in _states_of(optimizer)}.values())


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Refuse grads accumulated but never reduced; under param offload, wait for the
    device, since the step writes host shards that device copies may still read."""
    if OptimizerState.of(optimizer).in_parts:
        return
    states = _states_of(optimizer)
    if not states:
        return
    accumulation.check_before_step(states)
    record = OptimizerState.of(optimizer)
    if record.devices:
        on_host = [s.param for s in states if s.spec.compute_device]
        offload_sizing.check_host_step(optimizer, on_host)
        streams.wait_for_device(set(record.devices))
    local_step.enter(optimizer, record.params, record.sharded)


def _after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    local_step.restore(optimizer)
    if OptimizerState.of(optimizer).in_parts:
        return
    states = _states_of(optimizer)
    wholes = {id(s) for s in states if s.whole is not None}
    for ref in OptimizerState.of(optimizer).roots:
        root = ref()
        if root is None:
            continue
        if wholes:  # stages 1/2: refreshed in the root's order, not the optimizer's
            mine = [s for s in root.params if id(s) in wholes]
            if mine:
                refresh(mine)
        unsharding.after_step(root)


#: The handles of fczero's one pair of global optimizer step hooks: torch keeps such hooks
#: per process, so they are installed once, by the first ``parallelize``, and serve every
#: model (each hook finds its states through the optimizer it is called for).
_STEP_HOOKS: list[RemovableHandle] = []


def install() -> None:
    """Register the two global step hooks, once per process."""
    if not _STEP_HOOKS:
        _STEP_HOOKS.append(register_optimizer_step_pre_hook(_before_step))
        _STEP_HOOKS.append(register_optimizer_step_post_hook(_after_step))
