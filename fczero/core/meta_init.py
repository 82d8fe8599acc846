"""Models built on the meta device: initialized module by module, or shard by shard.

[Note: meta-device init]
A model built under ``torch.device("meta")`` has shapes and no storage. ``parallelize``
fills it one module at a time, in the order ``model.apply`` visits modules (children
first, then the parent), counting only modules that directly own meta params or meta
buffers:

    1. allocate the module's own meta params and buffers, whole, on the mesh's device
       (``torch.empty``; a tied param keeps one tensor for all its owners)
    2. run the init on the module: ``init_fn(module)``, or ``module.reset_parameters()``
    3. shard each param whose last owner is now initialized (the whole tensor is freed)

So a rank never holds more than one module's whole params beside its shards, and every
param gets exactly the values that ``model.apply(init_fn)`` (or each module's
``reset_parameters()``, in the same order) gives a materialized model from the same RNG
state on the same device type: the same ops run on the same whole tensors in the same
order. No collective runs, so the RNG state must already be equal on every rank
(``torch.manual_seed`` with one seed everywhere), as for any fczero model.

Why not initialize the shards directly (DTensor random ops)? On a CPU mesh DTensor has
no RNG offset tracker (``torch.distributed.tensor._random.is_rng_supported_mesh`` is
False for CPU), so every rank would draw its shard from the start of its own generator:
with equal seeds all ranks get the same numbers, and none of them match the whole
tensor's. Whole-module init gives exact values on every device type.

[Note: meta-device init, shard by shard]
``meta_init="shard"`` is for modules too large to hold whole even once (a big embedding
or output layer). Each param is allocated at its shard's size only (``empty_shard``:
the whole tensor never exists on any rank), the module's ``_parameters`` hold those
sharded DTensors while its init runs, and the init fills them through DTensor ops:
``nn.init`` functions compute fans from the DTensor's global shape, and a random op
fills the local rows. How the values differ from a whole init:

- On a CPU mesh (no DTensor RNG tracker), the init of the i-th module runs with the CPU
  generator seeded from (one draw of the default generator, i, the rank), so each rank
  draws its rows from a stream of its own: same distribution as a whole init, different
  numbers, and they change with the world size. The default generator advances by that
  one draw, the same on every rank.
- On a GPU mesh, DTensor's own RNG tracker fills the shards
  (``torch.distributed.tensor._random.OffsetBasedRNGTracker``: ranks start from rank
  0's CUDA RNG state and each shard takes its own offset), so values differ from a whole
  init there too. Run on one H100 at one rank (``test_shard_mode_on_a_gpu_mesh``):
  deterministic from the seed, within the init's bounds; not yet with two ranks.
- Deterministic inits (``ones_``, ``zeros_``, ``constant_``) give the exact values.
- A 0-d param is replicated: rank 0's value is broadcast after its module's init.

Inits that mix a DTensor param with a plain tensor (``param.copy_(torch.ones(...))``)
fail under DTensor; the error then names the module and says to use ``nn.init``
functions or ``meta_init="module"``.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fczero.comm import collectives
from fczero.core.config import Options
from fczero.core.spec import ShardSpec, empty_shard, mesh_device, shard_tensor

logger = logging.getLogger("fczero")

InitFn = Callable[[nn.Module], None]

#: ``meta_init`` values: whole modules one at a time (exact values), or shards only.
MODES = ("module", "shard")


@dataclass(frozen=True)
class MetaPlan:
    """The modules to initialize, in ``model.apply`` order, and how."""

    modules: tuple[tuple[str, nn.Module], ...]
    init_fn: InitFn | None
    mode: str = "module"


def _is_meta(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type == "meta"


def _apply_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Each module once, children before their parent (the order of ``model.apply``)."""
    order: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for name, child in module._modules.items():
            if child is not None:
                visit(f"{prefix}.{name}" if prefix else name, child)
        order.append((prefix, module))

    visit("", model)
    return order


