"""``fczero.parallelize``: validate, shard, wire. Nothing else happens here."""

from __future__ import annotations

import dataclasses
import logging
import sys
import warnings
from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from fczero.comm import consistency
from fczero.comm.meshes import (
    MeshLayout,
    group_over_the_same_ranks,
    resolve_mesh,
    root_group_name,
)
from fczero.core import config, cuda_graphs, memory, offload_sizing, unsharding
from fczero.core import meta_init as meta_device_init
from fczero.core.config import Options
from fczero.core.policies import CheckPolicy, CommPolicy, MixedPrecisionPolicy, OffloadPolicy
from fczero.core.spec import ShardSpec, mesh_device, quiet_gather_checkpoint_note, shard_tensor
from fczero.core.state import KeptPlan, RootState, is_parallelized, root_state
from fczero.offload import params as param_offload
from fczero.offload import partition as offload_partition
from fczero.passes import registry
from fczero.passes.install import cache_fczero_graphs, install
from fczero.runtime import guards, param_states, step_hooks
from fczero.runtime import prefetch as eager_prefetch
from fczero.runtime import units as gather_units
from fczero.runtime.units import UnitSpec
from fczero.runtime.wiring import wire_module

logger = logging.getLogger("fczero")

__all__ = ["parallelize", "is_parallelized"]

