"""Eager stage 3: free unsharded params after forward, gather them again in backward.

Autograd would keep every unsharded param that an op saved for backward (a matmul
saves its weight) until backward runs: stage-2 memory. While a parallelized root
module runs forward eagerly, fczero installs saved-tensor hooks:

    pack(t):   t shares storage with a live unsharded param?  -> keep a small recipe
               (which param, and t's size/stride/offset within the gathered buffer)
    unpack(r): gather the param again (an all-gather in backward) -> view it as t was

A tensor-parallel param (``fczero.comm.meshes``) is shown to modules as a DTensor whose
local tensor is the gathered one; autograd saves such DTensors, so ``pack`` looks at
a DTensor's local tensor and ``unpack`` wraps the regathered view the same way.

Backward prefetch: the params packed during forward are listed in the order they were
first saved. When backward unpacks one of them, the regathers of the params saved
before it (the ones backward reaches next) are issued too, up to the root's prefetch
window in unsharded bytes (at least one), so the next all-gather runs while this
layer's grads are computed; each is waited when it is unpacked, and any that backward
never unpacks are waited when backward ends (a callback queued on the autograd engine).

With eager buckets on (``fczero.runtime.eager_buckets``), the saved params are cut into buckets
along that list, as forward's gathers are: a regather issues its whole bucket as one
all-gather, and the first member unpacked hands them all out.

Backward walks the autograd graph in the same order on every rank, and the prefetch
decisions use only that order and global shapes, so the regathers are issued in the
same order everywhere.

[Note: decided by structure]
Whether a tensor is still alive is not the same on every rank: a process group's own
threads may refer to a collective's tensors for a moment after it was waited (gloo's
worker thread lets go of its finished work when it gets to it), and torch keeps a
tensor's Python object alive while C++ refers to it. So no decision that issues a
collective reads liveness. A unit's params are listed whether or not their gathers are
still alive (on 2 gloo ranks under load, a mate freed on one rank and still referenced on
the other was listed on one rank only, which then regathered it alone, and gloo aborted
on the mismatched sizes), and a regathered param is reused only by later unpacks in the
autograd node that regathered it (which holds it while it runs); the next node regathers.

Units ([Note: units] in ``fczero.runtime.units``) make this hold when the params a rank
saves depend on its data (experts without tokens save nothing). A unit's params are
marked as mates (``group``); when one of them is first saved, all are listed, in the
unit's order, and the first unpack of any of them regathers them all, in that order
(the others wait in ``ahead`` for their own unpack, or for the end of backward). The
prefetch window then counts a unit's bytes as handed over once the unit is reached,
whichever of its params were unpacked, so every rank decides alike.

Under ``torch.compile`` none of this runs: the gather is tagged for recomputation instead
(see ``fczero.core.spec.ShardSpec.unshard``).
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from fczero.comm import collectives
from fczero.runtime import eager_buckets

if TYPE_CHECKING:
    from fczero.core.spec import ShardSpec
    from fczero.core.state import EagerForward


@dataclass
class _Gathered:
    storage: StorageWeakRef
    spec: ShardSpec
    param: torch.Tensor
    nbytes: int  # the unsharded param's bytes (the regather window counts them)
    # the entries of its unit, in the unit's order (itself included); None: no unit
    mates: list[_Gathered] | None = None


@dataclass
class _Recipe:
    """Packed stand-in for a saved view of an unsharded param."""

    gathered: _Gathered
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Piece:
    """A regathered param that is one member of an issued bucket, not handed out yet."""

    bucket: eager_buckets.Bucket
    index: int


@dataclass
class _DTensorRecipe:
    """Packed stand-in for a saved DTensor whose local tensor views an unsharded param."""

    local: _Recipe
    mesh: Any
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]


class ReshardScope:
    """Unsharded params gathered during one eager forward, keyed by storage, and the
    backward regathers of the ones saved for backward (see the module docstring).

    A root's forward makes one (``fczero.runtime.prefetch.EagerContext``), ``open``s it (its pack
    and unpack become the innermost saved-tensor hooks) and ``close``s it when the forward
    ends; the recipes packed meanwhile keep it alive until backward has unpacked them."""

    def __init__(self, window: int = 0, plans: RegatherPlans | None = None) -> None:
        self.owner: EagerForward | None = None  # the forward that opened it, while open
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self.window = window  # unsharded bytes of backward regathers issued ahead
        # the root's regather buckets (with a window only; none without a root's)
        self.plans = plans if plans is not None else RegatherPlans(0)
        # (saved position -> its bucket, saved position -> bytes its regather issues)
        self._plan: tuple[dict[int, list[int]], list[int]] = ({}, [])
        self._planned = -1  # len(saved) when _plan was made
        self.live: dict[int, _Gathered] = {}
        # id(_Gathered) -> (the autograd node that last regathered it, that regather)
        self.regathered: dict[int, tuple[Any, weakref.ref[torch.Tensor]]] = {}
        self.saved: list[_Gathered] = []  # packed params, in the order first saved
        self.position: dict[int, int] = {}  # id(_Gathered) -> index in ``saved``
        # prefetched regathers not unpacked yet: id(_Gathered) -> (that entry, its gather)
        self.ahead: dict[int, tuple[_Gathered, torch.Tensor]] = {}
        self.ahead_bytes = 0  # the unsharded bytes of what ``ahead`` holds
        self.issued: set[int] = set()  # regathered in this backward (never prefetch again)
        # units backward has reached (id of their first entry), and the units' entries
        # whose bytes ``ahead_bytes`` counts
        self.reached: set[int] = set()
        self.counted: set[int] = set()
        # the unit backward is in, and its regathered params (kept while it is)
        self.current_unit: int | None = None
        self.unit_start = 0  # its first position in ``saved``
        self.held: dict[int, torch.Tensor] = {}
        # positions in ``saved`` not issued in this backward, ascending (made on first use)
        self._unissued: list[int] | None = None
        self.draining = False  # a callback will wait for leftovers when backward ends

    def open(self, owner: EagerForward) -> None:
        """Install this scope's saved-tensor hooks (innermost) for the forward ``owner`` runs."""
        self.owner = owner
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()

    def close(self) -> None:
        """Remove the hooks ``open`` installed; what was packed still unpacks in backward."""
        hooks, self._hooks, self.owner = self._hooks, None, None
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def register(self, full: torch.Tensor, spec: ShardSpec, param: torch.Tensor) -> None:
        """Record an eagerly gathered unsharded param so that saving it packs a recipe."""
        inner = full.elem if isinstance(full, AsyncCollectiveTensor) else full
        storage = inner.untyped_storage()
        self.live[storage._cdata] = _Gathered(
            StorageWeakRef(storage), spec, param, spec.unsharded_bytes(param)
        )

    def group(self, fulls: list[torch.Tensor]) -> None:
        """The gathered params ``fulls`` (registered) form one unit: saved and regathered
        together (see the module docstring)."""
        mates = []
        for full in fulls:
            inner = full.elem if isinstance(full, AsyncCollectiveTensor) else full
            if type(inner) is not torch.Tensor:
                continue
            entry = self.live.get(torch._C._storage_id(inner))
            if entry is not None and entry.mates is None:
                mates.append(entry)
        if len(mates) > 1:
            for entry in mates:
                entry.mates = mates

    # [Note: Dynamo stays out of the hooks]
    # Autograd calls ``pack`` from C++ wherever a tensor is saved. Where that happens in code
    # that runs eagerly inside a compiled call (a block compiled by ``compile_blocks`` whose
    # frame Dynamo gave up on, or a function disabled for that frame only), Dynamo's frame
    # hook is still active and compiled ``pack`` itself: it broke its graph at the storage
    # lookup, and on torch 2.11 the code after the break was compiled again at every saved
    # tensor (its guard held a tensor that died) until Dynamo's recompile limit, which warns
    # (Hugging Face's Mixtral with its experts' loop, each block compiled). The hooks are
    # bookkeeping with no tensor math worth a graph, so both always run eagerly.
    @torch.compiler.disable
    def pack(self, t: torch.Tensor) -> Any:
        inner = t
        if type(t) is not torch.Tensor:  # (most saved tensors are: activations, params)
            if isinstance(t, DTensor):
                local = self.pack(t._local_tensor)
                if not isinstance(local, _Recipe):
                    return t
                return _DTensorRecipe(local, t.device_mesh, t.placements, t.shape, t.stride())
            inner = t.elem if isinstance(t, AsyncCollectiveTensor) else t
            if type(inner) not in (torch.Tensor, torch.nn.Parameter):
                return t  # a subclass that is not an unsharded param
        # the storage's address, read without making a Python storage object: one would
        # live (tracked by the garbage collector) as long as the storage, for every tensor
        # saved in forward, most of them activations
        entry = self.live.get(torch._C._storage_id(inner))
        return t if entry is None else self._recipe(entry, inner) or t

    def _recipe(self, entry: _Gathered, inner: torch.Tensor) -> _Recipe | None:
        """The recipe of ``inner``, a view of the unsharded param ``entry`` recorded, if its
        storage is still that one (a freed storage's address may be reused; else None)."""
        if entry.storage.expired():
            return None
        if id(entry) not in self.position:
            # a unit: all its params, in order, alive or not ([Note: decided by structure])
            for listed in entry.mates or (entry,):
                if id(listed) not in self.position:
                    self.position[id(listed)] = len(self.saved)
                    self.saved.append(listed)
            self._unissued = None  # planned again over the longer list
        return _Recipe(entry, inner.size(), inner.stride(), inner.storage_offset())

    @torch.compiler.disable  # ([Note: Dynamo stays out of the hooks])
    def unpack(self, packed: Any) -> torch.Tensor:
        kind = type(packed)
        if kind is _Recipe:
            full = self._regathered(packed.gathered)
            return full.as_strided(packed.size, packed.stride, packed.offset)
        if kind is _DTensorRecipe:
            return DTensor.from_local(
                self.unpack(packed.local),
                packed.mesh,
                packed.placements,
                run_check=False,
                shape=packed.shape,
                stride=packed.stride,
            )
        return packed

    def _regathered(self, entry: _Gathered) -> torch.Tensor:
        """The unsharded param again: alive from an earlier unpack, prefetched, or issued
        now; then the regathers of the params saved before it are issued ahead."""
        key = id(entry)
        if entry.mates is not None:
            position = self._reach_unit(entry)
            full = self.held.get(key)
        else:  # reused only within the node that regathered it ([Note: decided by structure])
            position = self.position[key]
            node = torch._C._current_autograd_node()
            last = self.regathered.get(key)
            full = last[1]() if last is not None and node is not None and last[0] is node else None
        if full is None:
            prefetched = self.ahead.pop(key, None)
            if prefetched is not None and entry.mates is None:
                self.ahead_bytes -= prefetched[0].nbytes
            pending = prefetched[1] if prefetched else self._issue(self.position[key])
            full = self._finish(entry, pending)
            if entry.mates is None:
                self.regathered[key] = (node, weakref.ref(full))
            else:  # held while backward is in this unit: a param read twice is regathered once
                self.held[key] = full
        self._issue_ahead(position)
        return full

    def _reach_unit(self, entry: _Gathered) -> int:
        """Backward unpacks a param of ``entry``'s unit. On entering the unit, regather each
        of its params in the unit's order (those not in flight already, the first time;
        all of them when backward comes back to a unit it left), and count them all as
        handed over: neither may depend on which params this rank unpacks. Returns the
        unit's first position, from which the prefetch looks ahead."""
        unit = id(entry.mates[0])
        if unit == self.current_unit:  # (most unpacks: nothing to look up again)
            return self.unit_start
        position = self.position
        mates = sorted((m for m in entry.mates if id(m) in position), key=lambda m: position[id(m)])
        if unit in self.reached:  # back in a unit it left: all of it again, from scratch
            for mate in mates:
                old = self.ahead.pop(id(mate), None)
                if old is not None:
                    _settle(old[1])
                self.issued.discard(id(mate))
            self._unissued = None
        self.current_unit, self.held = unit, {}
        self.reached.add(unit)
        for mate in mates:
            if id(mate) in self.counted:
                self.counted.discard(id(mate))
                self.ahead_bytes -= mate.nbytes
            if id(mate) in self.issued:
                continue  # in flight (prefetched, or with an earlier mate's bucket): in ``ahead``
            self._hold(mate, self._issue(self.position[id(mate)]), count=False)
        self.unit_start = self.position[id(mates[0])]
        return self.unit_start

    @staticmethod
    def _finish(entry: _Gathered, pending: torch.Tensor | _Piece) -> torch.Tensor:
        if isinstance(pending, _Piece):
            return pending.bucket.member(pending.index)
        return collectives.settle(pending)

    def _buckets(self) -> tuple[dict[int, list[int]], list[int]]:
        """Regather buckets over the saved list (looked up again if it grew): each saved
        position's bucket, and the bytes its regather issues."""
        if self._planned != len(self.saved) and self.window > 0:
            self._planned = len(self.saved)
            self._plan = self.plans.plan(self.saved)
        return self._plan

    def _issue(self, position: int) -> torch.Tensor | _Piece:
        """Regather the param saved at ``position``, or its whole bucket (the other
        members then wait in ``ahead``); returns that param's pending regather."""
        entry = self.saved[position]
        bucket = self._buckets()[0].get(position)
        if bucket is None:
            self._mark_issued(entry)
            return entry.spec.regather(entry.param)
        members = [self.saved[i] for i in bucket]
        issued = eager_buckets.regather_bucket([(e.spec, e.param) for e in members])
        mine: _Piece | None = None
        for k, member in enumerate(members):
            self._mark_issued(member)
            if member is entry:
                mine = _Piece(issued, k)
            else:
                self._hold(member, _Piece(issued, k))
        return mine

    def _hold(self, entry: _Gathered, pending: torch.Tensor | _Piece, count: bool = True) -> None:
        """Keep a regather issued ahead until its unpack; waited at the end of backward
        if it is never unpacked (at once when no backward is running). ``count``: its
        bytes count against the window until it is handed over (or its unit reached)."""
        self.ahead[id(entry)] = (entry, pending)
        if count and (entry.mates is None or id(entry.mates[0]) not in self.reached):
            self.ahead_bytes += entry.nbytes
            if entry.mates is not None:
                self.counted.add(id(entry))
        if torch._C._current_graph_task_id() == -1:
            _settle(pending)
        elif not self.draining:
            self.draining = True
            torch.autograd.Variable._execution_engine.queue_callback(self._drain)

    def _mark_issued(self, entry: _Gathered) -> None:
        self.issued.add(id(entry))
        if self._unissued is not None:
            k = bisect.bisect_left(self._unissued, self.position[id(entry)])
            if k < len(self._unissued) and self._unissued[k] == self.position[id(entry)]:
                del self._unissued[k]

    def _issue_ahead(self, position: int) -> None:
        """Issue the regathers of params saved before ``position``, latest first, while
        they fit in the window beside those already in flight (at least one). The
        positions not issued yet are kept sorted, so each call looks only at those."""
        if self.window <= 0 or torch._C._current_graph_task_id() == -1:
            return  # prefetch off, or unpacked outside backward (no end to wait at)
        if self._unissued is None:
            self._unissued = [
                i for i, e in enumerate(self.saved) if id(e) not in self.issued
            ]
        ahead = self.ahead_bytes
        issue_bytes = self._buckets()[1]
        k = bisect.bisect_left(self._unissued, position) - 1
        while k >= 0:
            i = self._unissued[k]
            size = issue_bytes[i]
            if not eager_buckets.fits(ahead, size, self.window):
                break
            self._hold(self.saved[i], self._issue(i))  # (drops i and its bucket from the list)
            ahead += size
            k = bisect.bisect_left(self._unissued, i) - 1

    def _drain(self) -> None:
        """End of backward: wait for the prefetched regathers nobody unpacked; a later
        backward over the same graph (``retain_graph``) may regather everything again."""
        for _, pending in self.ahead.values():
            _settle(pending)
        self.ahead, self.ahead_bytes, self.issued, self.draining = {}, 0, set(), False
        self.reached, self.counted = set(), set()
        self.current_unit, self.held = None, {}
        self._unissued = None
        self.regathered = {}


