"""``WeakIds``: values keyed by live tensors' identity, held weakly, that answer "does any
of these tensors have a value?" for a whole list at C speed.

torch's ``WeakIdKeyDictionary`` builds a weak reference object per lookup, about a
microsecond a key in Python. fczero's global optimizer step hooks look up every param of
every optimizer that steps, also of optimizers that hold no fczero param (they must be
checked for params ``parallelize`` replaced): with a dict keyed by ``id`` such an
optimizer is cleared with one ``isdisjoint`` over its params' ids. An entry goes when
its tensor dies (a weak reference's callback), before the id can be reused; a lookup
also checks that the live tensor is the one that was stored.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch


class WeakIds:
    """Tensor (by identity, held weakly) -> value."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ref, Any]] = {}

    def __setitem__(self, key: torch.Tensor, value: Any) -> None:
        data, ident = self._data, id(key)

        def drop(ref: weakref.ref) -> None:
            if data.get(ident, (None,))[0] is ref:
                del data[ident]

        data[ident] = (weakref.ref(key, drop), value)

    def get(self, key: torch.Tensor, default: Any = None) -> Any:
        entry = self._data.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else default

    def any_of(self, keys: Iterable[torch.Tensor]) -> bool:
        """Whether some tensor of ``keys`` may have a value (ids only: confirm with ``get``)."""
        return not self._data.keys().isdisjoint(map(id, keys))

    def __len__(self) -> int:
        return len(self._data)