#: parallelize's keyword options, as its signature declares them (for error messages).
OPTION_NAMES = [
    "stage", "reshard_after_forward", "mp_policy", "comm_policy", "offload_policy",
    "memory_budget", "axis", "replicate_axis", "check_policy", "init_fn", "meta_init", "units",
]  # fmt: skip


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    stage: int = 3,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    comm_policy: CommPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    memory_budget: int | None = None,
    axis: str | int | None = None,
    replicate_axis: str | int | None = None,
    check_policy: CheckPolicy | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    meta_init: str = "module",
    units: UnitSpec = "auto",
    **deprecated: object,
) -> nn.Module:
    """Shard every parameter of ``model`` over ``mesh`` (ZeRO stage 3 by default), in place.

    After the call each parameter is an ``nn.Parameter`` DTensor with ``Shard(0)`` on
    the data-parallel axis (0-d params: ``Replicate()``), living on the mesh's device;
    buffers are moved to that device and otherwise left alone. Every module computes
    with the unsharded param, gathered through functional collectives on each access;
    gradients come back averaged over ranks as sharded grads (``Shard(0)`` DTensors),
    so any ``torch.optim`` optimizer built *after* this call holds sharded state.

    The model runs eagerly or under plain ``torch.compile`` (stock Inductor): the
    compiled graphs show the all-gathers, waits and reduce-scatters as nodes.

    Args:
        model: the module to shard; every rank must pass the same architecture with
            the same initial values (as with DDP and FSDP2).
        mesh: a ``DeviceMesh``; with more than one axis, name the data-parallel one
            with ``axis`` (and, for HSDP, the replicate one with ``replicate_axis``).
            Params that are already tensor-parallel DTensors must live on other axes
            of this same mesh (``fczero.comm.meshes``).
        stage: ZeRO stage. 3: params, grads and optimizer state sharded; each param is
            gathered when a module reads it. 2: each rank keeps a whole copy of every
            param (refreshed by one bucketed all-gather after ``optimizer.step()``);
            grads are reduce-scattered. 1: whole params as in stage 2; grads are
            all-reduced in buckets and each rank keeps its rows. Optimizer state is
            sharded in every stage.
        reshard_after_forward: stage 3 only. True: each unsharded param is freed after
            forward and gathered again in backward, but for the last blocks that
            ``comm_policy.keep_unsharded`` keeps (by default one shard's worth: the
            model's unsharded bytes over the world size). False: every param stays
            gathered from forward to backward.
        mp_policy: the dtypes to compute and reduce in (``fczero.MixedPrecisionPolicy``;
            FSDP2's ``MixedPrecisionPolicy`` is accepted too). None: the params' own.
        comm_policy: bucketing and prefetch of the collectives, params kept gathered
            for backward, the compiled passes (``fczero.CommPolicy``).
        offload_policy: params and activations in host memory (``fczero.OffloadPolicy``;
            FSDP2's ``CPUOffloadPolicy()`` means ``OffloadPolicy(params=True)``).
        memory_budget: device bytes every fczero planner plans within: the compiled
            prefetch and activation offload (a graph's planned peak),
            ``keep_unsharded="auto"`` and ``offload_optimizer_states(device_bytes="auto")``
            (the measured step peak). None: 90% of the accelerator's memory, unlimited
            on CPU.
        axis: the data-parallel mesh axis (name or index); needed only when the mesh has
            more than one axis.
        replicate_axis: HSDP: the mesh axis over which the sharded params are
            replicated; grads are reduce-scattered over ``axis``, then all-reduced over
            this one. None: plain ZeRO over ``axis``.
        check_policy: ``fczero.CheckPolicy()`` checks that every rank issues the same
            collectives (raising ``fczero.CollectiveMismatchError`` instead of hanging).
        init_fn: for a model built on the meta device only: ``init_fn(module)``
            initializes that module's own params and buffers in place. It runs on one
            module at a time, whole on the mesh's device, children before parents (as
            ``model.apply`` would), then the module's params are sharded. ``None``: each
            such module's ``reset_parameters()``. See ``fczero/core/meta_init.py``.
        meta_init: how a meta-device model is initialized: ``"module"`` (the default; one
            module whole at a time, exactly the values of a whole-model init) or
            ``"shard"`` (each rank allocates and initializes only its shards, so no whole
            param ever exists; random values then differ from a whole init as
            ``fczero/core/meta_init.py`` says).
        units: which modules gather their params as a whole when their forward begins
            ([Note: units] in ``fczero/runtime/units.py``). ``"auto"`` (the default): each
            block (a child of the outermost ``nn.ModuleList``/``nn.Sequential``), and
            outside the blocks each module that owns params itself. A list of modules or
            module classes: those, and outside them each module that owns params itself.
            ``None``: each read gathers on its own, which is rank-safe only when every
            rank reads the same params in the same order (no data-dependent branches,
            such as experts skipped when they get no tokens).
        **deprecated: the options of earlier versions (``param_dtype``, ``bucket_bytes``,
            ``offload_params``, ...) still work and warn with their new spelling
            (docs/api.md lists them).

    Returns:
        ``model`` itself, parallelized.

    Raises:
        TypeError / ValueError: for a bad option, mesh or model, before any param is
            touched and before any collective runs.
        fczero.CollectiveMismatchError: with ``check_policy``, when the ranks pass
            different models or options (also before any param is touched).
    """
    options = config.resolve(
        axis=axis,
        replicate_axis=replicate_axis,
        stage=stage,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        comm_policy=comm_policy,
        offload_policy=offload_policy,
        memory_budget=memory_budget,
        check_policy=check_policy,
        others=deprecated,
        known=OPTION_NAMES,
    )
    layout = resolve_mesh(mesh, options.axis, options.replicate_axis)
    dp_mesh = layout.shard_mesh
    owners = _validate_model(model, layout)
    unit_paths = gather_units.unit_paths(model, units)  # (checks ``units`` before any change)
    plain_stage3 = _plain_stage3(options, layout, owners)
    reduce_group = _separate_reduce_group(options, dp_mesh, plain_stage3)
    params = list(model.named_parameters())  # each param once, under its first name
    names = {id(p): n for n, p in params}
    guards.check_before(model, [(names[id(p)], p) for *_, p in owners], dp_mesh)
    group_name = dp_mesh.get_group().group_name
    if options.check is not None:  # the one exchange before sharding: ranks must agree
        consistency.check_model(
            group_name, dp_mesh.size(), options, params, options.check.timeout_s
        )
    # [Note: the same weights on every rank]: one small all-gather before anything changes
    consistency.check_same_values(group_name, params, mesh_device(dp_mesh))

    meta_plan = meta_device_init.plan(model, init_fn, meta_init)
    if meta_plan is not None and not plain_stage3:
        raise ValueError(
            "fczero: a model on the meta device can be initialized by parallelize only with "
            "stage=3 on a mesh without replicate or tensor-parallel axes; for the others, "
            "materialize it first (model.to_empty(device=...) and initialize it)."
        )

    if options.offload.params:  # refused before any param is sharded if the host lacks room
        offload_sizing.check_param_offload(params, dp_mesh, mesh_device(dp_mesh))
    specs_by_param: dict[int, tuple[nn.Parameter, ShardSpec]] = {}
    if meta_plan is not None:
        specs_by_param = meta_device_init.init_and_shard(meta_plan, dp_mesh, options)
    originals = _shard_params(owners, specs_by_param, layout, options)
    # the name this root's collectives carry: [Note: a root's group name]
    root_name = root_group_name(dp_mesh.get_group(), model)
    if root_name != group_name or reduce_group is not None:
        for key, (sharded, spec) in specs_by_param.items():
            specs_by_param[key] = sharded, dataclasses.replace(
                spec, group_name=root_name, reduce_group=reduce_group
            )
    selective = options.selective_unsharding
    last_reader = unsharding.by_last_owner(owners, specs_by_param)
    kept = None
    if selective and not options.auto_unsharding:
        kept = _plan_kept(last_reader, specs_by_param, options, dp_mesh.size())
    _offload_params(specs_by_param, dp_mesh, options)
    wiring: dict[nn.Module, list[str]] = {}
    for _, module, name, param in owners:
        module._parameters[name] = specs_by_param[id(param)][0]
        wiring.setdefault(module, []).append(name)
    for module, names in wiring.items():
        wire_module(module, names, in_units=bool(unit_paths))  # (the root's unit takes the rest)
    root = param_states.attach(
        model,
        [(originals[key], *specs_by_param[key]) for key in specs_by_param],
        wiring,
        options,
        dp_mesh,
    )
    step_hooks.install()  # once per process: torch's optimizer step hooks are global
    root.kept = kept
    if selective and options.auto_unsharding:
        states = {id(state.param): state for state in root.params}
        groups = [dp_mesh.get_group()]
        if layout.replicate_mesh is not None:
            groups.append(layout.replicate_mesh.get_group())
        root.auto_unsharding = unsharding.AutoUnsharding(
            model,
            [(path, states[id(specs_by_param[id(p)][0])]) for path, p, _ in last_reader],
            options.memory_budget,
            mesh_device(dp_mesh),
            groups,
        )
    _move_buffers(model, dp_mesh)
    quiet_gather_checkpoint_note()
    cache_fczero_graphs()
    if options.comm.compile_passes:
        root.passes = _pass_settings(
            root_name, dp_mesh, options, layout.replicate_mesh, reduce_group
        )
        install()
        offload_partition.install(required=options.offload.activations != "off")
    for name in (root_name, reduce_group) if reduce_group else (root_name,):
        registry.register(name, root)  # ([Note: from a graph to its root])

    guards.protect(model, params)  # ``params`` holds the replaced (old) params
    _eager_runtime(root, params, specs_by_param, group_name)
    model.register_forward_pre_hook(_root_pre_forward, with_kwargs=True)
    model.register_forward_hook(_root_post_forward, always_call=True)
    if unit_paths:  # after the root's hooks: its unit gathers inside the forward's context
        states = {id(state.param): state for state in root.params}
        built = gather_units.build_units(model, unit_paths, states)
        gather_units.install(model, built, mesh_device(dp_mesh))
    if mesh_device(dp_mesh).type == "cuda" and mesh.size() > 1:
        cuda_graphs.release_with(model)  # [Note: tearing down after CUDA graphs]
    logger.info(
        "parallelized %s: %d params over %d ranks%s (%s)",
        type(model).__name__,
        len(specs_by_param),
        dp_mesh.size(),
        f" x {mesh.size() // dp_mesh.size()} replicas" if layout.replicate_axis else "",
        options,
    )
    return model


