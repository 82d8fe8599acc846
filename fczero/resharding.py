"""Eager stage 3: free unsharded params after forward, gather them again in backward.

Autograd would keep every unsharded param that an op saved for backward (a matmul
saves its weight) until backward runs: stage-2 memory. While a parallelized root
module runs forward eagerly, fczero installs saved-tensor hooks:

    pack(t):   t shares storage with a live unsharded param?  -> keep a small recipe
               (which param, and t's size/stride/offset within the gathered buffer)
    unpack(r): gather the param again (an all-gather in backward) -> view it as t was

A tensor-parallel param (``fczero.meshes``) is shown to modules as a DTensor whose
local tensor is the gathered one; autograd saves such DTensors, so ``pack`` looks at
a DTensor's local tensor and ``unpack`` wraps the regathered view the same way.

Backward walks the autograd graph in the same order on every rank, so the regathers
are issued in the same order everywhere. Under ``torch.compile`` none of this runs:
the gather is tagged for recomputation instead (see ``sharding.ShardSpec.unshard``).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

if TYPE_CHECKING:
    from fczero.sharding import ShardSpec


@dataclass
class _Gathered:
    storage: StorageWeakRef
    spec: ShardSpec
    param: torch.Tensor


@dataclass
class _Recipe:
    """Packed stand-in for a saved view of an unsharded param."""

    gathered: _Gathered
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass
class _DTensorRecipe:
    """Packed stand-in for a saved DTensor whose local tensor views an unsharded param."""

    local: _Recipe
    mesh: Any
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]


class _Scope:
    """Unsharded params gathered during one eager forward, keyed by storage."""

    def __init__(self) -> None:
        self.live: dict[int, _Gathered] = {}
        self.regathered: dict[int, weakref.ref[torch.Tensor]] = {}

    def pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, DTensor):
            local = self.pack(t._local_tensor)
            if not isinstance(local, _Recipe):
                return t
            return _DTensorRecipe(local, t.device_mesh, t.placements, t.shape, t.stride())
        inner = t.elem if isinstance(t, AsyncCollectiveTensor) else t
        if not self.live or type(inner) not in (torch.Tensor, torch.nn.Parameter):
            return t  # nothing gathered yet, or a subclass that is not an unsharded param
        storage = inner.untyped_storage()
        entry = self.live.get(storage._cdata)
        if entry is None or entry.storage.expired():
            return t
        return _Recipe(entry, inner.size(), inner.stride(), inner.storage_offset())

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _DTensorRecipe):
            return DTensor.from_local(
                self.unpack(packed.local),
                packed.mesh,
                packed.placements,
                run_check=False,
                shape=packed.shape,
                stride=packed.stride,
            )
        if not isinstance(packed, _Recipe):
            return packed
        key = id(packed.gathered)
        ref = self.regathered.get(key)
        full = ref() if ref is not None else None
        if full is None:
            full = packed.gathered.spec.gather_for_backward(packed.gathered.param)
            self.regathered[key] = weakref.ref(full)
        return full.as_strided(packed.size, packed.stride, packed.offset)


_active: _Scope | None = None


def register_gathered(full: torch.Tensor, spec: ShardSpec, param: torch.Tensor) -> None:
    """Record an eagerly gathered unsharded param so that saving it packs a recipe."""
    if _active is None:
        return
    inner = full.elem if isinstance(full, AsyncCollectiveTensor) else full
    storage = inner.untyped_storage()
    _active.live[storage._cdata] = _Gathered(StorageWeakRef(storage), spec, param)


@contextlib.contextmanager
def reshard_scope():
    """Active around one eager forward of a parallelized root (nested roots join the outer)."""
    global _active
    if _active is not None:
        yield
        return
    scope = _Scope()
    _active = scope
    try:
        with torch.autograd.graph.saved_tensors_hooks(scope.pack, scope.unpack):
            yield
    finally:
        _active = None
