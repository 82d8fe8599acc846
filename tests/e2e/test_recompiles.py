"""Recompiles of a compiled fczero model when the batch shape changes.

A smaller last batch, or a sequence length that changes once, must cost one more graph
and then none: Dynamo's automatic dynamic shapes compile the second shape with symbolic
sizes, and that graph (or the first, static one) serves every later step; with
``dynamic=False`` each shape compiles once and stays in Dynamo's cache. fczero adds no
guard that fails step after step: a compiled step is three frames (fczero's root
pre-forward hook, the model's forward, the root post-forward hook; only the forward has
a graph), and a new shape recompiles the first two once. Counted with
``torch._dynamo.utils.counters``, as ``bench.soak`` counts them (as differences: the
counters are the process's, not reset between tests).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing.backends import aot_eager_with_passes
from tests.models import tiny_llama

A, SHORT_BATCH, LONGER = (8, 16), (3, 16), (8, 24)  # (batch, seq) per step


class _Loss(nn.Module):
    """``forward(tokens)`` is the model's loss: the whole step's forward in one frame."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: (B, T+1)
        return self.model.loss(tokens)


def _compiles_per_step(
    shapes: list[tuple[int, int]], backend: object, dynamic: bool | None = None
) -> tuple[list[int], list[int]]:
    """Train a parallelized tiny Llama, compiled whole, one step per shape; the graphs and
    the frames Dynamo has compiled after each step."""
    torch.manual_seed(0)
    root = _Loss(tiny_llama())
    fczero.parallelize(root, init_device_mesh("cpu", (2,)))
    step = torch.compile(root, backend=backend, dynamic=dynamic)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-3)
    counters = torch._dynamo.utils.counters  # this process's: counted from here on
    graphs_before, frames_before = counters["stats"]["unique_graphs"], counters["frames"]["ok"]
    graphs, frames = [], []
    gen = torch.Generator().manual_seed(1)
    for batch, seq in shapes:
        step(torch.randint(0, 64, (batch, seq + 1), generator=gen)).backward()
        opt.step()
        opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"] - graphs_before)
        frames.append(counters["frames"]["ok"] - frames_before)
    return graphs, frames


def test_smaller_last_batch_compiles_one_more_graph_then_none(fake_pg):
    # two epochs of 3 full batches and a short last one
    graphs, frames = _compiles_per_step([A, A, A, SHORT_BATCH] * 2, aot_eager_with_passes)
    assert graphs == [1, 1, 1, 2, 2, 2, 2, 2], graphs
    assert frames[3:] == [frames[3]] * 5, f"frames compiled again after the short batch: {frames}"


def test_changed_sequence_length_compiles_one_more_graph_then_none(fake_pg):
    graphs, frames = _compiles_per_step([A, A, LONGER, LONGER, A, LONGER], aot_eager_with_passes)
    assert graphs == [1, 1, 2, 2, 2, 2], graphs
    assert frames[2:] == [frames[2]] * 4, f"frames compiled again after the new length: {frames}"


def test_static_shapes_compile_each_shape_once(fake_pg):
    # dynamic=False: one graph per shape (A, a short batch, a longer sequence), kept in
    # Dynamo's cache, so a shape seen before compiles nothing
    shapes = [A, SHORT_BATCH, LONGER, A, SHORT_BATCH, LONGER]
    graphs, frames = _compiles_per_step(shapes, "aot_eager", dynamic=False)
    assert graphs == [1, 2, 3, 3, 3, 3], graphs
    assert frames[3:] == [frames[2]] * 3, frames
