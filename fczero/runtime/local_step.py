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
its grad as ``.grad`` and the local tensors of its states in ``optimizer.state``. After
the step everything is put back: the same param objects, grads and state dicts, and a
state tensor the step created (the first step's ``exp_avg``, say) is wrapped as a
DTensor laid out like its param, as DTensor's own step would have left it. Nothing is
copied and no collective runs.

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

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from fczero.core.state import OptimizerState, optimizer_state

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


@dataclass
class _Swap:
    """What ``enter`` replaced, for ``restore`` to put back."""

    groups: list[list[torch.Tensor]]  # each group's own params list
    locals_: dict[int, tuple[torch.Tensor, DTensor]]  # id(local) -> (local, sharded param)
    states: dict[int, dict]  # id(sharded param) -> its state dict as it was


def _same_layout(t: torch.Tensor, param: DTensor) -> bool:
    """Same mesh and placements (a shape mismatch fails in the step itself, as on DTensors)."""
    if not isinstance(t, DTensor):
        return False
    ts, ps = t._spec, param._spec
    return ts.mesh is ps.mesh and ts.placements == ps.placements


def _steps_locally(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], sharded: set[int]
) -> bool:
    if type(optimizer) not in ELEMENTWISE or torch.compiler.is_compiling():
        return False
    if OptimizerState.of(optimizer).offload:
        return False  # optimizer-state offload points state tensors at its own buffers
    state = optimizer.state
    for p in params:
        if id(p) not in sharded:
            return False
        if p.grad is None:
            continue  # the step skips it
        states = state.get(p)
        if not states or not _same_layout(p.grad, p):
            return False  # (no states yet: this step makes them, on DTensors)
        for value in states.values():
            if isinstance(value, DTensor) and not _same_layout(value, p):
                return False
    return True


def enter(optimizer: torch.optim.Optimizer, sharded: Iterable[torch.Tensor]) -> None:
    """Before ``optimizer.step()``: swap in local tensors if the step may run on them
    ([Note: local step]). ``sharded``: the fczero sharded params the optimizer holds."""
    restore(optimizer)  # an earlier step that raised
    groups = [group["params"] for group in optimizer.param_groups]
    params = [p for g in groups for p in g]
    if not params or not _steps_locally(optimizer, params, {id(p) for p in sharded}):
        return
    state = optimizer.state
    swap = _Swap(groups=groups, locals_={}, states={})
    for group, own in zip(optimizer.param_groups, groups):
        local_params = []
        for p in own:
            local = p._local_tensor
            local.grad = p.grad._local_tensor if p.grad is not None else None
            swap.locals_[id(local)] = (local, p)
            local_params.append(local)
            if p in state:
                states = state.pop(p)
                swap.states[id(p)] = states
                state[local] = {
                    k: v._local_tensor if isinstance(v, DTensor) else v for k, v in states.items()
                }
        group["params"] = local_params
    optimizer_state(optimizer).swap = swap


def restore(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.step()``: put the sharded params, grads and states back."""
    record = OptimizerState.of(optimizer)
    swap, record.swap = record.swap, None
    if swap is None:
        return
    for group, own in zip(optimizer.param_groups, swap.groups):
        group["params"] = own
    state = optimizer.state
    for local, p in swap.locals_.values():
        local.grad = None
        stepped = state.pop(local, None)
        if stepped is None:
            continue
        before = swap.states.get(id(p), {})
        state[p] = {k: _as_state_of(p, v, before.get(k)) for k, v in stepped.items()}


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
