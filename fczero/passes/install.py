"""Hand fczero's passes to stock Inductor through its documented hook.

``torch._inductor.config.post_grad_custom_post_pass`` takes one pass on torch 2.11
and a pass or a list on 2.13. ``install`` wraps whatever the user had set and
fczero's passes into one ``CustomGraphPass`` that runs the user's pass first, then
fczero's; its ``uuid`` covers both (and fczero's settings), so Inductor's FX graph
cache stays on when the user's pass has a uuid too.

It also turns off ``torch._inductor.config.reorder_for_peak_memory``: that scheduler
pass moves every all-gather down to just before its wait (the order with the least
memory), which undoes prefetching. fczero's own schedule keeps memory within its
budget instead. Set it back after ``parallelize`` to trade overlap for memory.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
import torch._functorch.config
import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from fczero.passes import registry, run_passes

logger = logging.getLogger("fczero")


def _as_list(passes) -> list:
    if passes is None:
        return []
    return list(passes) if isinstance(passes, (list, tuple)) else [passes]


class FczeroPostGradPass(CustomGraphPass):
    """The user's earlier post-grad passes, then fczero's (see ``fczero.passes``)."""

    def __init__(self, before: list) -> None:
        self.before = before

    def __call__(self, graph: fx.Graph) -> None:
        for user_pass in self.before:
            user_pass(graph)
        run_passes(graph.owning_module)

    def uuid(self) -> bytes | None:
        parts = []
        for user_pass in self.before:
            uuid = user_pass.uuid() if isinstance(user_pass, CustomGraphPass) else None
            if uuid is None:
                return None  # the user's pass cannot be cached: neither can the chain
            parts.append(repr(uuid))
        extra = "|".join(parts) + repr(registry.snapshot())
        return hashlib.sha256(code_hash(Path(__file__).parent) + extra.encode()).digest()


#: Modules outside a pass folder whose code decides what the passes do.
_SHARED_SOURCES = ("comm/graph_ops.py", "core/memory.py")


def code_hash(folder: Path) -> bytes:
    """A hash of the code behind a graph hook: ``folder``'s modules and the shared ones
    (part of its ``uuid``, so Inductor's FX graph cache misses when that code changes)."""
    package = Path(__file__).parent.parent
    files = sorted(str(p) for p in folder.glob("*.py"))
    files += [str(package / name) for name in _SHARED_SOURCES]
    return get_hash_for_files(tuple(files))


def install() -> None:
    """Put fczero's passes into Inductor's post-grad hook once, keeping the user's passes."""
    current = inductor_config.post_grad_custom_post_pass
    if isinstance(current, FczeroPostGradPass):
        return
    inductor_config.post_grad_custom_post_pass = FczeroPostGradPass(_as_list(current))
    inductor_config.reorder_for_peak_memory = False
    caches = _let_aot_autograd_cache_fczero_graphs()
    logger.info(
        "installed fczero's passes in torch._inductor.config.post_grad_custom_post_pass "
        "and set reorder_for_peak_memory=False (it would undo prefetching)%s",
        caches,
    )


def _let_aot_autograd_cache_fczero_graphs() -> str:
    """Let AOT autograd's cache keep graphs that hold fczero's gather, and say so.

    [Note: AOT autograd's cache and the gather]
    A compiled gather is an ``autograd.Function`` (all-gather forward, reduce-scatter in
    the reduce dtype backward: ``fczero.comm.collectives``), which Dynamo traces into the
    graph, forward and backward bodies included. AOT autograd's cache refuses any graph
    holding a custom ``autograd.Function`` unless
    ``torch._functorch.config.autograd_cache_allow_custom_autograd_functions`` is set, so a
    restart of a job paid AOT autograd's whole trace and partition again, while plain
    models skipped it (Inductor's FX graph cache still hit). The traced bodies are part of
    the graph the cache keys on. fczero sets the flag; set it back to ``False`` after
    ``parallelize`` if a custom ``autograd.Function`` of yours must not be cached."""
    config = torch._functorch.config
    if not hasattr(config, "autograd_cache_allow_custom_autograd_functions"):
        return ""
    if config.autograd_cache_allow_custom_autograd_functions:
        return ""
    config.autograd_cache_allow_custom_autograd_functions = True
    return (
        ", and set torch._functorch.config.autograd_cache_allow_custom_autograd_functions="
        "True (AOT autograd's cache would refuse graphs holding fczero's gather)"
    )


def keep_region_inputs() -> None:
    """Turn off AOT autograd's donated buffers once, and say so (block regions need it).

    [Note: a region's backward must not write over its inputs]
    Inductor lowers the backward of a ``nested_compile_region`` (an ``invoke_subgraph``
    call) as a subgraph of the outer backward, and the subgraph takes the outer graph's
    list of donated inputs by position (torch 2.11 and 2.13: ``get_donated_idxs`` reads
    the tracing context, which holds the outer graph's). So a region input that sits at a
    donated position, such as the incoming grad, is treated as the region's own to write
    over: the region returns its input grad in that very buffer, while the outer graph,
    which still owns the buffer, hands it to the next op as free memory. With three
    blocks and an embedding, the embedding's grad was built in the buffer of the grad it
    reads, and came out wrong (2 ranks and one process agree without regions, on both
    torch versions). Without donated buffers no input is written over; the cost is that
    backward cannot reuse a saved tensor's memory in place."""
    config = torch._functorch.config
    if not getattr(config, "donated_buffer", False):
        return
    config.donated_buffer = False
    logger.info(
        "fczero: set torch._functorch.config.donated_buffer=False: Inductor would let a "
        "compiled block region write over inputs its caller still reads "
        "([Note: a region's backward must not write over its inputs])"
    )


__all__ = ["FczeroPostGradPass", "code_hash", "install", "keep_region_inputs"]
