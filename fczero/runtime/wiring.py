"""Module wiring: what a module gets when it reads one of its sharded params.

[Note: module wiring]
Each module that owns params gets a subclass of its own class (cached per class and
names) in which every param name is a read-only property returning the unsharded
param. ``module._parameters`` still holds the sharded param, so state dicts keep
their keys and values, and ``torch.compile`` traces the property like any Python.
Nothing in torch is patched.

Reading the property runs ``unsharded_param`` on the param's ``ParamState``
(``fczero.core.state``). On the plain path it reads one value of the state,
``ParamState.traced``, which a compiled gather takes its constants from ([Note: what a
compiled gather reads] in ``fczero.core.spec``). The plain case (stage 3, gradient sync
on, nothing accumulated) is the traced gather when compiling (``ShardSpec.unshard_traced``)
and, in eager mode, ``fczero.runtime.prefetch.gather_eagerly``: the eager context of the
param's root's running forward. The getter asks ``is_compiling`` once and hands the
answer down. A whole copy (stages 1/2) or an accumulating micro-batch goes through the reducer's
``whole_param`` instead, whose backward reduces or accumulates the whole grad.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes as _no_dispatch_modes
from torch.utils.checkpoint import checkpoint

from fczero.comm import collectives
from fczero.comm.whole_grads import whole_param
from fczero.core.spec import gather_traced, local_shard, recompute_everything
from fczero.core.state import ATTR, ParamState, RootState, Unit
from fczero.runtime.prefetch import gather_eagerly, running

#: (user class, param names, in units) -> its wired subclass. Per process: a generated class holds
#: no state of a model, so every model with such a module shares it; held weakly (it
#: lives while a module of it does).
_WIRED_CLASSES: weakref.WeakValueDictionary[tuple[type, tuple[str, ...], bool], type] = (
    weakref.WeakValueDictionary()
)


def _unsharded_property(name: str, in_unit: bool) -> property:
    """``in_unit``: the param belongs to a unit, whose gather the read returns while the unit
    runs ([Note: units]); otherwise the read never looks (under compile, a look is a guard)."""

    def get(module: nn.Module) -> torch.Tensor:
        state = getattr(module, ATTR).params[name]
        if in_unit:
            held = state.current
            if held is not None:
                return held
        # the one check of this read (a compiled read must not reach the task id below:
        # Dynamo breaks the graph on it); its answer is handed down
        if torch.compiler.is_compiling():  # the sharded DTensor stays out of the graph
            return unsharded_param(state, state.leaf, compiling=True)
        if in_unit and torch._C._current_graph_task_id() != -1:
            # backward recomputes a checkpointed region inside a unit's forward: the unit
            # is gathered again as a whole ([Note: units])
            return gather_for_recompute(state.unit, state)
        return unsharded_param(state, module._parameters[name], compiling=False)

    return property(get, doc=f"Unsharded {name!r}, gathered by fczero on each access.")


def gather_for_recompute(unit: Unit, state: ParamState) -> torch.Tensor:
    """Backward recomputes a checkpointed region that runs inside ``unit``'s forward (the
    checkpoint sits inside the unit, as a checkpoint wrapper module puts it) and reads
    ``state``'s param, which the unit let go of when its forward ended.

    Gather the whole unit again, in its order, whichever param the region reads first
    (every rank recomputes the region, so every rank gathers the same), and hold it until
    backward recomputes another unit, or ends. Gathered without autograd (a recompute's own
    graph is never differentiated), each marked as requiring grad as its forward read was.
    Outside any dispatch mode: a selective checkpoint replays the region's ops against
    those its forward ran, and the forward read these params from the unit, without a
    collective."""
    root = state.root
    held = root.recomputing
    if held is not None and held is not unit:
        _release_recompute(root)
    if state.current is None:
        for s in unit.states:
            s.current = gathered_for_recompute(s)
        if root.recomputing is None:
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(_release_recompute, root)
            )
        root.recomputing = unit
    return state.current


def gathered_for_recompute(state: ParamState) -> torch.Tensor:
    """``state``'s param gathered for a recompute in backward: without autograd (a
    recompute's graph is never differentiated) and outside any dispatch mode, then marked
    as requiring grad as its forward read was, so the region's ops save the same tensors."""
    with torch.no_grad(), _no_dispatch_modes():
        full = unsharded_param(state, state.param, compiling=False)
    return full.detach().requires_grad_(state.param.requires_grad)


def _release_recompute(root: RootState) -> None:
    unit, root.recomputing = root.recomputing, None
    if unit is not None and not unit.depth:
        for state in unit.states:
            state.current = None


