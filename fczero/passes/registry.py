"""The pass settings of each parallelized root, and how a compiled graph finds its root's.

Inductor calls a custom pass (and its partitioner hook) with nothing but the graph, and
its settings are the process's. So each root keeps its own ``PassSettings``
(``RootState.passes``: how to bucket and prefetch, whether to check the graphs across
ranks, and what compiling under them produced: the activation plans ``memory_report``
shows, the warnings already given), and this module finds them again from a graph.

[Note: from a graph to its root]
A graph names the process groups of its collectives and nothing else of where it came
from. Each root's collectives carry a group name that no other live root uses ([Note: a
root's group name] in ``fczero/comm/meshes.py``: the group's own name while no other
model parallelized on it is alive, else another registered name of the same group), so
``parallelize`` records here, per name, the root that uses it (weakly: the model alone
keeps its root alive; a later root given the name of a dead one replaces it), and a
graph's settings are those of the root of the first such name among its collectives. A
graph of two roots (one model run inside another's forward) takes the settings of the
root whose collective comes first. A graph whose collectives carry no root's name is
none of fczero's business.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import fx

from fczero.comm.graph_ops import collective_group
from fczero.core.config import PassSettings


def new_settings(
    group_name: str,
    *,
    bucket_bytes: int,
    prefetch: int,
    memory_budget: int | None,
    replicate_group: str | None = None,
    reduce_group: str | None = None,
    activation_offload: str = "off",
    offload_min_bytes: int = 0,
    param_offload: bool = False,
    param_itemsize: int | None = None,
    check_timeout_s: float | None = None,
    rank: int = 0,
    touched_rows: bool = True,
) -> PassSettings:
    """The settings of one root's graphs on data-parallel group ``group_name``.
    ``replicate_group``: HSDP's replicate group, whose grad all-reduces are bucketed too;
    ``reduce_group``: the group of the root's reduce-scatters, where they have their own."""
    return PassSettings(
        frozenset({group_name, reduce_group} - {None}),
        bucket_bytes,
        prefetch,
        memory_budget,
        replicate_groups=frozenset({replicate_group}) if replicate_group else frozenset(),
        activation_offload=activation_offload,
        offload_min_bytes=offload_min_bytes,
        param_offload=param_offload,
        param_itemsize=param_itemsize,
        check_timeout_s=check_timeout_s,
        rank=rank,
        touched_rows=touched_rows,
    )


#: The group name a root's collectives carry -> that root (a ``RootState``, weakly). Per
#: process, as Inductor's hooks are.
_ROOTS: dict[str, weakref.ref] = {}


def register(group_name: str, root: Any) -> None:
    """Record ``root`` (a ``RootState``) as the root whose collectives carry ``group_name``;
    its graphs then find ``root.passes`` (None: ``CommPolicy(compile_passes=False)``, its
    graphs are left to Inductor)."""
    for name in [n for n, ref in _ROOTS.items() if ref() is None]:
        del _ROOTS[name]  # roots whose models are gone
    _ROOTS[group_name] = weakref.ref(root)


def settings_of(group_name: str) -> PassSettings | None:
    """The settings of the root whose collectives carry ``group_name`` (None: no root's, or
    its passes are off)."""
    ref = _ROOTS.get(group_name)
    root = ref() if ref is not None else None
    return root.passes if root is not None else None


def settings_for_graph(graph: fx.Graph) -> PassSettings | None:
    """The settings of the root of the graph's first collective that has one, if any."""
    for node in graph.nodes:
        name = collective_group(node)
        settings = settings_of(name) if name is not None else None
        if settings is not None:
            return settings
    return None


def check_timeouts(graph: fx.Graph) -> dict[str, float]:
    """The group names of ``graph`` whose collectives are checked across ranks (their
    root has a ``check_policy``), with their timeouts."""
    found = {}
    for node in graph.nodes:
        name = collective_group(node)
        settings = settings_of(name) if name is not None else None
        if settings is not None and settings.check_timeout_s is not None:
            found[name] = settings.check_timeout_s
    return found


def snapshot() -> tuple:
    """Everything that can change what the passes do: part of the Inductor cache key."""
    return tuple(sorted((name, repr(settings_of(name))) for name in _ROOTS if _ROOTS[name]()))
