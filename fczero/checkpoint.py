"""Checkpoints of a parallelized model (and its optimizer) with torch.distributed.checkpoint.

``save(path, model, optimizer, step=..., extra=...)`` writes a DCP checkpoint: every
rank writes its own shards, so nothing is gathered and the files do not depend on
the world size. ``load(path, model, optimizer)`` reads it back into the sharded
params and optimizer state in place, at any world size (DCP reshards). The
checkpoint is checked against the model before anything is loaded: missing or
unexpected keys and shape mismatches are one error that names them.

A save never damages the checkpoint already at ``path``: the ranks write into
``<path>.partial``, and only after every rank's files and the metadata are on disk
does rank 0 rename it into place (the old one is moved to ``<path>.old`` for the
moment between the two renames, and ``load`` falls back to it if a crash left only
that). ``full_state_dict(model)`` gathers plain, unsharded tensors for export into
a single-process model.

Every function here is a collective: call it on every rank, in the same order. The
filesystem under ``path`` must be one that every rank sees (as DCP requires).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from fczero.comm import collectives
from fczero.core.state import root_state
from fczero.offload import params as param_offload
from fczero.runtime import param_states

logger = logging.getLogger("fczero")

__all__ = ["CheckpointInfo", "full_state_dict", "load", "save"]

FORMAT_VERSION = 1
_PARTIAL = ".partial"
_OLD = ".old"
_MODEL, _OPTIM, _META = "model", "optim", "fczero"


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """What ``load`` read besides the tensors (the same on every rank)."""

    step: int
    """The ``step`` passed to ``save``."""
    world_size: int
    """How many ranks wrote the checkpoint (it loads at any world size)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The ``extra`` passed to ``save``."""
    path: str = ""
    """The directory that was read (``<path>.old`` after a crash mid-rename)."""


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int = 0,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``model`` (and ``optimizer``) to the directory ``path``, replacing what is there.

    Args:
        path: a directory (created; an earlier checkpoint there is replaced only once
            the new one is complete).
        model: a model returned by ``fczero.parallelize`` (plain models work too).
        optimizer: an optimizer over ``model.parameters()``, or ``None``.
        step: the training step, returned by ``load`` as ``CheckpointInfo.step``.
        extra: a JSON-serializable dict that is the same on every rank (e.g. a
            scheduler's ``state_dict()``), returned by ``load``.

    Raises:
        TypeError / ValueError: for a bad argument, before anything is written.
    """
    path = _check_path(path)
    _check_model_and_optimizer(model, optimizer)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"fczero.checkpoint.save: step must be an int >= 0, got {step!r}.")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(
            f"fczero.checkpoint.save: extra must be a dict (JSON-serializable, the same on "
            f"every rank), got {type(extra).__name__}."
        )
    try:
        extra_json = json.dumps(extra or {})
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"fczero.checkpoint.save: extra must be JSON-serializable ({e}); convert tensors "
            "with .tolist() and keep to numbers, strings, lists and dicts."
        ) from None
    partial, old = path + _PARTIAL, path + _OLD
    rank0 = _rank() == 0
    if rank0:  # a crashed earlier save may have left its partial directory
        shutil.rmtree(partial, ignore_errors=True)
    collectives.barrier()

    state = _state(model, optimizer)
    state[_META] = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": _world_size(),
        "extra": extra_json,  # one string: a dict's keys would have to be known to load it
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
    }
    # dcp.save returns on every rank only once rank 0 has written the metadata (last).
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=partial, no_dist=_single())

    error = _put_in_place(partial, path, old) if rank0 else None
    # every rank returns, or raises, once the checkpoint is in place
    error = collectives.broadcast_object(error)
    if error is not None:
        raise OSError(
            f"fczero.checkpoint.save: the checkpoint was written to {partial!r} but could not "
            f"be moved to {path!r} ({error}); the previous checkpoint, if any, is untouched "
            f"or at {old!r}. Check the directory's permissions and free space."
        )
    logger.info("saved checkpoint of step %d to %s", step, path)