def wire_module(module: nn.Module, names: Iterable[str], in_units: bool = False) -> None:
    """Make ``module.<name>`` return the unsharded param for every name in ``names`` (its
    ``ParamState`` in the module's ``ModuleState`` says how to get it); ``in_units``: the
    params belong to units (``fczero.runtime.units``)."""
    cls = type(module)
    key = (cls, tuple(sorted(names)), in_units)
    wired = _WIRED_CLASSES.get(key)
    if wired is None:
        attrs = {name: _unsharded_property(name, in_units) for name in key[1]}
        attrs["__module__"] = cls.__module__
        wired = type(f"FCZero{cls.__name__}", (cls,), attrs)
        _WIRED_CLASSES[key] = wired
    module.__class__ = wired


def unsharded_param(state: ParamState, param: torch.Tensor, compiling: bool) -> torch.Tensor:
    """The unsharded param a module computes with (called on every access): ``param``
    is the sharded param in eager, ``state.leaf`` when traced ([Note: what a compiled
    graph differentiates] in ``fczero.core.state``; so Dynamo never reads the DTensor).
    ``compiling``: ``torch.compiler.is_compiling()``, as the read asked it once."""
    traced = state.traced  # the plain stage-3 gather: the one value read on that path
    if traced is not None:
        if compiling:
            return gather_traced(param, traced)
        return gather_eagerly(state, param)
    spec = state.spec
    grad_path = param.requires_grad and torch.is_grad_enabled()
    accumulating = grad_path and not state.sync
    pending = None
    if grad_path and state.sync and state.acc is not None:
        # The first synced use after accumulating: its backward adds what no_sync summed.
        pending, state.acc = state.acc.grad, None
    if state.whole is None and not accumulating and pending is None:
        # only kept params ever hold a reused gather: the others skip the attribute
        # (under compile each read would be one more guard, each write a side effect)
        if spec.keep_unsharded and state.reused is not None:
            state.reused = None
        return spec.unshard_traced(param) if compiling else gather_eagerly(state, param)
    if state.whole is not None:
        if not grad_path:
            return state.whole
        whole = state.whole
    else:
        whole = _gather_without_grad(state, param, compiling)
        if pending is not None and spec.keep_unsharded:
            state.reused = None  # the accumulation's last micro-batch: the step follows
    route, reducer = state.route, state.root.reducer
    if reducer is None or route.index < 0 or collectives.tracing():
        reducer = None  # (compiled: the graph all-reduces each grad itself)
    elif not accumulating:
        reducer.expect(route.index)  # one more grad for its bucket to wait for
    local = spec.on_device(local_shard(param))  # (param offload: from the host)
    acc = state.acc if accumulating else None
    return whole_param(local, whole, acc, pending, route, reducer)


def _gather_without_grad(state: ParamState, param: torch.Tensor, compiling: bool) -> torch.Tensor:
    """Stage 3 (or a 0-d param) while accumulating: the whole param, without the reduce
    that the core gather's backward would issue."""
    spec = state.spec
    local = local_shard(param).detach()
    if spec.is_scalar:
        return collectives.cast_to(spec.on_device(local), spec.param_dtype)
    if spec.keep_unsharded:
        return _reuse_or_gather(state, local, param, compiling)
    if compiling:
        return checkpoint(
            spec.gather, local, use_reentrant=False, context_fn=recompute_everything
        )
    full = collectives.settle(spec.gather(local))  # (a view of it would never wait)
    context = running(state.root)
    if context is not None:
        context.register(full, spec, param)  # saved views regather in backward
    return full


def _reuse_or_gather(
    state: ParamState, local: torch.Tensor, param: torch.Tensor, compiling: bool
) -> torch.Tensor:
    """Selective unsharding while accumulating: the first micro-batch's gather serves
    every later one, up to the synced micro-batch, which drops it. Eager also gathers
    again when the sharded param changed in between (its version counter moved: the
    DTensor's own, since in-place ops on a DTensor leave its local tensor's counter
    alone); a compiled graph cannot read the counter and relies on the drop alone.
    Under compile the first micro-batch's graph returns the gather (stored in the state)
    and the later ones take it as an input."""
    version = -1 if compiling else param._version
    if state.reused is not None and (compiling or state.reused_version == version):
        return state.reused
    full = state.spec.gather(local)
    if not compiling:
        full = collectives.settle(full)  # (a view of it would never wait)
    state.reused, state.reused_version = full, version
    return full
