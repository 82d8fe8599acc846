"""CUDA graphs (``torch.compile(mode="reduce-overhead")``): what fczero needs to know of them.

[Note: a grad kept across CUDA-graph runs]
Under CUDA graphs (Inductor's CUDA graph trees) the outputs of a compiled graph live in a
memory pool that the graphs share. When the next forward starts a new run of the graphs
(a new step, or the next micro-batch), the trees free every output of the previous run
that is still alive, and reading one afterwards raises "accessing tensor output of
CUDAGraphs that has been overwritten by a subsequent run". Autograd keeps such an output
on purpose: the first grad a leaf gets becomes its ``.grad`` (AccumulateGrad takes the
tensor itself instead of copying it). A param's grad is read by the optimizer before the
next forward, so that is harmless. An accumulator (``ParamState.acc``, gradient
accumulation under ``fczero.no_sync``) keeps its grad across micro-batches, and the next
micro-batch's backward adds to it after the trees freed it: the error, raised in that
backward (seen at stage 3 on one H100, torch 2.11; the copy below was checked against a
single process at stages 1 to 3).

So an accumulator on a CUDA device copies its first grad out of the pool, once per
accumulation, when CUDA graph trees have run on that device (``trees_in_use``); every
later micro-batch adds into that copy in place, as AccumulateGrad does for an existing
``.grad``. Without CUDA graphs nothing is copied. (Preallocating a zero ``.grad``, which
torch's own message suggests for params, costs a fill and an add where the copy costs
one read and one write.)

A param kept unsharded (selective unsharding, on by default) keeps one more tensor across
micro-batches: its gather, which the first micro-batch's graph returns and the later
ones take as an input (``ParamState.reused``). The same hook copies it out of the pool,
at the same moment (the first micro-batch's backward); without the copy the stage-3 case
failed its parity test on one H200 (torch 2.11) once the default kept every block.

[Note: tearing down after CUDA graphs]
A CUDA graph that captured a NCCL collective holds a reference on that collective's
communicator until the graph itself is freed, and NCCL's teardown waits for those
references to go. In NCCL 2.28's sources a captured collective becomes a persistent
plan (``comm->localPersistentRefs += nPlans``, ``enqueue.cc``) whose graph gets a
destructor that gives the reference back (``ncclCudaGraphAddDestructor``, a CUDA user
object), and ``commDestroySync`` (``init.cc``: "keep polling until all graphs
referencing us die") loops until none is left; ``ncclCommFinalize`` runs that loop, as
``ncclCommAbort`` does for a communicator not finalized. ``dist.destroy_process_group()``
calls ``pg_to_shutdown.shutdown()`` on every group (``torch/distributed/distributed_c10d.py``),
and ``ProcessGroupNCCL::shutdown`` finalizes each communicator and waits for it.
Inductor keeps its CUDA graphs in the CUDA graph trees, whose manager lives as long as
some compiled function made under them does, and Dynamo's compiled code outlives the
model: on 2 x H200 (torch 2.11, NCCL 2.28.9) the model was freed on return from the
function that trained it, the trees' manager was still there, and
``destroy_process_group`` still waited after 90 s. One rank captures nothing that needs
a peer, so a one-GPU run tears down either way; pytorch/pytorch#115388 reports the same
hang with graphs captured by hand.

torch gives no callback when a process group is destroyed, so fczero frees the graphs
(``release_graphs``: Dynamo's compiled code and the trees) at the two moments it can
see, for models parallelized over 2+ GPUs:

- when the last such model is freed (``release_with``: a finalizer on the root), so a
  script that trains in a function and destroys the process group after it returns
  needs nothing more. It skips the release while a compile or a compiled call is under
  way (the model freed inside one, or a graph running on another thread: releasing
  there would pull the trees from under it); the graphs then stay until exit.
- at interpreter exit (an ``atexit`` handler), before the interpreter tears the process
  groups down, for a script that never calls ``destroy_process_group``.

The remaining case: ``dist.destroy_process_group()`` while such a model is still
referenced (called in the function that holds it). Call ``torch.compiler.reset()``
first (torch's own: it drops Dynamo's compiled code and the CUDA graph trees on torch
2.11 and 2.13; it took ``destroy_process_group`` from a hang to 0.2 s on 2 x H200).
Either release drops every compiled function of the process, fczero's or not: the next
call of one compiles again.
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import sys
import threading
import weakref
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger("fczero")

_TREES = "torch._inductor.cudagraph_trees"

#: The models parallelized over 2+ GPUs that are still alive, held weakly: when the last
#: goes, Inductor's CUDA graphs go ([Note: tearing down after CUDA graphs]).
_PEERED_ROOTS: weakref.WeakSet[nn.Module] = weakref.WeakSet()

#: The modules whose frames mean a compile or a compiled call is under way: any of these
#: packages on the thread that frees the model; on another thread a compile, or a CUDA
#: graph being recorded or replayed (Inductor keeps threads of its own, idle in its pools).
_HERE = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch.autograd")
_ELSEWHERE = ("torch._dynamo.convert_frame", "torch._inductor.cudagraph_trees")


def trees_in_use(device: torch.device) -> bool:
    """Whether Inductor's CUDA graph trees have run on ``device`` (so a tensor there may
    live in their pool). Cheap: False at once off CUDA, or when they were never imported."""
    if device.type != "cuda":
        return False
    trees = sys.modules.get(_TREES)
    if trees is None:  # nothing compiled with CUDA graphs in this process
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return trees.get_manager(index, create_if_none_exists=False) is not None
    except (AssertionError, AttributeError, KeyError):
        # the trees keep their managers in thread-local state that autograd's threads
        # inherit; a thread without it (or another torch's layout) cannot tell: copy
        return True


def release_graphs() -> None:
    """Free every CUDA graph Inductor captured in this process, with the compiled code that
    replays them: what must happen before ``dist.destroy_process_group()`` after a run under
    CUDA graphs over 2+ GPUs ([Note: tearing down after CUDA graphs]; ``release_with``
    does it when the last such model is freed, and at exit). The next call of a compiled
    model compiles again."""
    torch._dynamo.reset()  # drops compiled code and shuts the CUDA graph trees down
    trees = sys.modules.get(_TREES)
    if trees is not None:  # (torch 2.13's reset does this too; the trees are what must go)
        trees.reset_cudagraph_trees()
    gc.collect()  # a graph held in a reference cycle goes now, not at some later collection


def release_with(model: nn.Module) -> None:
    """Free Inductor's CUDA graphs when ``model`` (parallelized over 2+ GPUs) is freed and
    no other such model is left, and at interpreter exit ([Note: tearing down after CUDA
    graphs])."""
    _PEERED_ROOTS.add(model)
    weakref.finalize(model, _root_freed).atexit = False  # (exit has its own handler)
    _release_at_exit()


@functools.cache
def _release_at_exit() -> None:
    """Register, once, the release at interpreter exit (``atexit`` runs it before the
    interpreter frees the process groups, whose teardown would wait for the graphs)."""
    atexit.register(_release_if_captured)


def _release_if_captured() -> None:
    if _any_trees():
        release_graphs()


def _root_freed() -> None:
    """A model parallelized over 2+ GPUs was freed: release the graphs if it was the last."""
    if any(True for _ in _PEERED_ROOTS) or not _any_trees():
        return  # another such model still runs its graphs, or none were captured
    if _compiler_running():
        logger.info(
            "fczero: the last model parallelized over several GPUs was freed inside a compile "
            "or a compiled call; its CUDA graphs stay until exit (call torch.compiler.reset() "
            "before dist.destroy_process_group(), which would wait for them)"
        )
        return
    release_graphs()


def _any_trees() -> bool:
    """Whether Inductor's CUDA graph trees have run on some GPU of this process."""
    if sys.modules.get(_TREES) is None or not torch.cuda.is_available():
        return False
    return any(trees_in_use(torch.device("cuda", i)) for i in range(torch.cuda.device_count()))


