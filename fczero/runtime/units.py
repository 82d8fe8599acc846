"""Units: a block's params are gathered together when the block's forward begins.

[Note: units]
A *unit* is a module whose params fczero gathers as a whole: when the unit's forward
begins, every param it owns is gathered, in registration order, and each read of one of
those params inside the unit returns that gathered param. When the unit's forward ends
the gathered params are dropped (stage 3 frees them; backward gathers again).

Why not gather on each read: the number of reads can depend on the data. A
mixture-of-experts layer that skips experts without tokens reads an idle expert's params
zero times on one rank and once on another, and so would issue a different number of
all-gathers on each: gloo aborts, NCCL hangs or pairs unrelated buffers. A unit's gathers
depend only on which units run, and the units are chosen from the model's structure.

Backward is rank-safe the same way. The params of a unit leave its gather through one
autograd node (``_Together``), so if any of them gets a gradient, all of them do (zeros
for those this rank never read), and every rank reduces the same grads in the same order.

Which modules are units (``parallelize(units=...)``):
- ``"auto"``: each child of the outermost indexed containers (the ``layers.3`` of
  ``layers.3.mlp.experts.1.up``; an ``nn.ModuleList`` or ``nn.Sequential`` of blocks), and
  outside them each module that owns params itself (an embedding, a final norm, a head),
  and the root for its own. Experts nested in a block belong to the block. A module
  outside the blocks that runs on some ranks only must be named (or sit in a named unit).
- a list of modules or module classes: those, and as with ``"auto"`` each module outside
  them that owns params itself. A param belongs to the innermost unit that contains its
  module, as with FSDP2's ``fully_shard`` on submodules.
- ``None``: no units; each read gathers (the order of reads must
  then be the same on every rank; ``CheckPolicy`` checks it before each gather).

A param read outside its unit's forward (a weight shared with a module in another unit,
or a read from user code between steps) is gathered on its own, as before.

Under ``torch.compile`` the unit's forward is traced like any other; its gathers
are graph nodes like any other, and the compile passes move each one to where it is used
(``fczero.passes.schedule``). The wrapper records the gathered params on the params' states,
a side effect that torch allows inside a checkpointed region only when asked
(``_allow_side_effects``): the record is set and cleared inside the unit, so nothing of it
outlives the region, and recomputing the region in backward needs none of it.

Experimental, off by default: ``REUSE_BLOCKS`` compiles the
body of every block of one class once (``nested_compile_region``), the gathers staying
outside ([Note: a block compiled once]).
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import os
import re
import types
import weakref
from collections.abc import Sequence

import torch
import torch._dynamo.utils
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from fczero.core.state import ATTR, ParamState, Unit, module_state
from fczero.passes.install import keep_region_inputs
from fczero.runtime import recompute
from fczero.runtime.prefetch import running
from fczero.runtime.wiring import gathered_for_recompute, unsharded_param

logger = logging.getLogger("fczero")

#: Runs a function whose attribute writes Dynamo accepts inside a higher-order op's region
#: (activation checkpointing): torch's own helper where it has one, else a plain call.
_allow_side_effects = getattr(
    torch._dynamo.utils,
    "_disable_side_effect_safety_checks_for_current_subtracer",
    lambda fn, *args: fn(*args),
)

def _outermost_indexed(path: str) -> bool:
    """Whether ``path`` ends in its first numeric component: a child of an outermost
    indexed container (``layers.3``, ``model.layers.0``, ``t5.encoder.block.1``,
    ``layer1.0``; not ``layers.3.experts.1``). A component is numeric when all of it is
    digits: ``t5`` and ``layer1`` are names."""
    parts = path.split(".")
    return parts[-1].isdigit() and not any(part.isdigit() for part in parts[:-1])


UnitSpec = str | Sequence[nn.Module | type] | None


def auto_unit_paths(model: nn.Module) -> list[str]:
    """The units ``"auto"`` picks: each child of an outermost indexed container that owns
    params (a block), and each module outside the blocks that owns params itself (an
    embedding, a final norm, a head)."""
    blocks = [
        path
        for path, module in model.named_modules()
        if path and _outermost_indexed(path) and any(True for _ in module.parameters())
    ]
    return _with_owners_outside(model, blocks)


def _with_owners_outside(model: nn.Module, blocks: list[str]) -> list[str]:
    """``blocks``, and each module outside them that owns params itself, in module order.

    [Note: a unit per module outside the blocks]
    Not one unit for everything outside the blocks: its gathers would all be traced where
    the root's forward begins, under the root's module path, and the compile passes,
    which bucket by module path, would then put the head's gather in one bucket with the
    embedding's (gathered for the whole forward) and cut backward's reduce-scatters
    differently. A unit per module keeps the paths, and the compiled graphs, of gathering
    on each read (tests/runtime/test_units.py compares them)."""
    inside = tuple(f"{b}." for b in blocks)
    owners = [
        path
        for path, module in model.named_modules()
        if path
        and path not in blocks
        and not path.startswith(inside)
        and any(p is not None for p in module._parameters.values())
    ]
    order = {p: i for i, (p, _) in enumerate(model.named_modules())}
    return sorted([*blocks, *owners], key=order.__getitem__)


def unit_paths(model: nn.Module, units: UnitSpec) -> list[str]:
    """The paths of the unit modules ``units`` names, the root (``""``) first."""
    if units is None:
        return []
    if isinstance(units, str):
        if units != "auto":
            raise ValueError(
                f"fczero: units={units!r} is not an option; pass 'auto' (the default: each "
                "block gathered whole), None (each read gathers) or a list of modules or "
                "module classes."
            )
        return ["", *auto_unit_paths(model)]
    wanted = list(units)
    modules = {id(m) for m in wanted if isinstance(m, nn.Module)}
    classes = tuple(c for c in wanted if isinstance(c, type))
    bad = [u for u in wanted if not isinstance(u, (nn.Module, type))]
    if bad:
        raise TypeError(
            f"fczero: units must hold nn.Module instances or classes, got {type(bad[0]).__name__}."
        )
    paths = [
        path
        for path, module in model.named_modules()
        if path and (id(module) in modules or isinstance(module, classes))
    ]
    found = {id(module) for path, module in model.named_modules() if path in set(paths)}
    missing = modules - found - {id(model)}
    if missing:
        raise ValueError(
            "fczero: a module passed in units is not a submodule of the model; pass modules "
            "of the model being parallelized (or their classes)."
        )
    outermost = [p for p in paths if not any(p.startswith(f"{q}.") for q in paths)]
    nested = [p for p in paths if p not in outermost]
    units = _with_owners_outside(model, outermost)
    order = {p: i for i, (p, _) in enumerate(model.named_modules())}
    return ["", *sorted([*units, *nested], key=order.__getitem__)]


def build_units(model: nn.Module, paths: list[str], states: dict[int, ParamState]) -> list[Unit]:
    """The units at ``paths`` (``unit_paths``) with their params' states (``states``: by id
    of sharded param). Each param goes to the innermost unit holding the first module that
    owns it."""
    if not paths:
        return []
    by_path = {path: Unit(path) for path in paths}
    taken: set[int] = set()
    for path, module in model.named_modules():
        owner = _innermost(path, by_path)
        for param in module._parameters.values():
            state = states.get(id(param)) if param is not None else None
            if state is None:
                continue
            if id(param) in taken:
                reader = by_path[owner]
                if state.unit is not reader:
                    state.read_outside_unit = True  # ([Note: a param that two units read])
                    if state not in reader.foreign:
                        reader.foreign.append(state)
                continue
            taken.add(id(param))
            by_path[owner].states.append(state)
            state.unit = by_path[owner]
            state.spec.join_unit(owner)  # (eager buckets stop at the unit's edge)
    found = [unit for unit in by_path.values() if unit.states]
    logger.info(
        "units: %d (%s), %d params",
        len(found),
        _summary([u.path or "<root>" for u in found]),
        len(taken),
    )
    return found


def _innermost(path: str, by_path: dict[str, Unit]) -> str:
    while path and path not in by_path:
        path = path.rpartition(".")[0]
    return path


def _summary(paths: list[str], limit: int = 4) -> str:
    shown = ", ".join(paths[:limit])
    return shown if len(paths) <= limit else f"{shown}, ... {len(paths) - limit} more"


#: user class -> its unit subclass (per process, held weakly, as the wired classes are)
_UNIT_CLASSES: weakref.WeakValueDictionary[type, type] = weakref.WeakValueDictionary()

#: Experimental, off by default ([Note: a block compiled once]): under ``torch.compile`` the
#: forward of a unit whose class has several units (a block) runs in one
#: ``nested_compile_region`` per class, its gathers staying outside. Set
#: ``FCZERO_REUSE_BLOCKS=1`` before importing fczero, or this attribute before ``parallelize``
#: (which reads it, and then turns off AOT autograd's donated buffers: [Note: a region's
#: backward must not write over its inputs]).
REUSE_BLOCKS = os.environ.get("FCZERO_REUSE_BLOCKS", "0") == "1"
_REGIONS = itertools.count()  # (a unique code object per region)


def install(model: nn.Module, units: list[Unit], device: torch.device) -> None:
    """Make each unit's module gather its params when its forward begins and drop them
    when it ends: its class becomes a subclass whose ``forward`` wraps the user's. Inside
    ``forward``, not in a forward hook: ``torch.compile(model)`` traces the root's
    ``forward`` but runs the root's hooks outside the graph, where the gathers would be
    cut off from the passes and from recomputation in backward. Inside ``forward`` they
    also follow every forward pre-hook (the root's opens the eager context). ``device``:
    the mesh's (whether ``REUSE_BLOCKS`` is honoured there)."""
    modules = dict(model.named_modules())
    per_class = collections.Counter(type(modules[unit.path]) for unit in units)
    regions = REUSE_BLOCKS and _regions_work_on(device)
    compiled_before: list[str] = []
    for unit in units:
        module = modules[unit.path]
        cls = type(module)
        unit.region = regions and per_class[cls] > 1
        unit.cls = cls
        module_state(module, create=True).unit = unit
        if getattr(module, "_compiled_call_impl", None) is not None:
            compiled_before.append(unit.path or "the root")
        wrapped = _UNIT_CLASSES.get(cls)
        if wrapped is None:
            attrs = {
                "forward": _unit_forward(cls.forward),
                "compile": _compile_body(cls.forward),
                "__module__": cls.__module__,
            }
            wrapped = type(cls.__name__, (cls,), attrs)
            _UNIT_CLASSES[cls] = wrapped
        module.__class__ = wrapped
    if compiled_before:
        _warn_compiled_before(compiled_before)
    if any(unit.region for unit in units):
        keep_region_inputs()


def _regions_work_on(device: torch.device) -> bool:
    """``REUSE_BLOCKS`` is honoured on the CPU, and on GPUs from torch 2.13. On 2 x H200
    with torch 2.11, Hugging Face's Llama at 3B with its own checkpointing trained wrongly
    with regions even with [Note: a region's backward must not write over its inputs]
    applied (the loss fell from 12.37 to 7.82 in one step, where FSDP2's and fczero's
    without regions fell to 10.23-10.25, and the peak rose from 26.2 to 40.0 GiB), while
    fczero's own Llama trained as without regions; torch 2.13 was not run on a GPU. The
    CPU checks agree with the reference on torch 2.11 and 2.13."""
    if device.type == "cpu" or torch.torch_version.TorchVersion(torch.__version__) >= (2, 13):
        return True
    logger.warning(
        "fczero: REUSE_BLOCKS is ignored on %s with torch %s: it trained wrongly there "
        "(Hugging Face's Llama with its checkpointing); the blocks are traced inline as "
        "without it (needs torch 2.13 or newer on GPUs).",
        device.type,
        torch.__version__,
    )
    return False


def _warn_compiled_before(paths: list[str]) -> None:
    """Units compiled before ``parallelize`` (``module.compile()``, as FSDP2's torchtitan
    order has it) trace their gathers into their own graphs, where nothing prefetches them."""
    logger.warning(
        "fczero: %d unit(s) were compiled before parallelize (%s): their gathers run inside "
        "their graphs, each block waiting for its own. Call .compile() on them after "
        "parallelize instead: the gathers then stay outside, prefetched a block ahead "
        "([Note: blocks compiled alone]).",
        len(paths),
        _summary(paths),
    )


def _unit_forward(forward):
    region = _shared_region(forward)

    @functools.wraps(forward)
    def unit_forward(self: nn.Module, *args, **kwargs):
        unit = self.__dict__[ATTR].unit
        compiling = torch.compiler.is_compiling()
        outermost = not unit.depth
        # eager around a body compiled by ``module.compile()`` ([Note: blocks compiled alone])
        body = unit.compiled if outermost and not compiling else None
        if body is not None and torch._C._len_torch_dispatch_stack():
            _say_uncompiled_once(unit)
            body = None
        reuse = body is None and unit.region and outermost and compiling
        _enter(unit)
        try:
            if body is not None:
                if unit.foreign:
                    _borrow(unit)
                return body(self, *args, **kwargs)
            if reuse:
                fulls = tuple(state.current for state in unit.states)
                return region(self, fulls, *args, **kwargs)
            return forward(self, *args, **kwargs)
        finally:
            _leave(unit)

    return unit_forward


def _say_uncompiled_once(unit: Unit) -> None:
    """A block compiled alone runs its plain forward while a dispatch mode is active: a
    selective checkpoint around it (fczero's Llama with ``checkpointing="selective"``, a
    ``context_fn`` of the user's) runs its forward and its recompute under one. On 4 x H200
    (torch 2.11, Llama-3-8B's shape) the compiled body under that eager region saved other
    tensors in the recompute than in forward and the checkpoint raised; on the CPU it did
    not. The plain forward is what the region records and replays correctly. Every rank
    runs under the same modes, so every rank takes the same path. One warning per model."""
    root = unit.states[0].root if unit.states else None
    if root is not None and not root.warned_uncompiled_blocks:
        root.warned_uncompiled_blocks = True
        logger.warning(
            "fczero: block %r runs uncompiled inside a selective activation checkpoint (or "
            "another dispatch mode), and so do the others like it: block.compile() does not "
            "run under an eager selective checkpoint. Compile the whole model "
            "(torch.compile(model)), or checkpoint the blocks fully, to keep them compiled "
            "([Note: blocks compiled alone]).",
            unit.path,
        )


def _compile_body(forward):
    """The unit class's ``compile``: ``module.compile(**options)`` compiles the user's
    ``forward`` and leaves the unit's gathers out of it.

    [Note: blocks compiled alone]
    torchtitan's recipe compiles each block on its own (``block.compile()`` for every block
    after sharding). Dynamo keys its cache on the code object, so every block of one class
    shares the compiled graphs and the first step costs one block's compile, whatever the
    depth. ``nn.Module.compile`` would trace the unit's wrapper too, with the unit's gathers
    at the start of each block's graph: nothing could issue the next block's gather while
    this block computes, and each block would wait for its own.

    Here the unit's forward stays eager around the compiled body: ``_enter`` gathers the
    unit's params through fczero's eager runtime (the order recorded at the first forward,
    the next unit's gather prefetched on the communication stream, consecutive gathers
    bucketed, grads reduce-scattered by the bucket's backward), and the compiled body reads
    each param as the gathered tensor its unit holds (``state.current``), which Dynamo lifts
    as a graph input. Whole-model ``torch.compile(model)`` ignores this: it traces the
    wrapper, gathers included, as before."""

    def compile(self: nn.Module, *args, **kwargs) -> None:
        unit = self.__dict__[ATTR].unit
        root = unit.states[0].root if unit.states else None
        first = root is not None and not any(
            s.unit is not None and s.unit.compiled is not None for s in root.params
        )
        unit.compiled = torch.compile(forward, *args, **kwargs)
        if first:  # one line per model: its first unit compiled on its own
            logger.info(
                "fczero: %s compiles on its own, its gathers and reduce-scatters eager around "
                "it (prefetched, bucketed); fczero's graph passes, activation offload and "
                "memory_budget's prefetch plan act on whole-model compiles only.",
                type(self).__name__,
            )

    compile.__doc__ = (
        "Compile this block's forward (``torch.compile`` options); fczero's gathers stay "
        "eager around it, prefetched ([Note: blocks compiled alone] in fczero.runtime.units)."
    )
    return compile


def _shared_region(forward):
    """One ``nested_compile_region`` running the user's ``forward`` of one class, for
    ``REUSE_BLOCKS`` (cheap to make: a wrapped function; used only while compiling).

    [Note: a block compiled once]
    Experimental (``REUSE_BLOCKS``, off by default). Under ``torch.compile`` a unit whose
    class has other units in the model (the blocks) runs the user's forward inside one
    ``torch.compiler.nested_compile_region`` per class, so Dynamo traces the first block
    and stamps out the same subgraph for the others, and AOT autograd and Inductor
    compile one forward and one backward subgraph for all of them.

    The unit's gathers stay outside the region, in the outer graph, where the passes
    bucket, sink and prefetch them as before. The gathered params enter the region as
    explicit inputs (``fulls``) which the body does not touch: its param reads return
    ``state.current``, the very tensors passed, and Dynamo lifts each read as that input
    (a lifted tensor must be an input of the call for Dynamo to reuse the subgraph).
    The region's own partition saves the params (views of them) for its backward;
    ``fczero.passes.regions.reroute_region_views_pass`` hands its backward the outer
    gathers instead, so backward regathers as it does without regions.

    Dynamo keys its reuse cache on the body's code object (by equality), so each class
    gets a code object of its own (a unique ``co_name``)."""

    def body(self, fulls, *args, **kwargs):
        return forward(self, *args, **kwargs)

    name = f"{getattr(forward, '__qualname__', 'forward')}_region{next(_REGIONS)}"
    code = body.__code__.replace(co_name=re.sub(r"\W", "_", name))
    fn = types.FunctionType(code, body.__globals__, code.co_name, None, body.__closure__)
    return torch.compiler.nested_compile_region(fn)


def _enter(unit: Unit) -> None:
    """The unit's forward begins: gather all its params (none again if it is running)."""
    if unit.depth:
        _allow_side_effects(_deepen, unit)
        return
    compiling = torch.compiler.is_compiling()
    if compiling:  # (a compiled graph issues the same collectives on every rank anyway)
        # inside a checkpointed block, an accumulation's bookkeeping writes to the states
        # (the synced micro-batch drops each accumulator, a kept param's reused gather):
        # Dynamo accepts the writes there as it does the unit's own record, instead of
        # breaking the graph and running the whole forward frame eagerly from then on
        fulls = _allow_side_effects(_gathered_traced, unit)
    elif recompute.in_backward():  # a checkpoint recomputes the unit
        fulls = recompute.regather(unit) or [unsharded_param(s, s.param, False) for s in unit.states]
    else:
        root = unit.states[0].root
        unit.previous, root.last_unit = root.last_unit, weakref.ref(unit)
        fulls = together([unsharded_param(s, s.param, False) for s in unit.states])
        context = running(root)
        if context is not None and context.scope is not None:
            context.scope.group(fulls)  # regathered in backward as one unit too
    _allow_side_effects(_hold, unit, fulls)


def _borrow(unit: Unit) -> None:
    """Before a body compiled alone runs: gather each param of another unit that it reads
    and no forward holds now, and hold it while the unit runs.

    [Note: a tied param in a block compiled alone]
    A block's compiled body reads each param as the gathered tensor ``state.current``
    holds, and Dynamo guards on what it found there. A weight tied across blocks belongs
    to the first block; a later block finds it held by the running forward ([Note: a param
    that two units read]) and its graph takes it as an input. When backward recomputes
    that block (activation checkpointing), no forward holds it: the guard failed, Dynamo
    traced the block again with the gather inside, the recompute saved other tensors than
    the forward, and the checkpoint raised (CheckpointError, 2 gloo ranks). So a unit with
    such params gathers the ones nobody holds when its body is about to run, in forward
    (with autograd, as a read outside its unit gathers) and in a recompute (without), and
    the body always finds them there. Which params these are follows from the model's
    structure and the order its units run in, the same on every rank."""
    backward = recompute.in_backward()
    for state in unit.foreign:
        if state.current is None:
            if backward:
                full = gathered_for_recompute(state)
            else:
                full = unsharded_param(state, state.param, False)
            state.current = full
            unit.borrowed.append((state, full))


def _gathered_traced(unit: Unit) -> list[torch.Tensor]:
    """The unit's params gathered as a compiled graph traces them."""
    return [unsharded_param(s, s.leaf, True) for s in unit.states]


def _leave(unit: Unit) -> None:
    """The unit's forward ended (or raised): drop its gathered params."""
    if unit.depth:
        _allow_side_effects(_release, unit)


def _deepen(unit: Unit) -> None:
    unit.depth += 1


def _hold(unit: Unit, fulls: list[torch.Tensor]) -> None:
    unit.depth += 1
    for state, full in zip(unit.states, fulls):
        state.current = full


def _release(unit: Unit) -> None:
    """The unit's outermost forward ended: let its gathers go, but hand those that a
    module outside it reads too to the running eager forward.

    [Note: a param that two units read]
    A tied embedding belongs to the unit of the module that registers it first (the
    embedding); the head reads it too, outside that unit. Let go at the embedding's end,
    it was gathered a second time for the head, and its grad reduce-scattered twice. An
    eager forward instead keeps that gather until the forward ends (the head's read returns
    it, as a read inside a unit does), so the param is gathered and reduced once a step,
    and its gathered copy lives through the forward, as FSDP2's root group keeps the root's
    params. Which params these are follows from the model's structure, the same on every
    rank. A compiled graph gathers such a param once already (Dynamo traces both reads of
    one gathered tensor), and outside a forward there is nothing to hold it to."""
    unit.depth -= 1
    if unit.depth == 0:
        context = None
        if unit.states and not torch.compiler.is_compiling():  # (compiled: read no more of
            context = unit.states[0].root.context  # the state than the gather needs)
        for state in unit.states:
            if context is not None and state.read_outside_unit and state.current is not None:
                context.held.append(state)
            else:
                state.current = None
        if unit.borrowed:  # (never under compile: only bodies compiled alone borrow)
            for state, full in unit.borrowed:
                if state.current is full:
                    state.current = None
            unit.borrowed.clear()


class _Together(torch.autograd.Function):
    """Identity on several gathered params, as one autograd node: backward runs for all of
    them once any has a grad, with zeros for the others (autograd materializes them)."""

    @staticmethod
    def forward(ctx, *fulls: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        plain = [_waited(f) for f in fulls]
        return tuple(f.view_as(f) for f in plain)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return grads


def _waited(full: torch.Tensor) -> torch.Tensor:
    """A gathered param as a plain tensor: an eager gather over NCCL hands over an
    ``AsyncCollectiveTensor`` (settled: its wait is already on the stream), whose views
    would stay wrapped; its plain tensor shares the storage the reshard scope keys on."""
    return full.elem if isinstance(full, AsyncCollectiveTensor) else full


def together(fulls: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tie the gathered params that carry grads into one autograd node (see the note),
    plain or still wrapped as they come from NCCL; others (no grad, tensor-parallel
    DTensors) pass unchanged.

    [Note: gathers over NCCL are wrapped]
    Over gloo fczero waits for each collective at once and hands over plain tensors; over
    NCCL an eager gather hands over an ``AsyncCollectiveTensor``. A tie that took only
    plain tensors left NCCL's gathers untied: a rank whose idle experts got no grad then
    reduced fewer grads than the others, and NCCL hung (tests/runtime/test_units.py ties
    wrapped gathers on the CPU).

    [Note: one node, one tie]
    From the second step on, a unit's gathers usually come out of one eager bucket
    (``fczero.runtime.eager_buckets``), whose autograd node already runs its backward, with
    zeros for the members that got none, once any member has a grad. A second node around
    them would cost an ``autograd.Function`` call and a backward node per unit and step
    for nothing, so it is left out there. Whether it is left out follows from the buckets,
    which every rank plans alike; and either way every grad of the unit is reduced."""
    tied = [
        i
        for i, f in enumerate(fulls)
        if f.requires_grad and type(f) in (torch.Tensor, AsyncCollectiveTensor)
    ]
    if len(tied) < 2:
        return fulls
    node = fulls[tied[0]].grad_fn
    if node is not None and all(fulls[i].grad_fn is node for i in tied[1:]):
        return fulls  # one node already ties them: their bucket's ([Note: one node, one tie])
    out = list(fulls)
    for i, f in zip(tied, _Together.apply(*(fulls[i] for i in tied))):
        out[i] = f
    return out