def plan(model: nn.Module, init_fn: InitFn | None, mode: str = "module") -> MetaPlan | None:
    """Check a possibly-meta model; ``None`` when nothing is on the meta device.

    Raises (before anything is changed) when the model cannot be initialized.
    """
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(
            f"fczero: meta_init must be 'module' (initialize one module whole at a time: "
            f"exact values) or 'shard' (never a whole param: see fczero/core/meta_init.py), got "
            f"{mode!r}."
        )
    if init_fn is not None and not callable(init_fn):
        raise TypeError(
            "fczero: init_fn must be a function that takes one module and initializes its "
            f"own params and buffers in place, got {init_fn!r} ({type(init_fn).__name__})."
        )
    modules = []
    for name, module in _apply_order(model):
        label = name or type(model).__name__
        params = [p for p in module._parameters.values() if p is not None]
        meta = [p for p in params if _is_meta(p)]
        buffers = [b for b in module._buffers.values() if _is_meta(b)]
        if meta and len(meta) != len(params):
            raise ValueError(
                f"fczero: module {label!r} has params both on the meta device and on a real "
                "device; build each module wholly on one device (all of the model under "
                "torch.device('meta'), or none of it)."
            )
        if meta or buffers:
            modules.append((label, module))
    if not modules:
        if mode != "module":
            raise ValueError(
                f"fczero: meta_init={mode!r} is given but no param or buffer is on the meta "
                "device. Build the model under torch.device('meta'), or drop meta_init."
            )
        if init_fn is not None:
            raise ValueError(
                "fczero: init_fn is given but no param or buffer is on the meta device, so "
                "there is nothing for it to initialize. Build the model under "
                "torch.device('meta'), or initialize it yourself and drop init_fn."
            )
        return None
    if init_fn is None:
        missing = [
            label for label, m in modules if not callable(getattr(m, "reset_parameters", None))
        ]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(
                f"fczero: the model is on the meta device and module(s) {shown} own meta "
                "params or buffers but have no reset_parameters(). Pass "
                "parallelize(..., init_fn=fn), where fn(module) initializes that module's own "
                "params and buffers in place, or build those modules on a real device."
            )
    return MetaPlan(tuple(modules), init_fn, mode)


def init_and_shard(
    meta_plan: MetaPlan, mesh: DeviceMesh, options: Options
) -> dict[int, tuple[nn.Parameter, ShardSpec]]:
    """Initialize the planned modules one at a time; return ``{id(meta param): (sharded, spec)}``.

    Afterwards the planned modules' buffers are real tensors on the mesh's device, while
    their ``_parameters`` still hold the meta params (``parallelize`` swaps in the shards).
    """
    if meta_plan.mode == "shard":
        return _init_shards(meta_plan, mesh, options)
    device = mesh_device(mesh)
    owners_left: dict[int, int] = {}
    for _, module in meta_plan.modules:
        for p in module._parameters.values():
            if _is_meta(p):
                owners_left[id(p)] = owners_left.get(id(p), 0) + 1
    whole: dict[int, nn.Parameter] = {}  # meta param id -> whole param, while owners remain
    sharded: dict[int, tuple[nn.Parameter, ShardSpec]] = {}
    for label, module in meta_plan.modules:
        metas = {n: p for n, p in module._parameters.items() if _is_meta(p)}
        for name, meta in metas.items():
            if id(meta) not in whole:
                empty = torch.empty(meta.shape, dtype=meta.dtype, device=device)
                whole[id(meta)] = nn.Parameter(empty, requires_grad=meta.requires_grad)
            module._parameters[name] = whole[id(meta)]
        _allocate_buffers(module, device)
        try:
            with torch.no_grad():
                _run_init(meta_plan, label, module)
            _check_in_place(label, module, {n: whole[id(m)] for n, m in metas.items()})
        finally:
            for name, meta in metas.items():  # parallelize swaps in the shards by meta param
                module._parameters[name] = meta
        for meta in metas.values():
            owners_left[id(meta)] -= 1
            if owners_left[id(meta)] == 0:
                sharded[id(meta)] = shard_tensor(
                    whole.pop(id(meta)), mesh, options, meta.requires_grad
                )
    logger.info("initialized %d meta modules, one whole module at a time", len(meta_plan.modules))
    return sharded