def _compiler_running() -> bool:
    """Whether a compile or a compiled call is under way (``_HERE``, ``_ELSEWHERE``): no
    moment to pull the graphs from under it."""
    here = threading.get_ident()
    for thread, frame in sys._current_frames().items():
        modules = _HERE if thread == here else _ELSEWHERE
        while frame is not None:
            if frame.f_globals.get("__name__", "").startswith(modules):
                return True
            frame = frame.f_back
    return False


def keep_first_grad_out_of_pool(
    accumulator: torch.Tensor, also: Callable[[], None] | None = None
) -> None:
    """Give ``accumulator`` (a leaf whose ``.grad`` sums micro-batches) a hook that copies
    its first grad out of the CUDA graphs' pool ([Note: a grad kept across CUDA-graph
    runs]); only on CUDA, where the pool exists. ``also`` runs at the same moment, when
    the copy is made: the owner's other tensors kept across micro-batches."""
    if accumulator.device.type == "cuda":
        accumulator.register_post_accumulate_grad_hook(_OwnFirstGrad(also))


class _OwnFirstGrad:
    """The hook: on its first call, replace a ``.grad`` that may live in the pool by a copy
    in ordinary memory; later calls find the copy, which AccumulateGrad added to in place.
    It holds no reference to the leaf (the leaf holds the hook)."""

    __slots__ = ("also", "done")

    def __init__(self, also: Callable[[], None] | None = None) -> None:
        self.done = False
        self.also = also

    def __call__(self, leaf: torch.Tensor) -> None:
        if self.done:
            return
        self.done = True
        grad = leaf.grad
        if grad is not None and trees_in_use(grad.device):
            leaf.grad = grad.clone()
            if self.also is not None:
                self.also()
