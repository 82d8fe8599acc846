"""The state fczero keeps per sharded param, per module and per root, and the one
attribute (``_fczero``) through which a module, a model or an optimizer reaches it.

- ``ParamState``: one sharded param: its ``ShardSpec``, its whole copy (stages 1/2), its
  accumulated grads, its reused gather, its reduce route, and the plain leaf that
  compiled graphs and eager gathers differentiate. Every managed param has one (stage 3
  too); the unsharded-param property (``fczero.runtime.wiring``) reads it to decide how
  to gather.
- ``ModuleState``: the ``_fczero`` attribute of every module that owns sharded params or
  is a parallelized root: its params' states by name, and for a root its ``RootState``.
- ``RootState``: one parallelized root (options, params in order, sync flag, the eager
  context of its forward, the settings of its compiled passes).
- ``OptimizerState``: the ``_fczero`` attribute of an optimizer that holds fczero params
  (offload handles, whether it steps in parts, the states it holds).
- Records that those hold and the layers above fill or extend: ``Unit``, ``KeptPlan``,
  ``GatherOrder`` and ``EagerForward`` (the eager runtime's ``EagerPrefetch`` and
  ``EagerContext`` extend them), ``AutoPlan``, ``LocalView``, ``StateOffload``. Every slot is
  typed by one of them, and nothing here imports a layer above.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fczero.comm.collectives import settle_in_flight
from fczero.comm.consistency import EagerLog
from fczero.comm.whole_grads import Reducer, Route
from fczero.core.cuda_graphs import keep_first_grad_out_of_pool
from fczero.core.spec import sharded_grad
from fczero.core.weak_ids import WeakIds

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fczero.core.config import Options, PassSettings
    from fczero.core.spec import ShardSpec

#: The one attribute fczero sets: on managed modules and roots (a ``ModuleState``) and on
#: optimizers that hold fczero params (an ``OptimizerState``).
ATTR = "_fczero"


class ModuleState:
    """A module's ``_fczero``: its sharded params' states by name; a root's ``RootState``;
    a unit's ``Unit``."""

    __slots__ = ("params", "root", "unit")

    def __init__(self) -> None:
        self.params: dict[str, ParamState] = {}
        self.root: RootState | None = None
        self.unit: Unit | None = None


class OptimizerState:
    """An optimizer's ``_fczero``."""

    __slots__ = (
        "offload", "in_parts", "host_step_checked", "params", "states", "sharded", "devices",
        "roots", "view", "swap",
    )  # fmt: skip

    def __init__(self) -> None:
        self.offload: list[StateOffload] = []  # its optimizer-state offloads (at most one)
        self.in_parts = False  # set while it steps part of its params (one_step_in_parts)
        self.host_step_checked = False  # host memory checked for its host step (param offload)
        # its params when last looked up (and checked: none replaced by parallelize), and
        # weak references to their states
        self.params: tuple[torch.Tensor, ...] = ()
        self.states: list[weakref.ref] = []
        # looked up with them: the ids of its sharded params, the devices that
        # param-offloaded ones compute on, and (weakly) the roots of its params
        self.sharded: frozenset[int] = frozenset()
        self.devices: frozenset[torch.device] = frozenset()
        self.roots: list[weakref.ref] = []
        # the local step's view of it, kept between steps, and the view swapped in while
        # a step runs (fczero.runtime.local_step)
        self.view: LocalView | None = None
        self.swap: LocalView | None = None

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> OptimizerState:
        """The optimizer's ``_fczero`` if it has one, else a fresh record left unattached
        (what a record holds before any use; writing to it changes nothing)."""
        return optimizer.__dict__.get(ATTR) or OptimizerState()


def module_state(module: nn.Module, create: bool = False) -> ModuleState | None:
    """``module``'s ``_fczero`` (made when ``create``), else None."""
    found = module.__dict__.get(ATTR)
    if found is None and create:
        found = module.__dict__[ATTR] = ModuleState()
    return found


def is_parallelized(model: nn.Module) -> bool:
    """True if ``model`` or one of its submodules went through ``parallelize``."""
    return any(ATTR in m.__dict__ for m in model.modules())


def root_state(model: nn.Module) -> RootState | None:
    """The ``RootState`` of a parallelized root (None for any other module)."""
    found = model.__dict__.get(ATTR)
    return found.root if isinstance(found, ModuleState) else None


