"""Opt-in checks that every rank issues the same collectives (``check_policy=CheckPolicy()``).

fczero's collective order is the same on every rank as long as every rank runs the
same code on the same shapes. When that fails (a rank-dependent branch, a graph break
or a recompile on some ranks only), ranks wait on each other forever, or pair
unrelated collectives. These checks turn that into an error within
``check_timeout_s`` seconds that says which collective differs.

Each check publishes this rank's *fingerprint* (a list of short strings, one per
collective) in the process group's c10d store under a key that every rank computes
the same way, then reads every other rank's fingerprint with a timeout (and drops its
previous key of that kind, which nobody reads again):

- at ``parallelize``: the group size, the options and every param's name, shape,
  dtype and ``requires_grad`` (``check_model``). Differing models compile different
  collectives, so this is refused before anything is sharded.
- for every graph that Inductor (or ``fczero.testing.backends``) compiles with
  collectives on a checked group: the graph's collectives in program order, under
  the graph's number on this rank (``check_graph``, called by ``fczero.passes``).
  A graph break or recompile on one rank only gives that rank a graph the others
  do not compile at the same number: a mismatch or a timeout, at compile time.
- in eager mode, before each gather and at the end of each forward of the parallelized
  root (``EagerLog``): a rank about to gather another param, or none, is named before the
  collective runs, with the param's name on every rank.

Costs: a store round trip per compiled graph (nothing per compiled step), and in eager
mode one per gather and one per forward (docs/troubleshooting.md gives a measurement). Limits: the graph check runs where fczero's passes run (not with
``compile_passes=False``), and a graph that Inductor takes from its FX graph cache on
some ranks but compiles on others is checked on those ranks only (they time out): use
the check to find a hang, not as a guard in every production run.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Collection, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed import distributed_c10d as c10d
from torch.distributed.tensor import DTensor

from fczero.comm.collectives import backend_of
from fczero.comm.graph_ops import collective_group, op_name


#: ``all_gather_into_tensor`` under the name torch 2.13 gives it (there the old name warns
#: that it is deprecated, once per process), or the old name where a torch lacks the new
#: one. Same arguments.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
logger = logging.getLogger("fczero")



class CollectiveMismatchError(RuntimeError):
    """Ranks would issue different collectives (or one rank never reached the check)."""


def _checkable(group_name: str) -> bool:
    """The fake process group (one process playing every rank) has no peers to ask."""
    return backend_of(group_name) != "fake"


def exchange(group_name: str, kind: str, entries: list[str], timeout_s: float, what: str) -> None:
    """Publish ``entries`` as this rank's fingerprint of ``what``; raise if another rank's differs.

    ``kind`` names the sequence of exchanges this belongs to; the n-th exchange of a kind
    on one rank is compared with the n-th of the same kind on every other rank. ``what``
    may name that number as ``{n}``.

    [Note: where the exchange counts live]
    This rank's count of exchanges of each kind on a group is kept in the store, beside
    the keys it numbers (``fczero/<group>/<kind>/count/<rank>``, bumped by ``store.add``),
    not in this process's memory: it is per group and per rank by construction, every
    model checked on that group takes its turn in the same sequence on every rank, and
    a new process group starts with a new store.
    """
    if not _checkable(group_name):
        return
    group = c10d._resolve_process_group(group_name)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    base = c10d._get_default_store()
    number = base.add(f"fczero/{group_name}/{kind}/count/{rank}", 1) - 1
    what = what.format(n=number)
    store = dist.PrefixStore(f"fczero/{group_name}/{kind}/{number}", base)
    store.set(str(rank), json.dumps(entries))
    others = [r for r in range(world) if r != rank]
    try:
        store.wait([str(r) for r in others], timedelta(seconds=timeout_s))
    except RuntimeError as e:  # the store's timeout (DistStoreError on recent torch)
        missing = [r for r in others if not store.check([str(r)])]
        raise CollectiveMismatchError(
            f"fczero: rank {rank} reached {what} but rank(s) {missing} did not within "
            f"{timeout_s:g} s. This rank's collectives there: {_summary(entries)}. The "
            "other ranks are elsewhere: a recompile or graph break on some ranks only "
            "(a rank-dependent shape or Python value), a rank-dependent branch, or a rank "
            "that stopped. See 'Ranks issue different collectives' in "
            "docs/troubleshooting.md."
        ) from e
    for other in others:
        theirs = json.loads(store.get(str(other)).decode())
        if theirs != entries:
            raise CollectiveMismatchError(_mismatch(what, rank, entries, other, theirs))
    if number > 0:
        # Every rank wrote round ``number`` after reading all of round ``number - 1``, so
        # nobody reads this rank's previous key again: drop it (eager checks every step).
        with contextlib.suppress(RuntimeError, NotImplementedError):
            dist.PrefixStore(f"fczero/{group_name}/{kind}/{number - 1}", base).delete_key(str(rank))


def _summary(entries: list[str], limit: int = 4) -> str:
    if not entries:
        return "none"
    shown = ", ".join(entries[:limit])
    more = f" and {len(entries) - limit} more" if len(entries) > limit else ""
    return f"{len(entries)} ({shown}{more})"


def _mismatch(what: str, rank: int, mine: list[str], other: int, theirs: list[str]) -> str:
    index = next(
        (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
        min(len(mine), len(theirs)),
    )
    here = mine[index] if index < len(mine) else "nothing (its list ends)"
    there = theirs[index] if index < len(theirs) else "nothing (its list ends)"
    return (
        f"fczero: ranks {rank} and {other} differ at {what}: entry #{index} is {here} on "
        f"rank {rank} but {there} on rank {other} ({len(mine)} against {len(theirs)} "
        "entries). Left alone, the ranks would wait on each other or pair unrelated "
        "collectives. Every rank must run the same code on the same shapes: see 'Ranks "
        "issue different collectives' in docs/troubleshooting.md."
    )


# ---- at parallelize -------------------------------------------------------------------


def check_model(
    group_name: str,
    world: int,
    options: object,
    params: list[tuple[str, torch.Tensor]],
    timeout_s: float,
) -> None:
    """Every rank parallelizes the same params with the same options over the same group size."""
    entries = [f"group size {world}", f"options {options!r}"]
    entries += [f"{n} {list(p.shape)} {p.dtype} grad={p.requires_grad}" for n, p in params]
    exchange(group_name, "parallelize", entries, timeout_s, "parallelize (the model and options)")


def check_same_values(
    group_name: str, params: list[tuple[str, torch.Tensor]], device: torch.device
) -> None:
    """Every rank starts from the same values: two float64 checksums per param (its sum and
    its norm), all-gathered once over the data-parallel group, as DDP compares its ranks'
    params when it is built. Raises on every rank, naming the first param that differs.

    [Note: the same weights on every rank]
    fczero shards each rank's own copy of the model: rank r keeps rows r of its own values.
    Built from different seeds, the ranks' shards would come from different models, and
    training would produce garbage without a word. Params on the meta device have no
    values yet (they are initialized during ``parallelize``) and are skipped; so is the
    fake process group, whose collectives return garbage. A sum is not a hash, but two
    independently initialized tensors have equal sums and norms with negligible chance;
    values from the same seed agree exactly on every rank of one machine type, and a
    relative slack of 1e-6 allows for reductions ordered differently elsewhere."""
    group = c10d._resolve_process_group(group_name)
    world = dist.get_world_size(group)
    # a tensor-parallel param: its local part (the same on every rank of this group)
    local = [(n, p.to_local() if isinstance(p, DTensor) else p) for n, p in params]
    named = [(n, p) for n, p in local if p.device.type != "meta"]
    if world == 1 or not named or not _checkable(group_name):
        return
    with torch.no_grad():
        mine = torch.stack(
            [
                torch.stack([p.sum(dtype=torch.float64), torch.linalg.vector_norm(p, dtype=torch.float64)])
                for _, p in named
            ]
        ).to(device)  # (n, 2)
    everyone = mine.new_empty((world * mine.shape[0], 2))
    _all_gather_single(everyone, mine, group=group)
    everyone = everyone.cpu().view(world, *mine.shape)  # (world, n, 2)
    scale = everyone.abs().amax(dim=0).clamp_min(1.0)  # (n, 2)
    differs = ((everyone - everyone[0]).abs() > 1e-6 * scale).any(dim=2)  # (world, n)
    if not differs.any():
        return
    rank, index = (int(i) for i in differs.nonzero()[0])
    name = named[index][0]
    raise ValueError(
        f"fczero: parameter {name!r} differs between ranks 0 and {rank} before sharding "
        f"(its sum is {float(everyone[0, index, 0]):.6g} on rank 0 and "
        f"{float(everyone[rank, index, 0]):.6g} on rank {rank}). Every rank must start "
        "from the same weights: call torch.manual_seed(<same seed>) on every rank before "
        "building the model, or load the same checkpoint on every rank, then parallelize."
    )


# ---- compiled graphs ------------------------------------------------------------------


def graph_collectives(
    graph: fx.Graph, checked: Collection[str], key: Mapping[str, str] | None = None
) -> dict[str, list[str]]:
    """The collectives of ``graph`` on each group in ``checked``, in program order; under
    ``key[group]`` where ``key`` is given (several names of one group listed as one)."""
    found: dict[str, list[str]] = {}
    for node in graph.nodes:
        group = collective_group(node)
        if group is None or group not in checked:
            continue
        group = key[group] if key is not None else group
        name = op_name(node)
        val = node.meta.get("val")
        desc = name
        if isinstance(val, torch.Tensor):
            desc += f" {str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
        found.setdefault(group, []).append(desc)
    return found


def check_graph(gm: fx.GraphModule, timeouts: Mapping[str, float]) -> None:
    """Compare this graph's collectives with the graph of the same number on every rank;
    ``timeouts``: the checked groups (the graph's groups whose root has a ``check_policy``,
    found with its pass settings by ``fczero.passes.registry``) and their ``timeout_s``."""
    if not timeouts:
        return
    # keyed by each group's own name, not the name a root's collectives carry (which may
    # differ between ranks: [Note: a root's group name] in ``fczero.comm.meshes``)
    own = {name: c10d._resolve_process_group(name).group_name for name in timeouts}
    timeout = {}
    for name, seconds in timeouts.items():
        timeout[own[name]] = max(seconds, timeout.get(own[name], 0.0))
    for group, entries in graph_collectives(gm.graph, timeouts, own).items():
        exchange(group, "graph", entries, timeout[group], "compiled graph #{n} of this process")


# ---- eager forwards -------------------------------------------------------------------


class EagerLog:
    """The gathers of each eager forward of a checked root, each compared across ranks
    *before* it is issued, and the end of the forward after them (one ``exchange`` each,
    in one sequence): a rank that would gather something else, or nothing more, is named
    with the param before any collective could pair with the wrong one. One per checked
    root, opened by its forward's context (``fczero.runtime.prefetch.EagerContext``)."""

    def __init__(self, group_name: str, timeout_s: float, names: dict[int, str] | None = None) -> None:
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.names = names or {}  # id of a sharded param (or its leaf) -> its name
        self.entries: list[str] = []
        self.forwards = 0

    def note(self, shape: torch.Size, dtype: torch.dtype | None, param: object = None) -> None:
        """About to gather ``param``: check that every rank is about to gather the same."""
        dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else "same"
        name = self.names.get(id(param), "a param")
        self.entries.append(f"gather {list(shape)} as {dtype_name}")
        self._exchange(
            f"gather {name} {list(shape)} as {dtype_name}",
            f"gather #{len(self.entries) - 1} of eager forward #{self.forwards}",
        )

    def start(self) -> None:
        self.entries = []

    def finish(self) -> None:
        self.forwards += 1
        self._exchange(
            f"end of forward after {len(self.entries)} gathers",
            f"the end of eager forward #{self.forwards - 1}",
        )

    def _exchange(self, entry: str, what: str) -> None:
        try:
            exchange(self.group_name, "eager", [entry], self.timeout_s, what)
        except CollectiveMismatchError as e:
            if self.entries:
                e.args = (f"{e.args[0]} This rank's gathers in this forward so far: "
                          f"{_summary(self.entries)}.",)
            raise


__all__ = [
    "CollectiveMismatchError",
    "EagerLog",
    "check_graph",
    "check_model",
    "check_same_values",
    "exchange",
    "graph_collectives",
]
