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
        # Inductor regenerates the module's code once its post-grad passes are done
        run_passes(graph.owning_module, recompile=False)

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


def code_hash(*folders: Path) -> bytes:
    """A hash of the code behind a graph hook: the modules of ``folders`` and the shared
    ones (part of its ``uuid``, so Inductor's FX graph cache misses when that code changes)."""
    package = Path(__file__).parent.parent
    files = sorted(str(p) for folder in folders for p in folder.glob("*.py"))
    files += [str(package / name) for name in _SHARED_SOURCES]
    return get_hash_for_files(tuple(files))


def install() -> None:
    """Put fczero's passes into Inductor's post-grad hook once, keeping the user's passes."""
    current = inductor_config.post_grad_custom_post_pass
    if isinstance(current, FczeroPostGradPass):
        return
    inductor_config.post_grad_custom_post_pass = FczeroPostGradPass(_as_list(current))
    inductor_config.reorder_for_peak_memory = False
    logger.info(
        "installed fczero's passes in torch._inductor.config.post_grad_custom_post_pass "
        "and set reorder_for_peak_memory=False (it would undo prefetching)"
    )


#: The gather Dynamo leaves as one call ([Note: Dynamo calls the gather, AOT autograd
#: traces it] in ``fczero/comm/collectives.py``), by the name AOT autograd's cache reads.
GATHER_FUNCTION = "fczero.comm.collectives.gather_shard"


def cache_fczero_graphs() -> None:
    """Let the compile caches keep fczero's graphs across restarts, and say what changed.

    [Note: AOT autograd's cache and the gather]
    A compiled graph from Dynamo holds fczero's gather as a call of ``gather_shard``, an
    ``autograd.Function`` (all-gather forward, reduce-scatter in the reduce dtype backward)
    that AOT autograd traces. Its cache refuses a graph that calls a function it does not
    know, so a restart of a job paid AOT autograd's whole trace and partition again, while
    plain models skipped it. fczero names ``gather_shard`` in
    ``torch._inductor.config.unsafe_marked_cacheable_functions``, with a hash of the module
    that defines it as its version: the version is part of the cache key, so a changed
    gather misses. It also sets
    ``torch._functorch.config.autograd_cache_allow_custom_autograd_functions``, which the
    cache asks for any ``autograd.Function`` Dynamo traces into a graph (fczero's others
    that compiled graphs hold: the host-to-device copy of offloaded params, and stages 1
    and 2's whole params). Set that back to ``False`` after ``parallelize`` if an
    ``autograd.Function`` of yours must not be cached."""
    changed = []
    gather_source = Path(__file__).parent.parent / "comm" / "collectives.py"
    wanted = {GATHER_FUNCTION: code_hash_of(gather_source)}
    replay = _rng_replay_not_cacheable()
    if replay is not None:
        wanted[replay] = torch.__version__
    marked = inductor_config.unsafe_marked_cacheable_functions
    new = {name: v for name, v in wanted.items() if marked.get(name) != v}
    if new:
        inductor_config.unsafe_marked_cacheable_functions = {**marked, **new}
        changed.append(f"marked {', '.join(new)} cacheable in unsafe_marked_cacheable_functions")
    config = torch._functorch.config
    if not getattr(config, "autograd_cache_allow_custom_autograd_functions", True):
        config.autograd_cache_allow_custom_autograd_functions = True
        changed.append("set autograd_cache_allow_custom_autograd_functions=True")
    if changed:
        logger.info(
            "fczero: %s, so a restarted job takes fczero's graphs from the compile caches",
            " and ".join(changed),
        )


def _rng_replay_not_cacheable() -> str | None:
    """The name of torch's graph-safe RNG replay where torch does not call it cacheable.

    [Note: a checkpointed graph's RNG replay and the FX graph cache]
    When backward recomputes an op that draws random numbers (on a GPU: flash attention,
    even at dropout 0), the partitioner wraps it in ``graphsafe_run_with_rng_state`` so
    the recompute replays the forward's random state. Torch 2.11 does not mark that
    operator cacheable, so Inductor's FX graph cache bypassed every such graph ("Can't
    cache HigherOrderOperator: graphsafe_run_with_rng_state"): a restart of Hugging Face's
    checkpointed Llama-3B over 2 H200s compiled everything again (108 s warm, 110 s cold).
    Torch 2.13 marks it cacheable itself; before that, naming it in
    ``unsafe_marked_cacheable_functions`` (keyed by the torch version) does the same."""
    try:
        from torch._prims.rng_prims import graphsafe_run_with_rng_state as replay
    except ImportError:
        return None
    return None if replay.cacheable() else f"{replay.__module__}.{replay.__name__}"


def code_hash_of(path: Path) -> str:
    """A hash of one source file, as a string (a version in an Inductor option)."""
    return get_hash_for_files((str(path),)).hex()


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


__all__ = [
    "FczeroPostGradPass",
    "GATHER_FUNCTION",
    "cache_fczero_graphs",
    "code_hash",
    "install",
    "keep_region_inputs",
]
