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
communicator until the graph itself is freed, and NCCL's communicator teardown waits for
those references to go. So ``dist.destroy_process_group()`` called while Inductor still
holds the graphs of a run over 2+ GPUs never returns (seen on 2 x H200, torch 2.11: both
ranks trained, then hung in ``destroy_process_group``; pytorch/pytorch#115388 reports
the same with hand-captured graphs). ``release_graphs`` frees them first; call it (or
``torch._dynamo.reset()``, which it wraps) before destroying the process group. One rank
captures nothing that needs a peer, so a one-GPU run tears down either way.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import torch

_TREES = "torch._inductor.cudagraph_trees"


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
    CUDA graphs over 2+ GPUs ([Note: tearing down after CUDA graphs]). The next call of a
    compiled model compiles again."""
    torch._dynamo.reset()  # drops compiled code and shuts the CUDA graph trees down
    trees = sys.modules.get(_TREES)
    if trees is not None:  # (torch 2.13's reset does this too; the trees are what must go)
        trees.reset_cudagraph_trees()
    gc.collect()  # a graph held in a reference cycle goes now, not at some later collection


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
