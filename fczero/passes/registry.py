"""Which process groups are fczero's, and the pass settings that ``parallelize`` chose.

Inductor calls a custom pass with nothing but the graph, so ``parallelize`` records
here, per data-parallel process group, how to bucket and prefetch. A graph whose
collectives use none of these groups is none of fczero's business.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    # bytes of an element of param_dtype: reduces are sized at it (None: their own dtype)
    param_itemsize: int | None = None


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
    param_itemsize: int | None = None,
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
        param_itemsize=param_itemsize,
    )


def unregister(group_name: str) -> None:
    """Leave this group's graphs to Inductor alone (``compile_passes=False``)."""
    _BY_GROUP.pop(group_name, None)


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
