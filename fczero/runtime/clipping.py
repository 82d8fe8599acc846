"""Gradient clipping by the global norm of sharded grads (``fczero.clip_grad_norm_``).

After ``backward()`` each grad of a parallelized model is a DTensor: ``Shard(0)`` (every
rank holds different rows, some ranks possibly none) or, for a 0-d param, ``Replicate()``
(every rank holds the same value). The global norm is the norm of the whole grads, so

    sharded grads:    sum over ranks of  sum |g_local|^p   (one all-reduce per mesh)
    replicated grads: counted once, after the all-reduce (never world-size times)
    plain tensors:    counted once, like replicated grads (a model not parallelized)

and ``p = inf`` takes maxima instead of sums. Every rank then scales its local pieces by
the same coefficient, ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does on whole grads.

Collectives: one ``all_reduce`` per mesh that holds sharded grads, meshes taken in the
order of their process-group names. Which meshes hold sharded grads depends on the
params' placements only (the same on every rank), so every rank issues the same
all-reduces in the same order. A rank whose shard is empty still takes part.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from fczero.comm import collectives
from fczero.core.spec import mesh_device

logger = logging.getLogger("fczero")

__all__ = ["clip_grad_norm_"]

_EPS = 1e-6  # the same guard torch.nn.utils.clip_grad_norm_ adds to the norm


def clip_grad_norm_(
    parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale grads in place so that their global ``norm_type``-norm is at most ``max_norm``.

    The drop-in for ``torch.nn.utils.clip_grad_norm_`` on a model that ``fczero.parallelize``
    sharded: it gives the norm of the whole grads (as one process holding the whole model
    would compute it) and clips every shard by the same factor. Call it on every rank, in
    the same place, after ``backward()`` and before ``optimizer.step()``.

    Args:
        parameters: a module (its ``parameters()``), one tensor, or an iterable of tensors.
            Params without a grad are skipped.
        max_norm: the largest allowed norm (>= 0).
        norm_type: ``p`` of the p-norm (> 0), or ``float('inf')`` for the largest
            absolute element.
        error_if_nonfinite: raise if the total norm is nan or inf (grads untouched).
        foreach: use the multi-tensor kernels (``None``: when the device supports them).

    Returns:
        The total norm before clipping, a float32 scalar tensor on the grads' device,
        equal on every rank.
    """
    params = _parameter_list(parameters)
    max_norm, norm_type = _check_numbers(max_norm, norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)

    sharded: dict[str, tuple[DTensor, list[torch.Tensor]]] = {}  # group name -> (example, locals)
    whole: list[torch.Tensor] = []
    for g in grads:
        if not isinstance(g, DTensor):
            whole.append(g)
            continue
        _check_placements(g)
        if all(isinstance(pl, Replicate) for pl in g.placements):
            whole.append(g.to_local())
            continue
        key = g.device_mesh.get_group().group_name
        sharded.setdefault(key, (g, []))[1].append(g.to_local())

    device = (whole[0] if whole else next(iter(sharded.values()))[1][0]).device
    inf = math.isinf(norm_type)
    parts = []  # one float32 scalar per source, already combined over ranks
    for name in sorted(sharded):  # the same order on every rank
        example, locals_ = sharded[name]
        # where the group communicates (param offload keeps grads on the host)
        comm = mesh_device(example.device_mesh)
        local = _local_norm(locals_, norm_type, foreach).to(comm)
        local = local if inf else local.pow(norm_type)
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        collectives.reduce_in_place(local, op, example.device_mesh.get_group())
        parts.append(local.to(device))
    if whole:
        local = _local_norm(whole, norm_type, foreach).to(device)
        parts.append(local if inf else local.pow(norm_type))
    stacked = torch.stack(parts)
    total = stacked.max() if inf else stacked.sum().pow(1.0 / norm_type)

    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"fczero.clip_grad_norm_: the total norm of order {norm_type} is {total.item()}; "
            "the grads were left as they are. Look for nan/inf in the loss or grads, or pass "
            "error_if_nonfinite=False to clip anyway (the grads then become nan)."
        )
    coef = torch.clamp(max_norm / (total + _EPS), max=1.0)
    _scale(whole + [t for _, locals_ in sharded.values() for t in locals_], coef, foreach)
    return total


def _parameter_list(parameters: object) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        return list(parameters.parameters())
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    try:
        params = list(parameters)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            "fczero.clip_grad_norm_ needs a module, a tensor or an iterable of tensors "
            f"(e.g. model.parameters()), got {type(parameters).__name__}."
        ) from None
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                "fczero.clip_grad_norm_ needs tensors (e.g. model.parameters()); got an "
                f"element of type {type(p).__name__}."
            )
    return params


def _check_numbers(max_norm: float, norm_type: float) -> tuple[float, float]:
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"fczero.clip_grad_norm_: {name} must be a number, got {value!r} "
                f"({type(value).__name__})."
            )
    if not max_norm >= 0:
        raise ValueError(f"fczero.clip_grad_norm_: max_norm={max_norm} must be 0 or more.")
    if not (norm_type > 0 or norm_type == math.inf):
        raise ValueError(
            f"fczero.clip_grad_norm_: norm_type={norm_type} is not supported; use a p-norm "
            "with p > 0 (2.0 is the usual one) or float('inf')."
        )
    return float(max_norm), float(norm_type)


def _check_placements(g: DTensor) -> None:
    for pl in g.placements:
        if not isinstance(pl, (Shard, Replicate)):
            raise ValueError(
                f"fczero.clip_grad_norm_: a grad has placement {pl}; only Shard and Replicate "
                "grads (what fczero produces) can be clipped. Call it after backward() has "
                "finished, on the grads fczero reduced."
            )
    if sum(isinstance(pl, Shard) for pl in g.placements) > 1 or (
        g.device_mesh.ndim > 1 and any(isinstance(pl, Shard) for pl in g.placements)
    ):
        raise ValueError(
            "fczero.clip_grad_norm_: a grad is sharded over a mesh with more than one axis; "
            "fczero shards over one axis only, so this grad did not come from fczero. Clip "
            "it with torch.nn.utils.clip_grad_norm_."
        )


def _local_norm(
    tensors: list[torch.Tensor], norm_type: float, foreach: bool | None
) -> torch.Tensor:
    """The norm of this rank's pieces, as a float32 scalar (0 when every piece is empty)."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    norm = torch.nn.utils.get_total_norm(tensors, norm_type, foreach=foreach)
    return norm.float()


def _scale(tensors: list[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() > 0:
            groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, dtype), group in groups.items():
        c = coef.to(device=device, dtype=dtype)
        use_foreach = foreach if foreach is not None else device.type in ("cuda", "cpu")
        if use_foreach:
            torch._foreach_mul_(group, c)
        else:
            for t in group:
                t.mul_(c)