def optimizer_state(optimizer: torch.optim.Optimizer) -> OptimizerState:
    """The optimizer's ``_fczero``, made on first use (fczero's own uses only: an optimizer
    that holds no fczero param is never given one; readers use ``OptimizerState.of``)."""
    found = optimizer.__dict__.get(ATTR)
    if found is None:
        found = optimizer.__dict__[ATTR] = OptimizerState()
    return found


class RootState:
    """One parallelized root: its options, its params in order, the sync flag, the
    reducer, the eager context of its forward (prefetch, reshard scope, collective log),
    and the settings of its compiled passes.

    The eager runtime opens and closes the context of each of its forwards
    (``fczero.runtime.prefetch.enter_forward``, [Note: the eager context of a forward]);
    the state only holds them."""

    def __init__(self, options: Options, mesh: DeviceMesh) -> None:
        self.options = options
        self.mesh = mesh
        self._sync = True
        self.params: list[ParamState] = []  # registration order, identical on every rank
        self.reducer: Reducer | None = None
        # selective unsharding (``fczero.core.unsharding``): the plan from keep_unsharded
        # bytes, or the automatic planner (an ``AutoUnsharding`` of that module, which
        # imports this one)
        self.kept: KeptPlan | None = None
        self.auto_unsharding: AutoPlan | None = None
        # the eager runtime of this root (set by ``parallelize``): its gather order (the
        # runtime's ``EagerPrefetch``), which lasts from forward to forward, and its
        # collective log (checked)
        self.prefetch: GatherOrder | None = None
        self.eager_log: EagerLog | None = None
        # the compiled passes' settings for this root's graphs (set by ``parallelize``;
        # None: ``compile_passes=False``), with what compiling under them produced
        # ([Note: from a graph to its root] in ``fczero.passes.registry``)
        self.passes: PassSettings | None = None
        # the forwards of this root running now, innermost last: the context each runs in
        # (the runtime's ``EagerContext``), and what it opened itself there (its own
        # context; its log in a joined one)
        self.forwards: list[tuple[EagerForward, bool, bool]] = []
        # the unit gathered again for a recompute in backward (``fczero.runtime.wiring``)
        self.recomputing: Unit | None = None
        # the unit whose eager forward began last, held weakly: the next unit's
        # ``previous`` ([Note: regathers for a recompute] in ``fczero.runtime.recompute``)
        self.last_unit: weakref.ref[Unit] | None = None
        # a block compiled alone ran uncompiled under a selective checkpoint, and said so
        # once (``fczero.runtime.units``)
        self.warned_uncompiled_blocks = False

    @property
    def in_forward(self) -> bool:
        """An eager forward of the root is running."""
        return bool(self.forwards)

    @property
    def context(self) -> EagerForward | None:
        """The context of this root's running eager forward (None between forwards)."""
        return self.forwards[-1][0] if self.forwards else None

    @property
    def sync(self) -> bool:
        """Reduce grads in backward (False: accumulate, see ``fczero.runtime.accumulation``)."""
        return self._sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self._sync = value
        for state in self.params:  # each param reads its own copy when traced
            state.sync = value


def _path_flag(name: str, doc: str) -> property:
    """A ``ParamState`` attribute that picks the compiled getter's path: setting it
    refreshes ``ParamState.traced``, which folds all of them into one guarded value."""
    slot = "_" + name

    def get(state: ParamState) -> Any:
        return getattr(state, slot)

    def set_(state: ParamState, value: Any) -> None:
        setattr(state, slot, value)
        state._retrace()

    return property(get, set_, doc=doc)


