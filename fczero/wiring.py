"""Module wiring: each module that owns sharded params shows its unsharded params.

[Note: module wiring]
Each module that owns params gets a subclass of its own class (cached per class and
names) in which every param name is a read-only property returning the unsharded
param. ``module._parameters`` still holds the sharded param, so state dicts keep
their keys and values, and ``torch.compile`` traces the property like any Python.
Nothing in torch is patched.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.nn as nn

from fczero.state import ATTR

#: (user class, param names) -> its wired subclass. Per process: a generated class holds
#: no state of a model, so every model with such a module shares it; held weakly (it
#: lives while a module of it does).
_WIRED_CLASSES: weakref.WeakValueDictionary[tuple[type, tuple[str, ...]], type] = (
    weakref.WeakValueDictionary()
)


def _unsharded_property(name: str) -> property:
    def get(module: nn.Module) -> torch.Tensor:
        state = getattr(module, ATTR).params[name]
        if torch.compiler.is_compiling():  # the sharded DTensor stays out of the graph
            return state.unshard(state.leaf)
        return state.unshard(module._parameters[name])

    return property(get, doc=f"Unsharded {name!r}, gathered by fczero on each access.")


def wire_module(module: nn.Module, names: Iterable[str]) -> None:
    """Make ``module.<name>`` return the unsharded param for every name in ``names`` (its
    ``ParamState`` in the module's ``ModuleState`` gathers it)."""
    cls = type(module)
    key = (cls, tuple(sorted(names)))
    wired = _WIRED_CLASSES.get(key)
    if wired is None:
        attrs = {name: _unsharded_property(name) for name in key[1]}
        attrs["__module__"] = cls.__module__
        wired = type(f"FCZero{cls.__name__}", (cls,), attrs)
        _WIRED_CLASSES[key] = wired
    module.__class__ = wired
