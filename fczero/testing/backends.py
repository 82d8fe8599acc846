"""Compile backends for tests: AOT autograd's graphs with fczero's passes, run eagerly.

``aot_eager_with_passes`` partitions like Inductor (min-cut, honouring the gather's
recompute tags, then fczero's activation offload when a model asks for it), applies
``fczero.passes.run_passes`` to the forward and backward graphs, and runs them without code generation: the passes' numerics on real gloo
ranks in seconds. ``recording(graphs)`` is the same backend, and also appends every
rewritten graph to the caller's ``graphs`` list (each test keeps its own).

``inductor-cudagraphs`` is stock Inductor with CUDA graphs (GPU tests).
"""

from __future__ import annotations

import torch.fx as fx
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from fczero.offload.partition import partition
from fczero.passes import run_passes


def recording(graphs: list[fx.GraphModule] | None = None, decompositions: dict | None = None):
    """AOT autograd with fczero's passes, run eagerly; each graph it rewrites (forward,
    then backward) is appended to ``graphs`` when given. ``decompositions``: ops that AOT
    autograd lowers as Inductor would before the passes see them (op -> decomposition)."""

    def compile_graph(gm: fx.GraphModule, example_inputs) -> object:
        gm = run_passes(gm)
        if graphs is not None:
            graphs.append(gm)
        return make_boxed_func(gm.forward)

    lowered = {"decompositions": decompositions} if decompositions else {}
    return aot_autograd(
        fw_compiler=compile_graph, bw_compiler=compile_graph, partition_fn=partition, **lowered
    )


aot_eager_with_passes = recording()


def inductor_cudagraphs(gm: fx.GraphModule, example_inputs) -> object:
    """Stock Inductor with CUDA graphs: what ``torch.compile(mode="reduce-overhead")`` runs
    (as a backend, so a compile counter can wrap it)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": True})


BACKENDS = {
    "aot_eager_with_passes": aot_eager_with_passes,
    "inductor-cudagraphs": inductor_cudagraphs,
}