class ParamState:
    """One sharded param: its whole copy (stages 1/2) and its accumulated grads.

    ``traced`` is what the compiled getter reads first: the spec's gather constants
    while the plain stage-3 gather is the path, else None ([Note: what a compiled
    gather reads] in ``fczero.core.spec``)."""

    def __init__(self, root: RootState, spec: ShardSpec, param: nn.Parameter) -> None:
        self.root = root
        self.param = param
        # the flags that pick the compiled getter's path, and ``traced``, which folds them
        self._spec, self._sync = spec, root.sync
        self._whole: torch.Tensor | None = None
        self._acc: torch.Tensor | None = None
        self._reused: torch.Tensor | None = None
        self.traced: tuple | None = None
        self._retrace()
        self.route: Route | None = None
        # the sharded param's version counter when ``reused`` was gathered (-1: gathered
        # in a compiled graph)
        self.reused_version = -1
        self.leaf = self._new_leaf(param)
        # the param as its unit gathered it, while the unit's forward runs (else None):
        # what every read inside the unit returns ([Note: units], ``fczero.runtime.units``)
        self.current: torch.Tensor | None = None
        self.unit: Unit | None = None  # the unit it belongs to, if any
        # a module outside that unit reads it too (a tied embedding's head): an eager
        # forward holds its gather from the unit's start to the forward's end
        # ([Note: a param that two units read] in ``fczero.runtime.units``)
        self.read_outside_unit = False

    spec = _path_flag("spec", "The param's ``ShardSpec`` (replaced when it is kept unsharded).")
    sync = _path_flag("sync", "The root's sync flag, copied for the traced getter.")
    whole = _path_flag("whole", "Stages 1/2 (not 0-d): the kept whole copy.")
    acc = _path_flag("acc", "The leaf whose ``.grad`` accumulates while unsynced.")
    reused = _path_flag(
        "reused", "A kept param's gather, reused by the micro-batches of one accumulation."
    )

    def _retrace(self) -> None:
        """Refresh ``traced``: the gather's constants while the plain stage-3 gather is the
        path (sync on, nothing accumulated, no whole copy, a plain param, and for a kept
        param no gather left over from an accumulation)."""
        spec = self._spec
        plain = self._sync and self._whole is None and self._acc is None
        plain = plain and spec.traced[0] and (not spec.keep_unsharded or self._reused is None)
        self.traced = spec.traced if plain else None

    # [Note: what a compiled graph differentiates]
    # A compiled graph that took the sharded DTensor as its input would pay for it on
    # every call: Dynamo checks each DTensor's spec in a Python guard, AOT autograd
    # flattens each into its local tensor, and after backward it builds every grad
    # back into a DTensor (a new spec per grad, with its checks) that AccumulateGrad
    # then detaches through DTensor's dispatch once more. So compiled graphs read
    # ``leaf`` instead: a plain tensor that shares the local shard's storage and version
    # counter and requires grad. Its grad lands through ordinary AccumulateGrad, and
    # one hook (``_grad_arrived``) hands it to the sharded param, wrapped with
    # its spec (``spec.sharded_grad``). The leaf is a static
    # address for CUDA graphs, as a param would be. Eager gathers use it too
    # ([Note: eager grads land on the leaf too], ``differentiated``).
    def _new_leaf(self, param: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, DTensor):
            return param
        leaf = param._local_tensor.detach().requires_grad_(param.requires_grad)
        torch._dynamo.mark_static_address(leaf)
        if param.requires_grad:
            # weakly: a hook is held by the tensor in C++, where the garbage collector cannot
            # see a cycle through it, so a strong one would keep a dropped model alive
            leaf.register_post_accumulate_grad_hook(partial(_grad_arrived, weakref.ref(self)))
        return leaf

    def differentiated(self, param: torch.Tensor) -> torch.Tensor:
        """What an eager gather of sharded ``param`` differentiates: the plain leaf, as
        compiled graphs do, while both it and the param require grad; else the param.

        [Note: eager grads land on the leaf too]
        A grad that autograd accumulates into a DTensor param goes through DTensor's
        dispatch once more (AccumulateGrad detaches it: one Python ``__torch_dispatch__``
        per param per backward, the ``PythonSubclass`` rows of an eager profile). Through
        the leaf the grad is a plain tensor, AccumulateGrad is C++ only, and the leaf's
        hook (``_grad_arrived``) wraps it for the param with its spec
        (``sharded_grad``), the path compiled graphs already take. A param frozen or
        unfrozen after ``parallelize`` no longer matches its leaf's ``requires_grad``;
        it is gathered through the DTensor as before."""
        leaf = self.leaf
        if param.requires_grad and leaf.requires_grad:
            return leaf
        return param

    def new_accumulator(self) -> None:
        """A leaf whose ``.grad`` collects this param's whole grads (reduce_dtype); the leaf
        itself is one element broadcast to the whole shape."""
        if self.acc is not None or not self.param.requires_grad:
            return
        route = self.route
        device = self.spec.compute_device or self.param.device  # (param offload: the device's)
        one = torch.zeros((), dtype=route.reduce_dtype, device=device)
        self.acc = one.expand(self.spec.shape).detach().requires_grad_(True)
        # (CUDA graphs would free it between micro-batches, and a kept param's reused gather)
        keep_first_grad_out_of_pool(self.acc, partial(_reused_out_of_pool, weakref.ref(self)))


