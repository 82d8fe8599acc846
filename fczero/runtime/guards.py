"""Guards against misuse around ``parallelize``: checks before it, traps after it.

Before sharding (``check_before``, called once all of ``parallelize``'s own input checks
passed): refuse an empty model, a model on an accelerator with a CPU mesh, and params
that an earlier ``parallelize`` already replaced (a weight shared by two models).

After sharding (``protect``), three traps for the ways a parallelized model is used
wrongly, each unreported without them:

- *the old params*: ``parallelize`` replaces every param with a new sharded one. An
  optimizer built before it still holds the old tensors, which never get a gradient,
  so it would train nothing. A global optimizer step pre-hook refuses to step an
  optimizer that holds a replaced param. A module outside the parallelized model that
  shares a param (a tied weight) also keeps the old tensor; a gradient hook on the old
  tensor raises as soon as backward reaches it.
- *loading a full state dict*: ``load_state_dict`` with plain (unsharded) tensors fails
  deep in DTensor's dispatch; a pre-hook on the root names the param and the way to load.
  The same hook refuses ``assign=True``, which would swap the sharded params for untracked ones.
- *moving or casting the model* (``.to``, ``.cuda``, ``.half``, ``.double``...): every
  module of the model gets a subclass (same class name) whose ``_apply`` refuses a
  conversion that would change a sharded param's device or dtype, before anything is
  converted (modules without params in their subtree are left alone). A conversion that
  leaves every param as it is (``model.to(its device)``) is allowed and applied to the
  buffers only.

Nothing here runs a collective or is on the path of a training step, except the one
optimizer hook, which looks at an optimizer's params again only when they change.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fczero.core.weak_ids import WeakIds

logger = logging.getLogger("fczero")

# [Note: what the guards keep per process]
# The optimizer hook is torch's global one and sees only an optimizer's tensors, and a
# later parallelize sees only its own model's, so the old params are found by identity
# here: old param -> its qualified name, held weakly (the user's references alone keep
# an old param alive; keyed by identity, since tensors compare elementwise). The guarded
# classes are generated once per user class and shared by every model of that class;
# they hold no state of a model, and are held weakly too (a class lives while a module
# of it does).
_REPLACED = WeakIds()
_GUARDED_CLASSES: weakref.WeakValueDictionary[type, type] = weakref.WeakValueDictionary()


# ---- before sharding ------------------------------------------------------------------


def check_before(
    model: nn.Module, owners: list[tuple[str, torch.Tensor]], mesh: DeviceMesh
) -> None:
    """Refuse what ``parallelize`` cannot shard well; ``owners`` are (qualified name, param)."""
    if not owners:
        raise ValueError(
            f"fczero: {type(model).__name__} has no parameters, so there is nothing to shard. "
            "Pass the module that owns the weights (build or load them first)."
        )
    check_devices([(name, p.device) for name, p in owners], mesh.device_type)
    for name, param in owners:
        old_name = replaced_name(param)
        if old_name is not None:
            raise ValueError(
                f"fczero: parameter {name!r} was already replaced by an earlier parallelize "
                f"(as {old_name!r}): it is shared with a model that is parallelized. Put both "
                "models under one root module and parallelize that root once."
            )


def check_devices(params: Iterable[tuple[str, torch.device]], mesh_device_type: str) -> None:
    """Refuse params on an accelerator when the mesh is a CPU mesh (they would move back to CPU)."""
    if mesh_device_type != "cpu":
        return  # CPU params on an accelerator mesh are moved there: the usual way to build
    for name, device in params:
        if device.type not in ("cpu", "meta"):
            raise ValueError(
                f"fczero: parameter {name!r} is on {device} but the mesh is a CPU mesh, so "
                f"parallelize would move it back to the CPU. Build the mesh on the model's "
                f"device: init_device_mesh({device.type!r}, (world_size,)) (with a "
                "process group of that device's backend, e.g. nccl for cuda)."
            )


def any_replaced(params: tuple[torch.Tensor, ...]) -> bool:
    """Whether some of ``params`` may be params ``parallelize`` replaced (one pass over ids)."""
    return _REPLACED.any_of(params)


def replaced_name(param: torch.Tensor) -> str | None:
    """The name under which ``parallelize`` replaced ``param``, or None if it did not."""
    return _REPLACED.get(param)


# ---- after sharding -------------------------------------------------------------------


def protect(model: nn.Module, replaced: list[tuple[str, nn.Parameter]]) -> None:
    """Arm the traps of the module docstring for a freshly parallelized ``model``."""
    for name, old in replaced:
        _REPLACED[old] = name
        if old.requires_grad:
            old.register_hook(_stale_param_hook(name))
    model.register_load_state_dict_pre_hook(_refuse_plain_state)
    for module in model.modules():
        owns_params = next(module.parameters(), None) is not None
        if owns_params and not isinstance(module, _Guarded):
            module.__class__ = _guarded_class(type(module))


def _stale_param_hook(name: str) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        raise RuntimeError(
            f"fczero: backward reached the old tensor of parameter {name!r}, which "
            "parallelize replaced with a sharded param: a module outside the parallelized "
            "model still uses it (a weight shared or tied with a module that was not "
            "parallelized), and it would train apart from the sharded copy. Parallelize "
            "the module that contains every user of the weight."
        )

    return hook


def check_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
    """Refuse to step an optimizer that holds params ``parallelize`` replaced (called by
    fczero's one optimizer pre-step hook, ``step_hooks._before_step``, whenever the optimizer's
    ``params`` differ from those it last looked at)."""
    stale = [name for p in params if (name := replaced_name(p)) is not None]
    if stale:
        shown = ", ".join(repr(n) for n in stale[:3]) + (" ..." if len(stale) > 3 else "")
        raise RuntimeError(
            f"fczero: this {type(optimizer).__name__} holds {len(stale)} parameter(s) that "
            f"parallelize replaced ({shown}); they never get a gradient, so nothing would "
            "train. Build the optimizer after parallelize, from model.parameters()."
        )


def _refuse_plain_state(
    module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: object
) -> None:
    """Before anything is copied: a plain tensor for a sharded param is a full state dict,
    and ``assign=True`` would swap the sharded params for new tensors that fczero's
    records (and compiled graphs, through each param's leaf) do not know."""
    if local_metadata.get("assign_to_params_buffers"):
        raise ValueError(
            "fczero: load_state_dict(..., assign=True) would replace the sharded params of a "
            "parallelized model with the state dict's tensors, which fczero does not track: "
            "training would go on with the old ones. Load in place (assign=False, the "
            "default), or call parallelize after loading with assign=True."
        )
    for name, param in module.named_parameters():
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor):
            if not isinstance(value, DTensor) and _whole_replica(param, value):
                # torch's set_model_state_dict(full_state_dict=True) hands a 0-d value over
                # as a plain tensor: the whole value, which every rank holds as a replica
                local = value.to(device=param.to_local().device, dtype=param.dtype)
                state_dict[prefix + name] = DTensor.from_local(
                    local, param.device_mesh, param.placements, run_check=False
                )
            elif not isinstance(value, DTensor):
                placements = ", ".join(map(repr, param.placements))
                raise ValueError(
                    f"fczero: load_state_dict got a plain tensor for {prefix + name!r}, a "
                    f"sharded param ({list(value.shape)} here; fczero holds it as a DTensor "
                    f"({placements})). Load a full state dict before parallelize, or load it into "
                    "the parallelized model with torch.distributed.checkpoint.state_dict."
                    "set_model_state_dict(model, state, options=StateDictOptions("
                    "full_state_dict=True)). A sharded state dict (model.state_dict() after "
                    "parallelize) loads as is."
                )