class RegatherPlans:
    """A root's regather buckets, kept from one backward to the next.

    Each forward makes a new ``ReshardScope``, but a training loop saves the same params
    in the same order every step, so the plan over the saved list (``eager_buckets.plan``,
    and each position's issue bytes) is made again only when that list changed: the
    params and their specs, by identity, in order. Only the last plan is kept."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._key: tuple = ()
        self._plan: tuple[dict[int, list[int]], list[int]] = ({}, [])

    def plan(self, saved: list[_Gathered]) -> tuple[dict[int, list[int]], list[int]]:
        """(saved position -> its bucket, saved position -> bytes its regather issues)."""
        key = tuple(x for e in saved for x in (e.param, e.spec))
        old = self._key
        if len(old) != len(key) or any(a is not b for a, b in zip(old, key)):
            entries = [(e.spec, e.param, False) for e in saved]
            sizes = [e.nbytes for e in saved]
            self._key = key
            self._plan = eager_buckets.positions(entries, self.bucket_bytes, sizes)
        return self._plan


def _settle(pending: torch.Tensor | _Piece) -> None:
    if isinstance(pending, _Piece):
        pending.bucket.settle()
    else:
        collectives.settle(pending)


def open_scope() -> ReshardScope | None:
    """The reshard scope whose hooks are the innermost ``saved_tensors_hooks`` on this
    thread, if any: how a root whose forward runs inside another root's finds the scope
    it joins. Torch keeps that stack (per thread); fczero keeps no record of its own."""
    top = _top_saved_tensors_hooks()
    owner = getattr(top[0], "__self__", None) if top is not None else None
    return owner if isinstance(owner, ReshardScope) else None


def _top_saved_tensors_hooks() -> tuple | None:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(True) if top is not None else None  # (True: as in eager, tracing or not)