@dataclass(frozen=True)
class KeptPlan:
    """Which params stay unsharded from forward to backward, and why (selective unsharding:
    ``fczero.core.unsharding`` makes the plan)."""

    ids: frozenset[int]  # ``id`` of each kept param
    blocks: tuple[str, ...]  # the kept blocks, in registration order
    kept_bytes: int  # their unsharded bytes
    budget: int  # bytes the plan could spend
    source: str  # "keep_unsharded", or "auto: ..." with the numbers it came from


@dataclass(eq=False)
class Unit:
    """One unit ([Note: units] in ``fczero.runtime.units``, which builds them and runs their
    forwards): its module's path and the states of the params it gathers, in order."""

    path: str
    states: list[ParamState] = field(default_factory=list)
    depth: int = 0  # forwards of this unit running now (a unit may call itself)
    region: bool = False  # compiled once for its class with REUSE_BLOCKS (other units share it)
    compiled: Callable | None = None  # its forward, compiled by ``module.compile()``
    cls: type | None = None  # its module's class
    # the unit whose forward began just before this one's in the last eager forward, held
    # weakly (backward prefetches its regather: [Note: regathers for a recompute])
    previous: weakref.ref[Unit] | None = None
    # params of other units that its modules read too (a weight tied across blocks), and
    # those of them it gathered for its compiled body while it runs ([Note: a tied param
    # in a block compiled alone] in ``fczero.runtime.units``)
    foreign: list[ParamState] = field(default_factory=list)
    borrowed: list[tuple[ParamState, torch.Tensor]] = field(default_factory=list)


class GatherOrder:
    """A root's eager gathers in the order its last forward asked for them, and the buckets
    planned over that order: what the next forward replays, prefetching ahead.

    A record: ``fczero.runtime.prefetch.EagerPrefetch`` extends it with the replay itself,
    and ``parallelize`` makes one per root. Selective unsharding forgets the order when its
    plan changes what is gathered (``order = None``: the next forward records anew)."""

    def __init__(self, window: int, bucket_bytes: int) -> None:
        self.window = window  # unsharded bytes issued ahead of the gather asked for
        self.bucket_bytes = bucket_bytes
        # (spec, param, inside a selective-checkpoint region) of each gather, in order
        self.order: list[tuple[ShardSpec, torch.Tensor, bool]] | None = None
        self.sizes: list[int] = []  # unsharded bytes of each recorded gather
        self.bucket_of: dict[int, list[int]] = {}  # position -> its bucket (positions)
        # position -> unsharded bytes that issuing it issues (its whole bucket's, if any)
        self.issue_bytes: list[int] = []
        # position -> whether it belongs to the unit of the position before it
        self.unit_goes_on: list[bool] = []


class EagerForward:
    """One eager forward of a root while it runs, as ``RootState.forwards`` holds it: the
    root that opened it, the collective log it writes to (``check_policy``; else None)
    and the gathered params it keeps until it ends (a tied param that a module outside its
    unit reads: [Note: a param that two units read] in ``fczero.runtime.units``).

    A record: ``fczero.runtime.prefetch.EagerContext`` extends it with the prefetch and the
    reshard scope it runs, and is the only kind the runtime puts on ``RootState.forwards``."""

    def __init__(self, owner: RootState, log: EagerLog | None) -> None:
        self.owner = owner
        self.log = log
        self.held: list[ParamState] = []


class AutoPlan:
    """``keep_unsharded="auto"``'s progress, as a root holds it: optimizer steps counted so
    far, and the plan once made. A record: ``fczero.core.unsharding.AutoUnsharding``
    extends it with the counting and the planning."""

    def __init__(self) -> None:
        self.steps = 0
        self.plan: KeptPlan | None = None


