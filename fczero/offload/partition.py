"""The partitioner hook: split forward from backward as usual, then offload activations.

Only the partitioner sees both graphs and knows which forward outputs are saved for
backward, so activation offload runs here rather than among the post-grad passes.
``partition`` wraps the min-cut partitioner (or the one the user had set) and leaves
graphs whose root asked for no offload as they are (it only records their planned peak
for ``memory_report``, with their root's pass settings). ``install`` hands it to
Inductor through ``torch._inductor.config.custom_partitioner_fn``; the test backend
``fczero.testing.backends.aot_eager_with_passes`` uses it directly.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor import config as inductor_config

from fczero.core import streams
from fczero.offload.activations import offload_activations
from fczero.passes import registry
from fczero.passes.install import code_hash
from fczero.passes.regions import reroute_region_views_pass
from fczero.passes.size_only_gathers import drop_size_only_gathers

logger = logging.getLogger("fczero")


def partition(gm: fx.GraphModule, joint_inputs, *, base=None, **kwargs):
    """Partition ``gm`` with ``base`` (min-cut by default), then offload activations."""
    base = base or min_cut_rematerialization_partition
    if registry.settings_for_graph(gm.graph) is not None:  # (REUSE_BLOCKS's regions only)
        gm = reroute_region_views_pass(gm)
    fw, bw = base(gm, joint_inputs, **kwargs)
    settings = registry.settings_for_graph(fw.graph)
    if settings is None:
        return fw, bw  # not a graph of fczero's
    drop_size_only_gathers(bw)  # ([Note: a gather read for its size])
    plan = offload_activations(
        fw,
        bw,
        kwargs["num_fwd_outputs"],
        mode=settings.activation_offload,
        min_bytes=settings.offload_min_bytes,
        budget=settings.memory_budget,
    )
    settings.plans.append(plan)  # (the root's own list: memory_report shows it)
    if inductor_config.triton.cudagraphs:  # torch.compile(mode="reduce-overhead")
        _warn_uncapturable(settings, plan)
    if plan.offloaded and plan.device_type == "cpu" and settings.first_time("activations-cpu"):
        streams.warn(
            "fczero: OffloadPolicy.activations on a CPU graph: activations are copied between host "
            "buffers (the graph runs as with offload) and no memory is saved."
        )
    return fw, bw


# [Note: offload under CUDA graphs]
# A CUDA graph replays kernels, not Python: offload's copies run on a side stream that a
# Python table of events orders (``fczero.core.streams``) or copy grads into host memory,
# and capturing them fails ("capturing stream has unjoined work", "operation not permitted
# when stream is capturing": one H100, torch 2.11, before these ops were tagged). So the
# ops are tagged ``cudagraph_unsafe`` (``streams.UNCAPTURABLE``): Inductor then runs them
# outside the graphs it captures, splitting a graph around them (graph partitioning, its
# default; seen on the H100), or, with partitioning off, captures none of that graph (as
# Inductor's code reads; not run). Either way the step is slower than a fully captured
# one, so fczero says so once, as a warning, when it partitions a graph that holds them
# with CUDA graphs asked for. Which graphs do is known here: the activation plan (on a
# GPU) and the group's parameter offload.
def _warn_uncapturable(settings: registry.PassSettings, plan) -> None:
    features = []
    if plan.offloaded and plan.device_type == "cuda":
        features.append("activation offload (OffloadPolicy.activations)")
    if settings.param_offload:
        features.append("parameter offload (OffloadPolicy.params)")
    if not features or not settings.first_time("cuda-graphs"):
        return
    streams.warn(
        f"fczero: torch.compile(mode='reduce-overhead') cannot capture {' and '.join(features)}: "
        "its copies run on a side stream or into host memory, so Inductor runs them outside "
        "the CUDA graphs and captures the rest of each graph around them (offloading as "
        "asked). For whole graphs under CUDA graphs, turn the offload off "
        '(docs/troubleshooting.md, "Offload under CUDA graphs").'
    )


try:  # torch 2.11 and 2.13 both have it; guard anyway for clear failure
    from torch._inductor.custom_graph_pass import CustomPartitionerFn
except ImportError:  # pragma: no cover - older torch
    CustomPartitionerFn = None


if CustomPartitionerFn is not None:

    class FczeroPartitioner(CustomPartitionerFn):
        """Inductor's partitioner hook: the user's partitioner (or min-cut), then offload."""

        def __init__(self, before) -> None:
            self.before = before

        def __call__(self, gm, joint_inputs, **kwargs):
            return partition(gm, joint_inputs, base=self.before, **kwargs)

        def uuid(self):
            parts = b""
            if self.before is not None:
                uuid = self.before.uuid()
                if uuid is None:
                    return None
                parts = repr(uuid).encode()
            # this folder's code and the passes' (it runs two of their rewrites itself)
            code = code_hash(Path(__file__).parent, Path(registry.__file__).parent)
            return hashlib.sha256(code + parts + repr(registry.snapshot()).encode()).digest()


def install(required: bool) -> None:
    """Set Inductor's partitioner hook to fczero's (keeping the user's as its base), once.

    Without activation offload the hook changes no graph (it records planned peaks for
    ``memory_report``); where this torch lacks the hook it is then skipped quietly,
    while ``required`` (offload asked for) makes that an error."""
    if CustomPartitionerFn is None or not hasattr(inductor_config, "custom_partitioner_fn"):
        if not required:
            return
        raise RuntimeError(
            "fczero: OffloadPolicy.activations needs torch._inductor.config.custom_partitioner_fn "
            f"(torch 2.11 or newer); this torch is {__import__('torch').__version__}. "
            "Upgrade torch or use OffloadPolicy(activations='off')."
        )
    current = inductor_config.custom_partitioner_fn
    if isinstance(current, FczeroPartitioner):
        return
    inductor_config.custom_partitioner_fn = FczeroPartitioner(current)
    logger.info("installed fczero's partitioner (activation offload) in Inductor")
