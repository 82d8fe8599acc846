"""Backward's recompute of a checkpointed unit: its params gathered as one bucket, and the
unit that backward recomputes next already in flight.

[Note: regathers for a recompute]
Activation checkpointing around a unit (Hugging Face's ``gradient_checkpointing_enable``,
a checkpoint wrapper, fczero's Llama with ``checkpointing``) calls the unit's forward again
in backward. The unit let its params go after forward, so it gathers them again, and
without this module it would gather them one param at a time, each waited for before the
block can recompute, none of them beside any compute.

A unit whose params all take the plain stage-3 gather (``ParamState.traced``; kept params
reuse their forward gather instead) issues them as one bucket
(``eager_buckets.gather_bucket``). Then it issues the bucket of the unit whose forward began
just before its own in the last eager forward, if that is a block of the same class:
backward recomputes blocks in the reverse of forward's order, so that all-gather runs
while this block recomputes and computes its grads. Forward's order is the same on every
rank (units follow the model's structure), so every rank issues the same regathers in the
same order. A prefetched bucket that backward never asks for (the earlier block was not
checkpointed) is dropped when backward ends: one block of memory and one all-gather
spent, on every rank alike.

The bucket keeps its autograd node, whose backward reduce-scatters the unit's grads: under
a non-reentrant checkpoint the recompute's graph is never differentiated and the node
never runs; under a reentrant one it is, and the grads come back through it. Inside a
selective checkpoint (its dispatch mode compares the ops a recompute runs with those its
forward ran) the unit gathers param by param, as its forward did. Under any other dispatch
mode (``FlopCounterMode``, ``fczero.testing.comm.CollectiveLog``) it regathers as it would
without one, so a tool that watches a step sees the collectives the step issues.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from fczero.core.state import ParamState, RootState
from fczero.runtime import eager_buckets

# The dispatch modes of a selective-checkpoint region (torch-private): its forward records
# the ops under the first, its recompute replays them under the second.
_SAC_MODES = tuple(
    mode
    for mode in (
        getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None),
        getattr(torch.utils.checkpoint, "_CachedTorchDispatchMode", None),
    )
    if mode is not None
)

#: root -> (a weak reference to the unit, its regather issued ahead), only while a
#: backward runs ([Note: regathers for a recompute]): empty again when it ends, so no step
#: leaves anything here, and per root, so two models never meet
_AHEAD: weakref.WeakKeyDictionary[RootState, tuple[weakref.ref, eager_buckets.Bucket]] = (
    weakref.WeakKeyDictionary()
)


def in_backward() -> bool:
    """Autograd is running a backward on this thread (a checkpoint recomputes in it)."""
    return torch._C._current_graph_task_id() != -1


def regather(unit: Any) -> list[torch.Tensor] | None:
    """The gathered params of ``unit`` (a ``fczero.runtime.units.Unit``) that backward
    recomputes now, from one bucket, prefetched where it could be; None where the unit
    gathers param by param (see the note)."""
    if not _bucketable(unit.states) or in_selective_checkpoint():
        return None
    root = unit.states[0].root
    ahead = _AHEAD.pop(root, None)
    if ahead is not None and ahead[0]() is unit:
        bucket = ahead[1]
    else:
        if ahead is not None:
            ahead[1].settle()  # (issued for a unit backward did not recompute next)
        bucket = _issue(unit.states)
    before = unit.previous() if unit.previous is not None else None
    if before is not None and before.cls is unit.cls and _bucketable(before.states):
        _AHEAD[root] = (unit.previous, _issue(before.states))
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_drop, root)
        )
    return [bucket.member(k) for k in range(len(unit.states))]


def in_selective_checkpoint() -> bool:
    """True inside a selective activation-checkpointing region, in its forward or its
    recompute. The dispatch-mode stack is read only when it is not empty, as in most steps;
    on a torch without the region's mode classes any dispatch mode counts as one."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    stack = _get_current_dispatch_mode_stack()
    return any(isinstance(mode, _SAC_MODES) for mode in stack) if _SAC_MODES else bool(stack)


def ahead_of(root: RootState) -> eager_buckets.Bucket | None:
    """The regather issued ahead for ``root``'s next recompute, if one is in flight."""
    ahead = _AHEAD.get(root)
    return ahead[1] if ahead is not None else None


def _bucketable(states: list[ParamState]) -> bool:
    if not states or any(s.traced is None or not eager_buckets.can_bucket(s.spec) for s in states):
        return False
    first = eager_buckets.bucket_key(states[0].spec, states[0].param)
    return all(eager_buckets.bucket_key(s.spec, s.param) == first for s in states[1:])


def _issue(states: list[ParamState]) -> eager_buckets.Bucket:
    return eager_buckets.gather_bucket([(s.spec, s.differentiated(s.param)) for s in states])


def _drop(root: RootState) -> None:
    """Backward ended: a regather issued ahead that nothing asked for is waited (a
    collective is always waited) and let go."""
    ahead = _AHEAD.pop(root, None)
    if ahead is not None:
        ahead[1].settle()
