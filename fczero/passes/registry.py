"""Which process groups are fczero's, and the pass settings that ``parallelize`` chose.

Inductor calls a custom pass (and its partitioner hook) with nothing but the graph, and
its settings are the process's, so ``parallelize`` records here, per data-parallel
process group, how to bucket and prefetch, and whether to check the graphs' collectives
across ranks. A graph whose collectives use none of these groups is none of fczero's
business. This table is fczero's one record of the compiled path that outlives a call:
the settings of a group also carry what the passes noted while compiling under them
(the activation plans ``memory_report`` shows, the warnings already given), so a later
``parallelize`` on the same group starts both afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from fczero.comm.graph_ops import collective_group


@dataclass(frozen=True)
class PassSettings:
    groups: frozenset[str]
    bucket_bytes: int
    prefetch: int
    memory_budget: int | None
    replicate_groups: frozenset[str] = frozenset()  # HSDP: grads are all-reduced over these
    activation_offload: str = "off"
    offload_min_bytes: int = 0
    # the group's sharded params live in host memory (OffloadPolicy.params, on a GPU mesh)
    param_offload: bool = False
    # bytes of an element of param_dtype: reduces are sized at it (None: their own dtype)
    param_itemsize: int | None = None
    # check_policy: seconds to wait for the other ranks' graphs (None: graphs unchecked)
    check_timeout_s: float | None = None
    # this process's rank in the group: where its shard lands in an in-place all-gather
    # (so the graphs, and Inductor's cache key, differ between ranks only there)
    rank: int = 0
    # What compiling under these settings produced: not settings, so left out of the
    # comparison and of the repr (which keys Inductor's cache). The activation plan of
    # each forward/backward pair partitioned, oldest first (``fczero.offload.partition``),
    # and the warnings already given (each once per settings, not once per graph).
    plans: list = field(default_factory=list, compare=False, repr=False)
    warned: set[str] = field(default_factory=set, compare=False, repr=False)

    def first_time(self, warning: str) -> bool:
        """True once per settings for each ``warning`` key (then remembered in ``warned``)."""
        if warning in self.warned:
            return False
        self.warned.add(warning)
        return True


#: Data-parallel group name -> its settings. Per process, as Inductor's hooks are.
_BY_GROUP: dict[str, PassSettings] = {}


def register(
    group_name: str,
    *,
    bucket_bytes: int,
    prefetch: int,
    memory_budget: int | None,
    replicate_group: str | None = None,
    activation_offload: str = "off",
    offload_min_bytes: int = 0,
    param_offload: bool = False,
    param_itemsize: int | None = None,
    check_timeout_s: float | None = None,
    rank: int = 0,
) -> None:
    """Record the settings for one group (a later ``parallelize`` on the same group wins).
    ``replicate_group``: HSDP's replicate group, whose grad all-reduces are bucketed too."""
    _BY_GROUP[group_name] = PassSettings(
        frozenset({group_name}),
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
    )


def unregister(group_name: str) -> None:
    """Leave this group's graphs to Inductor alone (``compile_passes=False``)."""
    _BY_GROUP.pop(group_name, None)


def settings_of(group_name: str) -> PassSettings | None:
    """The settings registered for ``group_name`` (None: not one of fczero's)."""
    return _BY_GROUP.get(group_name)


def check_timeouts() -> dict[str, float]:
    """The groups whose compiled graphs are checked across ranks, with their timeouts."""
    return {
        name: s.check_timeout_s for name, s in _BY_GROUP.items() if s.check_timeout_s is not None
    }


def snapshot() -> tuple:
    """Everything that can change what the passes do: part of the Inductor cache key."""
    return tuple(sorted((k, repr(v)) for k, v in _BY_GROUP.items()))


def settings_for_graph(graph: fx.Graph) -> PassSettings | None:
    """The settings of the (first) registered group the graph communicates on, if any."""
    for node in graph.nodes:
        name = collective_group(node)
        if name in _BY_GROUP:
            return _BY_GROUP[name]
    return None