def _init_shards(
    meta_plan: MetaPlan, mesh: DeviceMesh, options: Options
) -> dict[int, tuple[nn.Parameter, ShardSpec]]:
    """``meta_init="shard"``: allocate and initialize shards only ([Note: meta-device
    init, shard by shard])."""
    device = mesh_device(mesh)
    rank = mesh.get_local_rank()
    base = int(torch.randint(0, 2**62, ()).item())  # one draw: equal seeds give equal bases
    sharded: dict[int, tuple[nn.Parameter, ShardSpec]] = {}
    for index, (label, module) in enumerate(meta_plan.modules):
        metas = {n: p for n, p in module._parameters.items() if _is_meta(p)}
        for meta in metas.values():
            if id(meta) not in sharded:
                sharded[id(meta)] = empty_shard(
                    meta.shape, meta.dtype, mesh, options, meta.requires_grad
                )
        own = {n: sharded[id(m)][0] for n, m in metas.items()}
        module._parameters.update(own)
        _allocate_buffers(module, device)
        try:
            with torch.no_grad(), _rank_stream(device, (base + index * 1_000_003) * 8_191 + rank):
                try:
                    _run_init(meta_plan, label, module)
                except (RuntimeError, TypeError, NotImplementedError) as e:
                    raise RuntimeError(
                        f"fczero: initializing module {label!r} with meta_init='shard' failed "
                        f"({e}). Its params are sharded DTensors while the init runs: use "
                        "nn.init functions or DTensor ops on them, or meta_init='module' "
                        "(one whole module at a time)."
                    ) from e
            _check_in_place(label, module, own)
        finally:
            module._parameters.update(metas)  # parallelize swaps in the shards by meta param
        for param in own.values():
            if param.dim() == 0:  # replicated: every rank takes rank 0's value
                collectives.broadcast_from_first(param.to_local(), mesh.get_group())
    logger.info(
        "initialized %d meta modules shard by shard (no whole param allocated)",
        len(meta_plan.modules),
    )
    return sharded


@contextlib.contextmanager
def _rank_stream(device: torch.device, seed: int) -> Iterator[None]:
    """On a CPU mesh, random ops draw from a CPU generator seeded for this rank and module;
    the default generator's state is restored afterwards. A GPU mesh's shards are filled
    by DTensor's RNG tracker instead, so nothing changes there."""
    if device.type != "cpu":
        yield
        return
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # DTensor warns that its random ops lack CPU support: the per-rank stream is the answer
        warnings.filterwarnings("ignore", message="DTensor random operators may not have")
        torch.default_generator.manual_seed(seed % 2**63)
        yield


def _allocate_buffers(module: nn.Module, device: torch.device) -> None:
    """The module's own meta buffers, whole (buffers are not sharded), uninitialized."""
    for name, buf in module._buffers.items():
        if _is_meta(buf):
            module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)


def _run_init(meta_plan: MetaPlan, label: str, module: nn.Module) -> None:
    if meta_plan.init_fn is not None:
        meta_plan.init_fn(module)
    else:
        module.reset_parameters()  # type: ignore[operator]


def _check_in_place(label: str, module: nn.Module, expected: dict[str, nn.Parameter]) -> None:
    for name, param in expected.items():
        if module._parameters[name] is not param:
            raise ValueError(
                f"fczero: initializing module {label!r} replaced its param {name!r}; "
                "the init must fill params in place (nn.init.*_ functions, "
                "param.copy_(...)), not assign new ones."
            )
