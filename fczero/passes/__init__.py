"""fczero's graph passes, in the order they run on each post-grad graph.

| pass                          | module       | what it does                                  |
| ----------------------------- | ------------ | --------------------------------------------- |
| look_up_touched_rows_pass     | touched_rows | an embedding looked up in the shards          |
| reduce_touched_rows_pass      | touched_rows | an embedding's grad sent as its touched rows  |
| sink_gathers_pass             | schedule.py  | each gather issued where it is used           |
| bucket_all_gathers_pass       | bucketing.py | one all-gather per block                      |
| bucket_reduce_scatters_pass   | bucketing.py | one reduce-scatter per block                  |
| bucket_all_reduces_pass       | all_reduce.py| one all-reduce per block (stage 1 grads, HSDP) |
| sink_waits_pass               | schedule.py  | waits just before first use                   |
| prefetch_all_gathers_pass     | schedule.py  | gathers issued a block ahead, under a budget  |
| gathers_before_reduces_pass   | schedule.py  | a reduce-scatter issued after the gathers due first |
| one_in_flight_pass            | schedule.py  | gloo only: each wait right after its collective |
| gathers_in_place_pass         | in_place.py  | each shard written into its slot of the output |
| reduces_in_place_pass         | in_place.py  | a reduce over one rank done in place          |
| reduce_where_summed_pass      | in_place.py  | a grad summed in fp32 reduced before rounding |

``timing.py`` sums the seconds spent in ``run_passes`` (compile-time accounting).
``install.py`` hands ``run_passes`` to Inductor (``post_grad_custom_post_pass``),
after any pass the user had set there; ``registry.py`` finds the settings of the root a
graph belongs to, and a graph with no root's collectives is returned untouched. All the
modules, one line each: the module map in docs/design.md.
"""

from __future__ import annotations

import torch.fx as fx

from fczero.comm import consistency
from fczero.passes import timing
from fczero.passes.all_reduce import bucket_all_reduces_pass
from fczero.passes.bucketing import bucket_all_gathers_pass, bucket_reduce_scatters_pass
from fczero.passes.graph_utils import one_recompile
from fczero.passes.in_place import (
    gathers_in_place_pass,
    reduce_where_summed_pass,
    reduces_in_place_pass,
)
from fczero.passes.registry import PassSettings, check_timeouts, settings_for_graph
from fczero.passes.schedule import (
    gathers_before_reduces_pass,
    one_in_flight_pass,
    prefetch_all_gathers_pass,
    sink_gathers_pass,
    sink_waits_pass,
)
from fczero.passes.touched_rows import look_up_touched_rows_pass, reduce_touched_rows_pass

__all__ = ["PassSettings", "run_passes"]


def run_passes(
    gm: fx.GraphModule, settings: PassSettings | None = None, *, recompile: bool = True
) -> fx.GraphModule:
    """Apply every fczero pass to ``gm`` (a post-grad forward or backward graph); the time
    it takes is added to ``timing.total()`` (read by ``bench.compile_time``). With
    ``recompile=False`` the graph is left for the caller to regenerate ``gm``'s code, as
    Inductor's post-grad hook does after its own passes ([Note: one recompile per graph])."""
    with timing.timed(), one_recompile(gm, at_end=recompile):
        return _run_passes(gm, settings)


def _run_passes(gm: fx.GraphModule, settings: PassSettings | None) -> fx.GraphModule:
    # check_policy: the same collectives everywhere
    consistency.check_graph(gm, check_timeouts(gm.graph))
    if settings is None:
        settings = settings_for_graph(gm.graph)
        if settings is None:
            return gm
    groups = settings.groups
    if settings.touched_rows:
        gm = look_up_touched_rows_pass(gm, groups, settings.rank)
        gm = reduce_touched_rows_pass(gm, groups, settings.rank)
    gm = sink_gathers_pass(gm, groups)
    if settings.bucket_bytes > 0:
        gm = bucket_all_gathers_pass(gm, groups, settings.bucket_bytes)
        gm = bucket_reduce_scatters_pass(
            gm, groups, settings.bucket_bytes, settings.param_itemsize
        )
        gm = bucket_all_reduces_pass(gm, groups | settings.replicate_groups, settings.bucket_bytes)
    gm = sink_waits_pass(gm, groups)
    gm = prefetch_all_gathers_pass(
        gm,
        groups,
        settings.prefetch,
        settings.memory_budget,
        settings.warned,
        bucket_bytes=settings.bucket_bytes,
    )
    gm = gathers_before_reduces_pass(gm, groups)
    gm = one_in_flight_pass(gm, groups | settings.replicate_groups)
    gm = gathers_in_place_pass(gm, groups, settings.rank)
    gm = reduces_in_place_pass(gm, groups)
    return reduce_where_summed_pass(gm, groups)
