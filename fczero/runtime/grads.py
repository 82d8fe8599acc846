"""``check_finite_grads``: find the parameters whose gradient holds a NaN or an inf.

Opt-in, called by the user between ``backward()`` and ``optimizer.step()``. Each rank
holds a different shard of every gradient, so a NaN may sit on one rank only; one
small all-reduce (a flag per parameter, minimum over the data-parallel group) gives
every rank the same answer, so every rank raises, or steps, alike.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fczero.comm import collectives

logger = logging.getLogger("fczero")


def check_finite_grads(model: nn.Module, *, raise_error: bool = True) -> list[str]:
    """Names of the params of ``model`` whose gradient is not finite on some rank.

    Call it on every rank (it runs one all-reduce when the model is parallelized).
    With ``raise_error`` (the default) a non-empty result raises ``FloatingPointError``
    instead; pass ``raise_error=False`` to skip the step yourself, e.g.
    ``if fczero.check_finite_grads(model, raise_error=False): optimizer.zero_grad()``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fczero.check_finite_grads needs an nn.Module, got {type(model).__name__}."
        )
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    if not named:
        return []
    meshes = {g.device_mesh for _, g in named if isinstance(g, DTensor)}
    if len(meshes) > 1:
        raise ValueError(
            "fczero.check_finite_grads: the gradients live on several meshes; call it on each "
            "parallelized model separately."
        )
    local = [g.to_local() if isinstance(g, DTensor) else g for _, g in named]
    device = local[0].device
    flags = torch.stack([torch.isfinite(g).all().to(device) for g in local]).to(torch.int32)
    if meshes:
        (mesh,) = meshes
        group = mesh.get_group() if mesh.ndim == 1 else None
        collectives.reduce_in_place(flags, dist.ReduceOp.MIN, group)
    bad = [name for (name, _), ok in zip(named, flags.tolist(), strict=True) if not ok]
    if bad and raise_error:
        shown = ", ".join(repr(n) for n in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise FloatingPointError(
            f"fczero: the gradients of {len(bad)} parameter(s) hold NaN or inf ({shown}). "
            "Look at the loss and inputs of this step; a lower learning rate, gradient "
            "clipping, or MixedPrecisionPolicy(reduce_dtype=torch.float32) under a 16-bit param_dtype often helps. "
            "To skip such steps instead, call check_finite_grads(model, raise_error=False) "
            "and zero the gradients when it returns names."
        )
    if bad:
        logger.warning("fczero: non-finite gradients in %d parameter(s): %s", len(bad), bad[:5])
    return bad


__all__ = ["check_finite_grads"]