def _shard_params(
    owners: list,
    specs_by_param: dict[int, tuple[nn.Parameter, ShardSpec]],
    layout: MeshLayout,
    options: Options,
) -> dict[int, nn.Parameter]:
    """Shard each param once (a param several modules share too) into ``specs_by_param``
    (the meta-device path has filled it already); returns the original params by id."""
    originals: dict[int, nn.Parameter] = {}
    for _, _, _, param in owners:
        if id(param) in originals:
            continue
        if id(param) not in specs_by_param:
            specs_by_param[id(param)] = shard_tensor(
                param, layout.shard_mesh, options, param.requires_grad, layout.for_param(param)
            )
        originals[id(param)] = param
    return originals


def _plan_kept(
    last_reader: list[tuple[str, torch.Tensor, ShardSpec]],
    specs_by_param: dict[int, tuple[nn.Parameter, ShardSpec]],
    options: Options,
    world: int,
) -> KeptPlan:
    """Selective unsharding planned at ``parallelize`` ([Note: selective unsharding]):
    the kept params' specs say so in ``specs_by_param``."""
    budget, source = unsharding.budget_of(
        options.comm.keep_unsharded, last_reader, world, _offload_named(options)
    )
    kept = unsharding.plan_kept_params(last_reader, budget, source)
    if kept.budget:
        logger.info("selective unsharding: %s", unsharding.describe(kept))
    for key in kept.ids:
        sharded, spec = specs_by_param[key]
        specs_by_param[key] = sharded, dataclasses.replace(spec, keep_unsharded=True)
    return kept