@dataclass
class LocalStates:
    """One param's optimizer states, as the optimizer holds them and as the local step
    sees them ([Note: local step] in ``fczero.runtime.local_step``)."""

    states: dict  # the optimizer's own state dict of the param (DTensor values)
    local: dict  # the same keys, each DTensor value replaced by its local tensor


@dataclass
class LocalView:
    """An optimizer's sharded params and states seen as local tensors, which
    ``fczero.runtime.local_step`` builds once and keeps while what it was built from is
    the same objects (checked every step, by identity: [Note: checking the view in
    bulk]), so a step swaps a few references instead of rebuilding a dict per param."""

    params: tuple[torch.Tensor, ...]  # the optimizer's params, flat (the step hooks' tuple)
    state: dict  # the ``optimizer.state`` it was built from
    keys: tuple  # its keys then, in order
    dicts: tuple[dict, ...]  # its per-param state dicts then, in the same order
    values: tuple  # every value of those dicts, flat, as the last step left them
    groups: list[list[torch.Tensor]]  # each group's own params list
    sizes: list[int]  # their lengths then
    local_groups: list[list[torch.Tensor]]  # the same lists of local tensors
    locals_: tuple[torch.Tensor, ...]  # each param's local tensor, flat
    entries: list[LocalStates | None]  # each param's states (None: it had none)
    local_dicts: tuple[dict, ...]  # the entries' ``local`` dicts
    local_values: tuple  # every value of those, flat, as the last step left them
    local_state: dict  # what ``optimizer.state`` is during the step: local -> local states
    with_states: int  # how many entries are not None (``local_state``'s length when built)


class StateOffload:
    """An optimizer-state offload, as its optimizer's record lists it: the optimizer whose
    states it keeps in host memory. A record: ``fczero.offload.optimizer.OptimizerOffload``
    extends it with the hooks that do it (the local step leaves such an optimizer alone)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


def _reused_out_of_pool(state: weakref.ref) -> None:
    """A kept param's gather, reused by the later micro-batches, copied out of the CUDA
    graphs' pool ([Note: a grad kept across CUDA-graph runs]). The hook that calls this
    holds the state weakly, as ``_grad_arrived``'s does."""
    target = state()
    if target is not None and target.reused is not None:
        target.reused = target.reused.clone()


def _grad_arrived(state: weakref.ref, leaf: torch.Tensor) -> None:
    """The leaf's hook: hand its grad to the sharded param ([Note: what a compiled graph
    differentiates]), if the param's state still exists. One frame per param and
    backward, so the body is inline: this hook runs for every param on every step."""
    target = state()
    if target is None:
        return
    grad, leaf.grad = leaf.grad, None
    if grad is None:  # (a backward that reduced nothing: the grad went to ``acc``)
        return
    param = target.param
    held = param.grad
    if held is None:
        param.grad = sharded_grad(grad, param._spec)
    else:  # accumulated over steps without zero_grad, as AccumulateGrad would; an eager
        # bucket's reduce may still be in flight ([Note: a reduce-scatter left in flight])
        settle_in_flight()
        held._local_tensor.add_(grad)


#: Sharded param -> weak reference to its state (for the optimizer hooks). Both weak: the
#: model alone keeps its states (and so its params) alive.
_STATES = WeakIds()


def remember(state: ParamState) -> None:
    _STATES[state.param] = weakref.ref(state)


def any_sharded(params: tuple[torch.Tensor, ...]) -> bool:
    """Whether some of ``params`` may be fczero's sharded params (one pass over their ids)."""
    return _STATES.any_of(params)


def state_of(param: torch.Tensor) -> ParamState | None:
    """The state of sharded ``param`` (None: not a param fczero sharded, or its model is gone)."""
    ref = _STATES.get(param)
    return ref() if ref is not None else None


def options_of(param: torch.Tensor) -> Options | None:
    """The ``parallelize`` options of the model that owns sharded ``param`` (else None)."""
    state = state_of(param)
    return state.root.options if state is not None else None


def compute_device_of(param: torch.Tensor) -> torch.device | None:
    """The device a param-offloaded sharded ``param`` is gathered to (None: its shard is
    where its compute is, or it is not fczero's)."""
    state = state_of(param)
    return state.spec.compute_device if state is not None else None