def _put_in_place(partial: str, path: str, old: str) -> str | None:
    """Rank 0: ``partial`` becomes ``path`` (see the module docstring); the error, if any."""
    try:
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> CheckpointInfo:
    """Read the checkpoint at ``path`` into ``model`` (and ``optimizer``), in place.

    The world size may differ from the one that saved it. The optimizer must be of
    the type that was saved, over the same params, and have taken no step yet or
    be about to be overwritten (its state is replaced).

    Raises:
        FileNotFoundError: nothing loadable at ``path``.
        ValueError: the checkpoint does not match the model (the message names the
            missing, unexpected and mis-shaped keys) or the optimizer; raised before
            anything is loaded.
    """
    path = _check_path(path)
    _check_model_and_optimizer(model, optimizer)
    path = _existing_checkpoint(path)
    metadata = dcp.FileSystemReader(path).read_metadata()
    _check_model_keys(path, metadata, model)
    record = {_META: {"format": 0, "step": 0, "world_size": 0, "extra": "{}", "optimizer": None}}
    with _quiet_single_process():
        dcp.load(record, checkpoint_id=path, no_dist=_single())
    meta = record[_META]
    if optimizer is not None:
        _check_optimizer(path, metadata, optimizer, meta["optimizer"])

    fresh = optimizer is not None and not optimizer.state
    if optimizer is not None:
        _init_optimizer_state(optimizer)
    state = _state(model, optimizer)
    if optimizer is not None:
        try:
            _check_optimizer_keys(path, metadata, state[_OPTIM])
        except ValueError:
            if fresh:  # leave the optimizer as it came: without state
                optimizer.state.clear()
            raise
    with _quiet_single_process():  # in place, into the params and the optimizer state
        dcp.load(state, checkpoint_id=path, no_dist=_single())
    if optimizer is not None:
        _apply_optimizer_state(model, optimizer, state[_OPTIM])
    root = root_state(model)
    if root is not None:  # stages 1 and 2: the whole copies follow the loaded shards
        param_states.refresh(root.params)
    logger.info("loaded checkpoint of step %d from %s", meta["step"], path)
    return CheckpointInfo(
        step=meta["step"], world_size=meta["world_size"], extra=json.loads(meta["extra"]), path=path
    )


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with every sharded param gathered whole, as plain CPU tensors.

    The keys are those of ``model.state_dict()``, so the result loads into a plain,
    never-parallelized instance of the same model (``load_state_dict(strict=True)``)
    or goes to ``torch.save``. A collective: every rank must call it. With
    ``rank0_only`` (the default) ranks other than 0 get ``{}`` (they still take part
    in the gathers).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fczero.checkpoint.full_state_dict needs an nn.Module, got {type(model).__name__}."
        )
    keep = not rank0_only or _rank() == 0
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():  # the same order on every rank
        if isinstance(value, DTensor):
            value = param_offload.full_tensor(value)  # (a host shard: gathered on the device)
        if keep:
            out[name] = value.detach().cpu().clone()
    return out


# -- state dicts ---------------------------------------------------------------------------
#
# [Note: state dicts by name]
# The model's part is ``model.state_dict()``: it reads ``module._parameters``, so its
# values are the sharded params themselves (DTensors, detached views of the same
# storage) and DCP loads into them in place. The optimizer's part keys each param's
# state by the param's name rather than its index, so it survives any change of world
# size: {"state": {name: {"exp_avg": DTensor, "step": tensor, ...}},
# "param_groups": [{hyperparameters..., "params": [names]}]}. These are built here, not
# with torch.distributed.checkpoint.state_dict.get_state_dict: that helper resolves
# names with ``getattr`` down to the param itself, which on a parallelized module is
# the property that all-gathers the whole param.


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The dict DCP saves and loads (see [Note: state dicts by name])."""
    state: dict[str, Any] = {_MODEL: model.state_dict()}
    if optimizer is not None:
        state[_OPTIM] = _optimizer_state(model, optimizer)
    return state


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}  # a tied param: its first name


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    names = _param_names(model)
    per_param = {
        names[id(p)]: dict(optimizer.state[p])
        for group in optimizer.param_groups
        for p in group["params"]
        if p in optimizer.state
    }
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [names[id(p)] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    return {"state": per_param, "param_groups": groups}


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable param its optimizer state (the tensors DCP loads into).

    One ``step`` with zero grads and a learning rate of 0 creates it without moving
    any param; the state's values are overwritten by the load right after.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad


def _apply_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, loaded: dict[str, Any]
) -> None:
    """Write what DCP loaded back into the optimizer (tensors were loaded in place)."""
    by_name = {name: p for name, p in model.named_parameters()}
    for name, values in loaded["state"].items():
        optimizer.state[by_name[name]].update(values)
    for group, saved in zip(optimizer.param_groups, loaded["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Every key of the model's state dict and its global (unsharded) shape."""
    return {name: value.shape for name, value in model.state_dict().items()}


# -- checks ------------------------------------------------------------------------------