def _plain_stage3(options: Options, layout: MeshLayout, owners: list) -> bool:
    """Whether this is stage 3 over one mesh axis (no HSDP, no tensor-parallel params),
    which some options need; refuses the combinations fczero does not support, before
    anything changes."""
    one_axis = layout.replicate_axis is None and not any(
        isinstance(p, DTensor) for *_, p in owners
    )
    if options.stage != 3 and not one_axis:
        raise ValueError(
            f"fczero: stage={options.stage} is not supported with HSDP (replicate_axis) or "
            "tensor-parallel params yet; use stage=3 (the default) on such meshes."
        )
    plain_stage3 = options.stage == 3 and one_axis
    if options.offload.params and not plain_stage3:
        raise ValueError(
            "fczero: OffloadPolicy.params needs stage=3 on a mesh without replicate or "
            "tensor-parallel axes; drop the offload_policy, or shard with stage=3 over one axis."
        )
    return plain_stage3


def _eager_runtime(
    root: RootState,
    params: list[tuple[str, nn.Parameter]],
    specs_by_param: dict[int, tuple[nn.Parameter, ShardSpec]],
    group_name: str,
) -> None:
    """The root's eager prefetch and, under ``check_policy``, its collective log.

    Eager prefetch issues gathers from the order recorded on an earlier step, ahead of
    the code that uses them: a rank-dependent branch would pair unrelated collectives
    before the eager check at the end of forward could name it. So checking turns it off."""
    options = root.options
    comm = options.comm
    window = 0 if options.check is not None else comm.bucket_bytes * comm.prefetch
    root.prefetch = eager_prefetch.EagerPrefetch(window, comm.bucket_bytes)
    if options.check is None:
        return
    first_name = {id(p): n for n, p in params}
    name_of = {id(sh): first_name[key] for key, (sh, _) in specs_by_param.items()}
    named = {}  # the names a mismatch is reported with, by sharded param and by leaf
    for state in root.params:
        named[id(state.param)] = named[id(state.leaf)] = name_of.get(id(state.param), "a param")
    root.eager_log = consistency.EagerLog(group_name, options.check.timeout_s, named)


def _offload_named(options: Options) -> str | None:
    """The device-memory offload ``options`` ask for, by its option's name (None: none)."""
    if options.offload.params:
        return "OffloadPolicy.params"
    if options.offload.activations != "off":
        return f"OffloadPolicy.activations={options.offload.activations!r}"
    return None


