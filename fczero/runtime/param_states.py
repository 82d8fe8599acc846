"""The states of a parallelized model, and ZeRO stages 1 and 2's whole copies.

[Note: whole copies]
In every stage the module owns the sharded param and every optimizer sees only
shards, so optimizer state is always sharded. In stages 1 and 2 each rank also keeps
a *whole copy* of every param (in ``param_dtype`` if set), which is what the module
reads: no all-gather in forward or backward. Its backward reduces the whole grad to
the sharded grad (``fczero.comm.whole_grads``): a reduce-scatter in stage 2, a bucketed
all-reduce in stage 1.

The whole copies are refreshed in place, by a bucketed all-gather of the updated
shards, right after each ``optimizer.step()`` (a global optimizer step post-hook) for
the params that optimizer holds, in the model's param order: every rank runs the same
step over the same params, so every rank issues the same all-gathers. Refreshing in
place keeps each copy the same tensor, so compiled graphs that read it are not
recompiled. After changing shards any other way, call ``fczero.refresh_params``.

``attach`` gives every managed param its ``ParamState`` (``fczero.core.state``) and every
managed module its ``ModuleState``. The refresh runs from the optimizer step hooks
(``fczero.runtime.step_hooks``), which serve every stage.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fczero.comm import collectives
from fczero.comm.buckets import plan_items
from fczero.comm.flat import copy_in, copy_out
from fczero.comm.whole_grads import Reducer, Route
from fczero.core.spec import mesh_device
from fczero.core.state import (
    ParamState,
    RootState,
    module_state,
    remember,
    root_state,
)

if TYPE_CHECKING:
    from fczero.core.config import Options
    from fczero.core.spec import ShardSpec

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
    return root


def refresh(states: list[ParamState]) -> None:
    """All-gather the current shards into the whole copies, bucketed (same order on every
    rank: the caller passes states in their root's order)."""
    states = [s for s in states if s.whole is not None and math.prod(s.spec.shape) > 0]
    if not states:
        return
    items = [(s.whole.dtype, s.whole.numel() * s.whole.element_size()) for s in states]
    for bucket in plan_items(items, states[0].root.options.comm.bucket_bytes):
        _gather_into_wholes([states[i] for i in bucket])


@torch.no_grad()
def _gather_into_wholes(bucket: list[ParamState]) -> None:
    spec0 = bucket[0].spec
    layouts = tuple(state.spec.flat_layout(state.param.dtype) for state in bucket)
    shards = [state.param.to_local() for state in bucket]
    flat = copy_in(bucket[0].whole.dtype, layouts, shards)
    gathered = collectives.all_gather_waited(flat, spec0.group_size, spec0.group_name)
    for state, full in zip(bucket, copy_out(gathered, spec0.group_size, layouts)):
        state.whole.copy_(full)


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