def _whole_replica(param: DTensor, value: torch.Tensor) -> bool:
    """``value`` is the whole of a param that every rank holds whole (a 0-d param)."""
    return (
        value.dim() == 0
        and param.dim() == 0
        and all(p.is_replicate() for p in param.placements)
    )


class _Guarded:
    """Marks the guarded subclasses that ``_guarded_class`` makes."""

    __slots__ = ()


def _guarded_class(cls: type) -> type:
    guarded = _GUARDED_CLASSES.get(cls)
    if guarded is None:
        attrs = {"_apply": _guarded_apply, "__module__": cls.__module__}
        guarded = type(cls.__name__, (cls, _Guarded), attrs)
        guarded.__qualname__ = cls.__qualname__
        _GUARDED_CLASSES[cls] = guarded
    return guarded


def _guarded_apply(self: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` for a parallelized model: refuse to move or cast sharded params.

    ``fn`` is tried on an empty tensor like each param's local shard; if any would change
    device or dtype, nothing is converted and the call raises. Otherwise the params stay
    as they are and ``fn`` is applied to the buffers.
    """
    params = self.named_parameters() if recurse else self._parameters.items()
    for name, param in params:
        if param is None:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        probe = fn(torch.empty(0, dtype=local.dtype, device=local.device))
        if probe.dtype != local.dtype or probe.device != local.device:
            raise RuntimeError(
                f"fczero: moving or casting a parallelized model is not supported: this call "
                f"would change parameter {name!r} from {local.device} {local.dtype} to "
                f"{probe.device} {probe.dtype}. Move and cast the model before parallelize "
                "(it places params on the mesh's device); for compute in another precision, "
                "use parallelize(..., mp_policy=fczero.MixedPrecisionPolicy(param_dtype=...))."
            )
    modules = self.modules() if recurse else [self]
    for module in modules:
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = fn(buf)
    return self


__all__ = ["check_before", "check_devices", "protect", "replaced_name"]
