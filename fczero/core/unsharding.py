"""Selective unsharding: which unsharded params stay alive from forward to backward.

[Note: selective unsharding]
Stage 3 frees every unsharded param after forward and gathers it again in backward.
The first regathers of backward are the most expensive ones: backward starts with the
blocks that forward ran last, and nothing is computing yet that their all-gather could
hide behind. Keeping those params from forward to backward removes both the exposed
wait and a quarter of a step's traffic (forward gather, backward gather, reduce),
at the cost of their unsharded bytes for the length of the step.

``plan_kept_params`` spends ``keep_unsharded`` bytes on whole blocks (``layers.15``,
or a module outside indexed containers, such as ``model.output``, on its own), starting
from the block registered last (forward reaches it last in sequential models) and
walking back. A block that does not fit ends the walk, so what is
kept is always a suffix of the model. Shapes, dtypes and module names are the same on
every rank, so every rank keeps the same params and issues the same collectives.

A kept param is gathered in forward as with ``reshard_after_forward=False``: under
``torch.compile`` its gather is not tagged for recomputation, so AOT autograd saves the
gathered param for backward; in eager mode the reshard scope leaves it out.

While gradients accumulate (``fczero.no_sync``), a kept param is gathered once per
accumulation, eager and compiled: the micro-batches after the first reuse that gather,
up to the synced micro-batch (``fczero.core.state.ParamState.reused``).

[Note: the default kept bytes]
By default (``keep_unsharded="shard"``) a plan may spend the model's unsharded bytes
(in ``param_dtype``) over the data-parallel world size: one more shard of the params, in
the dtype they compute in. With fp32 shards, bf16 compute and Adam, a rank holds 16
bytes per param over the world size already (shard, grad, two moments); the kept blocks
add at most 2, alive from their forward gather to their last backward use and freed
before the optimizer step. At world size 1 every block is kept, so backward computes
from forward's casts as a plain model under autocast does; at world size N the last
1/N of the model is kept, the blocks whose backward gathers come first and have nothing
to hide behind. The number depends on shapes, dtypes and the world size alone: every
rank plans the same at ``parallelize``, and nothing recompiles later. ``keep_unsharded=0``
frees every gathered param after forward, as FSDP2 does. With params or activations
offloaded (``OffloadPolicy``) the default keeps nothing: offload asks for the least
device memory, and activation offload would move the kept params to the host and back.
``offload_optimizer_states``, set up after ``parallelize``, drops a default plan of its
optimizer's models the same way (``drop_default_plan``).

[Note: automatic selective unsharding]
``keep_unsharded="auto"`` sizes the kept blocks from ``memory_budget`` instead of by
hand. Before any step runs, nothing says how much a step needs (activations depend on
the batch, optimizer state on the optimizer), so the first two optimizer steps run as
pure stage 3 and the plan is made right after the second one (``AutoUnsharding``):

    headroom = memory_budget - peak allocated so far      (on each rank)
    headroom = min over every rank of the model's mesh    (one all-reduce)
    keep whole blocks, last first, while they fit in headroom

The first step allocates the optimizer state, the second runs the way every later one
will, and the allocator's peak since the process started (or since the user last
reset it) covers both, so it errs on the high side. The minimum over ranks makes the
decision the same everywhere, so every rank keeps the same params and issues the same
collectives. A kept block adds at most its unsharded bytes to the step's peak: it is
alive from its forward gather to its last backward use, which is where the peak of a
training step lies. From the third step on, the kept params' gathers are no longer
tagged for recomputation, so ``torch.compile`` compiles the model's graphs once more.

The peak comes from the CUDA allocator (``torch.cuda.max_memory_allocated``). Other
devices have no such counter: there the plan keeps nothing and says so in the log.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from fczero.comm import collectives
from fczero.core.memory import budget_and_peak
from fczero.core.policies import SHARD
from fczero.core.state import AutoPlan, KeptPlan, root_state

if TYPE_CHECKING:
    import torch.nn as nn

    from fczero.core.spec import ShardSpec
    from fczero.core.state import ParamState, RootState

#: Optimizer steps that run as pure stage 3 before the automatic plan is made.
AUTO_PLAN_AFTER_STEPS = 2

logger = logging.getLogger("fczero")

_INDEXED = re.compile(r"^(.*?\.\d+)(\.|$)")


def block_of(path: str) -> str:
    """The model block a module path belongs to: ``layers.3`` for ``layers.3.attn.wq``;
    the top-level child (``embed``) for a path outside indexed containers."""
    match = _INDEXED.match(path)
    if match:
        return match.group(1)
    return path.split(".")[0]


def budget_of(
    keep_unsharded: int | str,
    params: Sequence[tuple[str, torch.Tensor, ShardSpec]],
    world: int,
    offload: str | None,
) -> tuple[int, str]:
    """Bytes a plan made at ``parallelize`` may keep, and where the number comes from:
    ``keep_unsharded`` itself, or for ``"shard"`` one shard's worth ([Note: the default
    kept bytes]); ``offload`` names the offload asked for, if any (then none is kept)."""
    if keep_unsharded != SHARD:
        return int(keep_unsharded), ""
    if offload is not None:
        return 0, f"keep_unsharded='shard' with {offload}: none"
    total = sum(spec.unsharded_bytes(param) for _, param, spec in params)
    return total // world, (
        f"keep_unsharded='shard': {total / 2**20:.1f} MiB of unsharded params over {world} "
        f"rank{'s' if world > 1 else ''}"
    )


def drop_default_plan(root: RootState, offload: str) -> None:
    """``offload`` (optimizer-state offload, set up after ``parallelize``) asks for the
    least device memory: the params the default kept are freed after forward again
    ([Note: the default kept bytes]). A plan the user sized is left alone."""
    if root.options.comm.keep_unsharded != SHARD or root.kept is None or not root.kept.ids:
        return
    keep_exactly(root, frozenset())
    root.kept = plan_kept_params([], 0, f"keep_unsharded='shard' with {offload}: none")
    logger.info("selective unsharding: %s", describe(root.kept))


def keep_exactly(root: RootState, ids: frozenset[int]) -> None:
    """Keep unsharded exactly the params of ``root`` whose ``id`` is in ``ids`` (a changed
    param gets a replaced spec, which its module's getter and the compiled guards see)."""
    for state in root.params:
        keep = id(state.param) in ids
        if state.spec.keep_unsharded != keep:
            state.spec = dataclasses.replace(state.spec, keep_unsharded=keep)
    # eager prefetch replays gathers with the specs it recorded: record anew
    if root.prefetch is not None:
        root.prefetch.order = None


def by_last_owner(
    owners: Sequence[tuple[str, nn.Module, str, torch.Tensor]],
    specs: dict[int, tuple[torch.Tensor, ShardSpec]],
) -> list[tuple[str, torch.Tensor, ShardSpec]]:
    """``(module path, param, spec)`` of each param once, in registration order, a param
    that several modules share listed where its last owner registers it ([Note: a shared
    param is kept where it is read last]). ``owners``: ``(module path, module, name,
    param)`` of every registration; ``specs``: each param's (sharded param, spec) by id.

    [Note: a shared param is kept where it is read last]
    A tied embedding is registered by the embedding, first, and read again by the head,
    last: the head's backward, the first of backward, needs it gathered again, with no
    compute yet to hide that all-gather behind (on 2 x H200, Hugging Face's Llama 3B
    without checkpointing, the all-gather that opened backward ran 1.5 to 1.9 ms with
    nothing beside it). The plan walks blocks from the last one back, so listing the
    shared param under the head puts it first in line to stay gathered. Its gathered copy
    is alive through the forward anyway (the embedding reads it first, the head last), so
    keeping it until the head's backward adds little to the peak."""
    last: dict[int, tuple[str, torch.Tensor]] = {}
    for path, _, _, param in owners:
        last.pop(id(param), None)  # (re-inserted: dicts keep insertion order)
        last[id(param)] = (path, param)
    return [(path, param, specs[id(param)][1]) for path, param in last.values()]


def plan_kept_params(
    params: Sequence[tuple[str, torch.Tensor, ShardSpec]], budget: int, source: str = ""
) -> KeptPlan:
    """Plan from ``(module path, param, spec)`` in registration order (a shared param
    appears once, under its last owner: ``by_last_owner``). Whole blocks are kept from the
    last one back while they fit in ``budget``."""
    source = source or f"keep_unsharded={budget}"
    blocks: dict[str, list[tuple[torch.Tensor, ShardSpec]]] = {}
    for path, param, spec in params:
        # a module outside indexed containers is a unit of its own: the head of
        # ``model.output`` must not share a unit with ``model.embed``
        unit = block_of(path) if _INDEXED.match(path) else path
        blocks.setdefault(unit, []).append((param, spec))
    kept: set[int] = set()
    spent = 0
    names: list[str] = []
    for name, members in reversed(blocks.items()):
        if budget <= 0:
            break
        size = sum(spec.unsharded_bytes(param) for param, spec in members)
        if spent + size > budget:
            break
        spent += size
        kept.update(id(param) for param, _ in members)
        names.append(name)
    return KeptPlan(frozenset(kept), tuple(reversed(names)), spent, max(budget, 0), source)


def describe(plan: KeptPlan) -> str:
    """One line: what is kept, of how much, from where."""
    if not plan.blocks:
        return f"nothing kept, {plan.budget / 2**20:.1f} MiB to spend ({plan.source})"
    return (
        f"{len(plan.blocks)} blocks kept unsharded from forward to backward "
        f"({', '.join(plan.blocks)}), {plan.kept_bytes / 2**20:.1f} MiB of "
        f"{plan.budget / 2**20:.1f} MiB ({plan.source})"
    )


def after_step(root: RootState) -> None:
    """After every optimizer step that updates ``root``'s params: count it, and plan once
    the count is reached, under ``keep_unsharded="auto"`` (else nothing)."""
    auto = root.auto_unsharding
    if auto is not None:
        cast(AutoUnsharding, auto).after_step()  # (the only kind parallelize sets)


class AutoUnsharding(AutoPlan):
    """``keep_unsharded="auto"``: counts optimizer steps, then plans once ([Note:
    automatic selective unsharding])."""

    def __init__(
        self,
        model: nn.Module,
        candidates: list[tuple[str, ParamState]],
        memory_budget: int | None,
        device: torch.device,
        groups: list[dist.ProcessGroup],
    ) -> None:
        self.model = weakref.ref(model)
        self.candidates = candidates  # (first owner's module path, state), registration order
        self.memory_budget = memory_budget
        self.device = device
        self.groups = groups  # every axis of the model's mesh: the minimum is global
        super().__init__()

    def after_step(self) -> None:
        """Called after every optimizer step that updates this model's params."""
        if self.plan is not None:
            return
        self.steps += 1
        if self.steps < AUTO_PLAN_AFTER_STEPS:
            return
        self.plan = self._decide()
        logger.info("selective unsharding: %s", describe(self.plan))
        if self.plan.ids:
            self._apply(self.plan.ids)

    def _decide(self) -> KeptPlan:
        measured = budget_and_peak(self.device, self.memory_budget)
        if isinstance(measured, str):
            # the same on every rank (one device type per mesh): no collective either way
            why = measured if measured == "no memory_budget" else f"{measured} on this device"
            return plan_kept_params(
                [],
                0,
                f"auto: {why} on {self.device.type}; pass memory_budget and train on a CUDA "
                "device, or give CommPolicy(keep_unsharded=...) in bytes",
            )
        budget, peak = measured
        headroom = torch.tensor([budget - peak], dtype=torch.int64, device=self.device)
        for group in self.groups:
            collectives.reduce_in_place(headroom, dist.ReduceOp.MIN, group)
        spare = int(headroom.item())
        source = (
            f"auto after {self.steps} steps: memory_budget {budget / 2**20:.1f} MiB - "
            f"peak {peak / 2**20:.1f} MiB on this rank; least headroom over ranks "
            f"{spare / 2**20:.1f} MiB"
        )
        params = [(path, state.param, state.spec) for path, state in self.candidates]
        return plan_kept_params(params, spare, source)

    def _apply(self, ids: frozenset[int]) -> None:
        """Keep the planned params (nothing was kept before: "auto" plans alone); the next
        step uses them."""
        model = self.model()
        root = root_state(model) if model is not None else None
        if root is not None:
            keep_exactly(root, ids)


def report_line(kept: KeptPlan | None, auto: AutoPlan | None) -> str | None:
    """What ``fczero.memory_report`` says of selective unsharding (None: not in use)."""
    if auto is not None:
        if auto.plan is None:
            return (
                f"auto, planned after optimizer step {AUTO_PLAN_AFTER_STEPS} "
                f"({auto.steps} so far): nothing kept yet"
            )
        return describe(auto.plan)
    return describe(kept) if kept is not None and kept.budget > 0 else None
