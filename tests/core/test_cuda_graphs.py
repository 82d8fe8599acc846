"""fczero/core/cuda_graphs.py: an accumulator's first grad leaves the CUDA graphs' pool, and
``release_graphs`` frees what Inductor captured before a process group is torn down.

The CUDA side (gradient accumulation under ``mode="reduce-overhead"`` against a single
process) is ``tests/runtime/test_accumulation.py::test_nccl_accumulation_matches_one_large_batch``;
here the hook's own logic on the CPU, with the pool check stood in for."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from fczero.core import cuda_graphs
from fczero.core.cuda_graphs import (
    _OwnFirstGrad,
    keep_first_grad_out_of_pool,
    release_graphs,
    trees_in_use,
)


def _accumulate(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    """What backward does to a leaf: AccumulateGrad, then its post-accumulate hooks."""
    (leaf * grad).sum().backward()


@pytest.mark.parametrize("in_pool", [True, False])
def test_the_first_grad_is_copied_only_where_the_pool_may_hold_it(monkeypatch, in_pool):
    monkeypatch.setattr(cuda_graphs, "trees_in_use", lambda device: in_pool)
    leaf = torch.zeros(3).expand(2, 3).detach().requires_grad_(True)  # as ParamState.acc
    produced = []  # what AccumulateGrad put on the leaf (hooks run in registration order)
    leaf.register_post_accumulate_grad_hook(lambda t: produced.append(t.grad))
    leaf.register_post_accumulate_grad_hook(_OwnFirstGrad())
    first = torch.arange(6.0).view(2, 3)
    _accumulate(leaf, first)
    kept = leaf.grad
    assert torch.equal(kept, first)
    assert (kept is not produced[0]) is in_pool  # a copy only where the pool may hold it
    second = torch.ones(2, 3)
    _accumulate(leaf, second)
    assert leaf.grad is kept  # later micro-batches add in place, and are never copied
    assert torch.equal(leaf.grad, first + second)


def test_a_copied_grad_shares_no_storage_with_what_backward_produced(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "trees_in_use", lambda device: True)
    leaf = torch.zeros(4, requires_grad=True)
    hook = _OwnFirstGrad()
    produced = torch.full((4,), 2.0)
    leaf.grad = produced  # as AccumulateGrad leaves it: the produced tensor itself
    hook(leaf)
    assert torch.equal(leaf.grad, produced)
    assert leaf.grad.untyped_storage().data_ptr() != produced.untyped_storage().data_ptr()
    copy = leaf.grad
    hook(leaf)  # once per accumulation: a second call leaves the copy alone
    assert leaf.grad is copy


def test_without_the_pool_the_produced_grad_is_kept(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "trees_in_use", lambda device: False)
    leaf = torch.zeros(4, requires_grad=True)
    produced = torch.full((4,), 2.0)
    leaf.grad = produced
    _OwnFirstGrad()(leaf)
    assert leaf.grad is produced  # nothing copied off CUDA graphs


@pytest.mark.parametrize("in_pool", [True, False])
def test_the_owners_other_tensors_go_with_the_first_copy(monkeypatch, in_pool):
    monkeypatch.setattr(cuda_graphs, "trees_in_use", lambda device: in_pool)
    calls = []
    hook = _OwnFirstGrad(lambda: calls.append("also"))
    leaf = torch.zeros(4, requires_grad=True)
    leaf.grad = torch.ones(4)
    hook(leaf)
    hook(leaf)  # once per accumulation
    assert calls == (["also"] if in_pool else [])


def test_a_kept_params_reused_gather_is_copied_out(fake_pg):
    """The ``also`` of a param state: its reused gather (the first micro-batch's graph
    output) is replaced by a copy of its own, and the state's traced key still says the
    reused path; a state that is gone is left alone."""
    import weakref

    from torch.distributed.device_mesh import init_device_mesh

    import fczero
    from fczero.core.state import _reused_out_of_pool
    from tests.models import TwoLayer

    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)))
    state = model.fc2._fczero.params["weight"]  # kept by the default (the last module)
    assert state.spec.keep_unsharded
    gathered = torch.randn(state.spec.shape)
    state.reused = gathered
    _reused_out_of_pool(weakref.ref(state))
    assert torch.equal(state.reused, gathered) and state.reused is not gathered
    assert state.reused.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr()
    assert state.traced is None  # the reused path, until the synced micro-batch drops it
    dead = weakref.ref(torch.zeros(1))  # the temporary is gone at once: a state that is gone
    assert dead() is None
    _reused_out_of_pool(dead)


def test_only_cuda_accumulators_get_the_hook():
    leaf = torch.zeros(3, requires_grad=True)
    keep_first_grad_out_of_pool(leaf)
    assert not leaf._post_accumulate_grad_hooks  # the CPU has no graph pool


def test_trees_in_use_is_false_off_cuda_and_before_any_cuda_graph(monkeypatch):
    assert not trees_in_use(torch.device("cpu"))
    monkeypatch.delitem(sys.modules, cuda_graphs._TREES, raising=False)
    assert not trees_in_use(torch.device("cuda", 0))  # never imported: never ran


@pytest.mark.parametrize("manager, expected", [(None, False), (object(), True)])
def test_trees_in_use_asks_the_device_s_tree_manager(monkeypatch, manager, expected):
    asked = []

    def get_manager(index, create_if_none_exists=True):
        asked.append((index, create_if_none_exists))
        return manager

    monkeypatch.setitem(
        sys.modules, cuda_graphs._TREES, types.SimpleNamespace(get_manager=get_manager)
    )
    assert trees_in_use(torch.device("cuda", 1)) is expected
    assert asked == [(1, False)]  # never creates one


def test_trees_in_use_copies_when_it_cannot_tell(monkeypatch):
    def get_manager(index, create_if_none_exists=True):
        raise AssertionError("no tree manager state in this thread")

    monkeypatch.setitem(
        sys.modules, cuda_graphs._TREES, types.SimpleNamespace(get_manager=get_manager)
    )
    assert trees_in_use(torch.device("cuda", 0))


def test_release_graphs_drops_compiled_code_and_the_trees(monkeypatch):
    """After ``release_graphs`` a compiled function compiles again (its code, which holds
    the graphs, is gone), and the CUDA graph trees were shut down."""
    reset = []
    monkeypatch.setitem(
        sys.modules,
        cuda_graphs._TREES,
        types.SimpleNamespace(reset_cudagraph_trees=lambda: reset.append(True)),
    )
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    fn = torch.compile(lambda x: x * 2 + 1, backend=backend)
    fn(torch.ones(3))
    fn(torch.ones(3))
    assert len(compiles) == 1
    release_graphs()
    assert reset  # the trees, even where Dynamo's reset would not reach them
    fn(torch.ones(3))
    assert len(compiles) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_graphs_frees_the_captured_graphs():
    """On a GPU: a model run under CUDA graphs leaves a tree manager behind, and
    ``release_graphs`` removes it (what lets NCCL tear its communicators down)."""
    from torch._inductor import cudagraph_trees

    model = torch.nn.Linear(8, 8, device="cuda")
    step = torch.compile(model, mode="reduce-overhead")
    for _ in range(3):  # forward and backward each captured (the third run replays)
        torch.compiler.cudagraph_mark_step_begin()
        step(torch.ones(4, 8, device="cuda")).sum().backward()
        model.zero_grad(set_to_none=True)  # (a grad kept across runs would be overwritten)
    index = torch.cuda.current_device()
    assert cudagraph_trees.get_manager(index, create_if_none_exists=False) is not None
    release_graphs()
    assert cudagraph_trees.get_manager(index, create_if_none_exists=False) is None