def _check_path(path: object) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"fczero.checkpoint: path must be a directory path (str or os.PathLike), "
            f"got {type(path).__name__}."
        )
    path = os.fspath(path).rstrip(os.sep) or os.sep
    if path.endswith((_PARTIAL, _OLD)):
        raise ValueError(
            f"fczero.checkpoint: {path!r} ends with {_PARTIAL!r} or {_OLD!r}, names fczero "
            "uses for checkpoints being written; pick another directory name."
        )
    return path


def _check_model_and_optimizer(model: object, optimizer: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fczero.checkpoint needs an nn.Module, got {type(model).__name__}.")
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"fczero.checkpoint: optimizer must be a torch.optim.Optimizer or None, "
            f"got {type(optimizer).__name__}."
        )
    own = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in own for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise ValueError(
            f"fczero.checkpoint: the optimizer holds {foreign} tensor(s) that are not params "
            "of the model; build the optimizer from model.parameters() after "
            "fczero.parallelize (it must hold the sharded params)."
        )


def _existing_checkpoint(path: str) -> str:
    """``path``, or ``path.old`` when a crash between the two renames of ``save`` left only it."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    old = path + _OLD
    if os.path.exists(os.path.join(old, ".metadata")):
        logger.warning("no checkpoint at %s; loading the previous one, left at %s", path, old)
        return old
    hint = (
        f" (an unfinished save left {path + _PARTIAL}; it is not loadable)"
        if os.path.exists(path + _PARTIAL)
        else ""
    )
    raise FileNotFoundError(
        f"fczero.checkpoint: no checkpoint at {path!r}{hint}; pass the directory that "
        "fczero.checkpoint.save wrote."
    )


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _check_model_keys(path: str, metadata: Metadata, model: nn.Module) -> None:
    """Raise one error naming every missing, unexpected and mis-shaped key of the model."""
    prefix = _MODEL + "."
    saved = {
        key[len(prefix) :]: md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
    }
    if not saved:
        raise ValueError(
            f"fczero.checkpoint: {path!r} holds no model state; was it written by "
            "fczero.checkpoint.save?"
        )
    expected = _shapes(model)
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = sorted(
        f"{k} (checkpoint {tuple(saved[k].size)}, model {tuple(expected[k])})"
        for k in set(expected) & set(saved)
        if isinstance(saved[k], TensorStorageMetadata) and saved[k].size != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {_names(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {_names(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatch: {_names(mismatched)}")
    if problems:
        raise ValueError(
            f"fczero.checkpoint: {path!r} was saved from a different model; "
            + "; ".join(problems)
            + ". Build the model with the configuration that was saved, or load another "
            "checkpoint."
        )


def _check_optimizer(
    path: str,
    metadata: Metadata,
    optimizer: torch.optim.Optimizer,
    saved_type: str | None,
) -> None:
    """Before the optimizer is touched: the checkpoint has state of this optimizer's type."""
    if saved_type is None or not any(
        k.startswith(_OPTIM + ".") for k in metadata.state_dict_metadata
    ):
        raise ValueError(
            f"fczero.checkpoint: {path!r} was saved without an optimizer; "
            "call load(path, model) without one, or load a checkpoint saved with it."
        )
    if saved_type != type(optimizer).__name__:
        raise ValueError(
            f"fczero.checkpoint: {path!r} holds {saved_type} state, but the optimizer is "
            f"{type(optimizer).__name__}; build the optimizer as when saving (or load without it)."
        )


def _check_optimizer_keys(path: str, metadata: Metadata, optim_sd: dict[str, Any]) -> None:
    """Every tensor of the (initialized) optimizer's state is in the checkpoint, same shape."""
    saved = metadata.state_dict_metadata
    missing = []
    for name, per_param in optim_sd["state"].items():
        for key, value in per_param.items():
            full = f"{_OPTIM}.state.{name}.{key}"
            if isinstance(value, torch.Tensor) and (
                full not in saved
                or not isinstance(saved[full], TensorStorageMetadata)
                or saved[full].size != value.shape
            ):
                missing.append(full)
    if missing:
        raise ValueError(
            f"fczero.checkpoint: optimizer state missing from {path!r} or of another shape: "
            f"{_names(sorted(missing))}. Build the optimizer as it was built when saving "
            "(same params, same options such as momentum)."
        )


# -- process group ---------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _single() -> bool:
    """No process group: DCP reads and writes as one process."""
    return not dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Without a process group DCP warns, on every call, that it assumes one process; that
    is the intent here, so the warning is dropped (others pass)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield
