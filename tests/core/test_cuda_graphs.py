"""fczero/core/cuda_graphs.py: an accumulator's first grad leaves the CUDA graphs' pool, and
``release_graphs`` frees what Inductor captured before a process group is torn down: when
the last model parallelized over several GPUs is freed, and at exit (on GPUs, the
teardown itself: tests/e2e/test_teardown_gpu.py).

The CUDA side (gradient accumulation under ``mode="reduce-overhead"`` against a single
process) is ``tests/runtime/test_accumulation.py::test_nccl_accumulation_matches_one_large_batch``;
here the hook's own logic on the CPU, with the pool check stood in for."""

from __future__ import annotations

import gc
import sys
import types
import weakref

import pytest
import torch
from torch import nn

from fczero.core import cuda_graphs
from fczero.core.cuda_graphs import (
    _OwnFirstGrad,
    keep_first_grad_out_of_pool,
    release_graphs,
    release_with,
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


@pytest.fixture
def releases(monkeypatch) -> types.SimpleNamespace:
    """What ``release_with`` does, with CUDA graph trees in use as on a GPU: ``released``
    (one entry per release) and ``exit_handlers`` (captured instead of registered)."""
    seen = types.SimpleNamespace(released=[], exit_handlers=[])
    monkeypatch.setattr(cuda_graphs, "_PEERED_ROOTS", weakref.WeakSet())
    monkeypatch.setattr(cuda_graphs, "_any_trees", lambda: True)
    monkeypatch.setattr(cuda_graphs, "release_graphs", lambda: seen.released.append(True))
    monkeypatch.setattr(cuda_graphs.atexit, "register", seen.exit_handlers.append)
    cuda_graphs._release_at_exit.cache_clear()
    yield seen
    cuda_graphs._release_at_exit.cache_clear()  # (the real handler registers on next use)


def test_the_graphs_go_with_the_last_model_parallelized_over_gpus(releases):
    """[Note: tearing down after CUDA graphs]: freeing one of two such models keeps the
    graphs (the other still replays them); freeing the last releases them, once."""
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    release_with(first)
    release_with(second)
    del first
    gc.collect()
    assert releases.released == []
    del second
    assert releases.released == [True]  # freed by reference count: at once


def test_no_release_while_a_compile_or_compiled_call_runs(releases, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "_compiler_running", lambda: True)
    model = nn.Linear(2, 2)
    release_with(model)
    del model
    assert releases.released == []  # left for exit (or torch.compiler.reset())


def test_a_compiled_call_under_way_is_seen_from_the_stack():
    """A frame of Dynamo, Inductor, AOT autograd or autograd on this thread's stack is a
    compile or compiled call under way; pytest's own stack holds none."""
    assert not cuda_graphs._compiler_running()
    inside = {"__name__": "torch._inductor.cudagraph_trees", "check": cuda_graphs._compiler_running}
    in_inductor = types.FunctionType((lambda: check()).__code__, inside)  # noqa: F821
    assert in_inductor() is True


def test_exit_releases_the_graphs_a_model_left(releases, monkeypatch):
    """One exit handler for all such models; at exit it releases whatever graphs are left,
    and nothing where none were captured."""
    models = [nn.Linear(2, 2), nn.Linear(2, 2)]
    for model in models:
        release_with(model)
    (handler,) = releases.exit_handlers
    handler()
    assert releases.released == [True]
    monkeypatch.setattr(cuda_graphs, "_any_trees", lambda: False)
    handler()
    assert releases.released == [True]


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