def _validate_model(
    model: nn.Module, layout: MeshLayout
) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """Every (module path, module, name, param), in registration order, after checking
    that fczero can shard them all."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fczero.parallelize needs an nn.Module, got {type(model).__name__}.")
    if is_parallelized(model):
        raise ValueError(
            "fczero: this model (or a submodule) is already parallelized; call "
            "parallelize once, on the root module, with a freshly built model."
        )
    owners = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is None:
                continue
            qualified = f"{module_name}.{name}" if module_name else name
            layout.check_param(qualified, param)  # a DTensor must be tensor-parallel here
            if not param.dtype.is_floating_point:
                raise TypeError(
                    f"fczero: parameter {qualified!r} has dtype {param.dtype}; only floating "
                    "params can be sharded and trained. Register it as a buffer instead "
                    "(module.register_buffer)."
                )
            owners.append((module_name, module, name, param))
    return owners


def _offload_params(
    specs_by_param: dict[int, tuple[nn.Parameter, ShardSpec]],
    mesh: DeviceMesh,
    options: Options,
) -> None:
    """``OffloadPolicy.params``: every shard to pinned host memory ([Note: parameter offload])."""
    if not options.offload.params:
        return
    device = mesh_device(mesh)
    if device.type == "cpu":  # accepted, and changes nothing: said as a warning, not only logged
        warnings.warn(
            "fczero: OffloadPolicy.params (or FSDP2's CPUOffloadPolicy) on a CPU mesh changes "
            "nothing: the shards are in host memory already. Drop the offload_policy on a CPU "
            "mesh; it moves shards to host memory only for a GPU mesh.",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    for key, (sharded, spec) in specs_by_param.items():
        specs_by_param[key] = param_offload.to_host(sharded, spec, device)
    logger.info(
        "OffloadPolicy.params: %d sharded params in host memory; gathers copy them to %s",
        len(specs_by_param),
        device,
    )


def _move_buffers(model: nn.Module, mesh: DeviceMesh) -> None:
    device = mesh_device(mesh)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def _separate_reduce_group(options: Options, mesh: DeviceMesh, plain_stage3: bool) -> str | None:
    """``CommPolicy(separate_reduce_group=True)``: a new process group over the ranks of
    ``mesh``, made here on every rank alike (``new_group`` is collective), whose name the
    reduce-scatters carry; None otherwise. Checked before anything is sharded."""
    if not options.comm.separate_reduce_group:
        return None
    if not plain_stage3 or options.offload.params:
        raise ValueError(
            "fczero: CommPolicy(separate_reduce_group=True) applies to stage=3 over one mesh "
            "axis, without HSDP, tensor-parallel params or OffloadPolicy(params=True); drop "
            "it for this model, whose grads are reduced otherwise."
        )
    return group_over_the_same_ranks(mesh, "CommPolicy(separate_reduce_group=True)")


def _pass_settings(
    name: str,
    mesh: DeviceMesh,
    options: Options,
    replicate: DeviceMesh | None = None,
    reduce_group: str | None = None,
) -> registry.PassSettings:
    """The settings of the root's compiled passes (``name``: the group name its collectives
    carry; ``reduce_group``: the one its reduce-scatters carry, where it has its own), from
    its options."""
    budget = memory.device_budget(mesh_device(mesh), options.memory_budget)
    return registry.new_settings(
        name,
        reduce_group=reduce_group,
        bucket_bytes=options.comm.bucket_bytes,
        prefetch=options.comm.prefetch,
        memory_budget=budget,
        replicate_group=replicate.get_group().group_name if replicate is not None else None,
        activation_offload=options.offload.activations,
        offload_min_bytes=options.offload.activation_min_bytes,
        param_offload=options.offload.params and mesh_device(mesh).type != "cpu",
        param_itemsize=options.mp.param_dtype.itemsize if options.mp.param_dtype else None,
        check_timeout_s=options.check.timeout_s if options.check is not None else None,
        rank=mesh.get_local_rank(),
        touched_rows=options.comm.sparse_embedding_grads,
    )


def _root_pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Cast floating inputs to ``param_dtype`` (as FSDP2 does); in eager mode, open the
    root's eager context ([Note: the eager context of a forward] in ``fczero.runtime.prefetch``)."""
    root = root_state(module)
    param_dtype = root.options.mp.param_dtype
    if param_dtype is not None:
        args, kwargs = tree_map_only(
            torch.Tensor, partial(_cast_floating, param_dtype), (args, kwargs)
        )
    if not torch.compiler.is_compiling():
        eager_prefetch.enter_forward(root)
    return args, kwargs


def _cast_floating(dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _root_post_forward(module: nn.Module, args: object, output: object) -> None:
    """Undo ``_root_pre_forward``: close the eager context (the forward may have raised:
    this hook always runs, and then skips the end-of-forward collective check)."""
    if torch.compiler.is_compiling():
        return  # nothing was opened
    eager_prefetch.exit_forward(root_state(module), raised=sys.exc_info()[0] is not None)
