"""``fczero.compile_blocks(model)``: compile each block of a parallelized model on its own.

The one call behind the per-block compile ([Note: blocks compiled alone] in
``fczero.runtime.units``): it finds the blocks among the model's units, so a user does not
need to know where a model keeps its layers (``model.layers``, ``model.model.layers``, an
encoder's and a decoder's stacks), and it refuses, with what to do instead, a model it
cannot serve that way.

A block here is a unit that is an element of a container (``layers.3``: an
``nn.ModuleList`` or ``nn.Sequential``) and whose class has other units in the model, or
whose container holds units of its class only (a model of one layer): a decoder layer,
an encoder's and a decoder's blocks. A parametrized module (``weight_norm``, a LoRA made
with ``torch.nn.utils.parametrize``) counts as its original class: parametrize gives each
such module a class of its own. The other units (an embedding, a final norm, a head,
the root; an embedding first in an ``nn.Sequential`` of blocks) stay eager. A block
inside another block (experts named as units inside layers) is compiled with the block
around it, not on its own.
"""

from __future__ import annotations

import collections
import logging

import torch.nn as nn
from torch.nn.utils import parametrize

from fczero.core.state import ATTR, Unit, is_parallelized

logger = logging.getLogger("fczero")


def compile_blocks(model: nn.Module, **options) -> list[str]:
    """Compile the forward of every block of ``model`` (a module that went through
    ``fczero.parallelize``, or one that holds it) on its own, with ``torch.compile``'s
    ``options`` (``backend``, ``mode``, ``dynamic``, ``fullgraph``). The gathers and
    reduce-scatters stay eager around each compiled body, prefetched a block ahead and
    bucketed; every block of a class shares one compiled body, so the first step costs one
    block's compile whatever the depth. Returns the paths of the blocks compiled.

    For the fastest steps compile the whole model instead (``torch.compile(model)``), where
    fczero's graph passes place the communication across blocks."""
    units = _units_of(model)
    if not units:
        raise ValueError(
            "fczero.compile_blocks: this model is not parallelized; call "
            "fczero.parallelize(model, mesh) first, then compile_blocks(model)."
            if not is_parallelized(model)
            else "fczero.compile_blocks: this model was parallelized with units=None (each "
            "read gathers), so it has no blocks; parallelize with units='auto' (the "
            "default) or units=[YourBlockClass] to compile blocks on their own."
        )
    outermost = _outermost_blocks(units)
    if not outermost:
        classes = ", ".join(
            sorted({unit.cls.__name__.removeprefix("FCZero") for _, _, unit in units if unit.cls})
        )
        raise ValueError(
            f"fczero.compile_blocks: no unit of this model is a block in a container "
            f"(units: {classes}), so there is nothing to compile on its own. Compile the "
            "whole model with torch.compile(model), or keep the blocks in an nn.ModuleList "
            "and name their class when parallelizing: "
            "fczero.parallelize(model, mesh, units=[YourBlockClass])."
        )
    for _, module in outermost:
        module.compile(**options)
    logger.info(
        "fczero: compiled %d block(s) on their own (%s); %d other unit(s) stay eager",
        len(outermost),
        ", ".join(sorted({type(module).__name__ for _, module in outermost})),
        len(units) - len(outermost),
    )
    return [path for path, _ in outermost]


def _units_of(model: nn.Module) -> list[tuple[str, nn.Module, Unit]]:
    """(path in ``model``, module, unit) of every unit module under ``model``, in module
    order."""
    found = []
    for path, module in model.named_modules():
        unit = getattr(module.__dict__.get(ATTR), "unit", None)
        if unit is not None:
            found.append((path, module, unit))
    return found


def _outermost_blocks(units: list[tuple[str, nn.Module, Unit]]) -> list[tuple[str, nn.Module]]:
    """(path, module) of each block among ``units`` (see the module docstring) that lies in
    no other block. Decided from the model's structure alone, the same on every rank."""
    kind = {path: _kind(module, unit) for path, module, unit in units}
    per_class = collections.Counter(kind.values())
    classes_in: dict[str, set] = collections.defaultdict(set)  # container -> its units' classes
    for path in kind:
        container, _, index = path.rpartition(".")
        if index.isdigit():
            classes_in[container].add(kind[path])
    blocks = []
    for path, module, _ in units:
        container, _, index = path.rpartition(".")
        if index.isdigit() and (per_class[kind[path]] > 1 or len(classes_in[container]) == 1):
            blocks.append((path, module))
    return [
        (path, module)
        for path, module in blocks
        if not any(_inside(path, other) for other, _ in blocks)
    ]


def _kind(module: nn.Module, unit: Unit) -> type | None:
    """The class a unit counts as: its module's, or for a parametrized module the class it
    had before: ``torch.nn.utils.parametrize`` subclasses it anew for every module, and the
    classes fczero derives from that one keep its module name, so the first class up the
    line defined elsewhere is the user's."""
    if unit.cls is None or not parametrize.is_parametrized(module):
        return unit.cls
    return next(c for c in unit.cls.__mro__ if c.__module__ != parametrize.__name__)


def _inside(path: str, other: str) -> bool:
    """Whether the module at ``path`` lies strictly inside the one at ``other``."""
    return path != other and (other == "" or path.startswith(f"{other}."))
