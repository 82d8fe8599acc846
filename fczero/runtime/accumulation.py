"""Gradient accumulation: K micro-batches, communication only on the last one.

    with fczero.no_sync(model):          # or fczero.set_requires_gradient_sync(model, False)
        for x in micro_batches[:-1]:
            loss_fn(model(x)).backward()  # no reduce: whole grads summed on each rank
    loss_fn(model(micro_batches[-1])).backward()  # reduces the sum of all K
    optimizer.step()

The flag in effect when a forward runs decides what its backward does (so a backward
may run after the ``with`` block). While sync is off, each param's whole grad (in
``reduce_dtype``) goes to an accumulator leaf instead of being reduced; the first
synced forward takes that sum and its backward adds it before the reduce, once per
param, then the sum is freed. Stage 3 still all-gathers every param in each forward
(and in backward, to recompute); only the reduce is skipped. The exception is a param
kept by selective unsharding (``keep_unsharded``): its first gather of an accumulation
serves every micro-batch up to the synced one, and is dropped there
(``ParamState.reused``; eager mode also gathers again if the shard changed in between).

Misuse raises before anything changes: toggling inside a forward, and
``optimizer.step()`` while accumulated grads were never reduced.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.nn as nn

from fczero.core.state import ParamState, root_state

logger = logging.getLogger("fczero")


def set_requires_gradient_sync(model: nn.Module, requires_sync: bool) -> None:
    """Turn the gradient reduce of ``model``'s later backwards on (the default) or off.

    Off: backward sums each param's whole grad locally (no collective); the next
    forward with sync on reduces the sum with its own grads. Call it between
    iterations, on every rank alike, outside any forward.
    """
    if not isinstance(requires_sync, bool):
        raise TypeError(
            f"fczero.set_requires_gradient_sync needs True or False, got {requires_sync!r}."
        )
    root = root_state(getattr(model, "_orig_mod", model))  # a torch.compile wrapper too
    if root is None:
        raise ValueError(
            "fczero.set_requires_gradient_sync needs the root module that fczero.parallelize "
            f"returned (or its torch.compile wrapper); got a {type(model).__name__} that is "
            "not one. Pass the parallelized root, not a submodule."
        )
    if root.in_forward or torch.compiler.is_compiling():
        raise RuntimeError(
            "fczero: gradient sync was toggled inside a forward; set it before the forward "
            "(e.g. wrap the micro-batch's forward and backward in fczero.no_sync(model))."
        )
    if not requires_sync:
        for state in root.params:
            state.new_accumulator()
    root.sync = requires_sync
    logger.debug("fczero: gradient sync %s", "on" if requires_sync else "off")


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradient sync off inside the block (see ``set_requires_gradient_sync``); back on after."""
    set_requires_gradient_sync(model, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(model, True)


def check_before_step(states: list[ParamState]) -> None:
    """Before an optimizer step over ``states``: refuse grads that were never reduced."""
    for state in states:
        if state.acc is not None and state.acc.grad is not None:
            raise RuntimeError(
                "fczero: optimizer.step() while gradients accumulated with sync off were "
                "never reduced (so .grad misses them). Run the last micro-batch's forward "
                "and backward with sync on (after the fczero.no_sync block, or after "
                "fczero.set_requires_gradient_sync(model, True)), then step."
            )
