"""Eager mode: asynchronous gathers, and stage 3 (free after forward, gather again in backward)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import fczero
from fczero.comm import collectives
from fczero.runtime import resharding
from fczero.testing.comm import CollectiveLog
from fczero.testing.distributed import pending_collectives, run_on_ranks
from tests.cases import REGATHER
from tests.models import TwoLayer, UnevenTiedMLP


def test_eager_gather_is_async_collective_tensor(fake_pg):
    model = TwoLayer()
    fczero.parallelize(model, init_device_mesh("cpu", (2,)))
    w = model.fc1.weight
    assert isinstance(w, AsyncCollectiveTensor)
    assert w.shape == (16, 8)
    w.wait()


@pytest.mark.parametrize(("reshard", "regathers"), [(True, 1), (False, 0)])
def test_backward_gathers_again_only_when_resharding(fake_pg, reshard, regathers):
    model = TwoLayer()
    comm = REGATHER if reshard else fczero.CommPolicy()
    fczero.parallelize(
        model, init_device_mesh("cpu", (2,)), reshard_after_forward=reshard, comm_policy=comm
    )
    with CollectiveLog() as fwd:
        loss = model(torch.randn(3, 8)).sum()
    with CollectiveLog() as bwd:
        loss.backward()
    assert fwd.ops == ["all_gather_into_tensor"] * 3
    # backward needs fc2.weight (for the input grad of fc2); fc1's input needs no grad
    assert bwd.count("all_gather_into_tensor") == regathers
    assert bwd.count("reduce_scatter_tensor") == 3
    assert all(p.grad is not None for p in model.parameters())


def test_unsharded_params_are_freed_after_forward(fake_pg, monkeypatch):
    model = TwoLayer()
    fczero.parallelize(model, init_device_mesh("cpu", (2,)), comm_policy=REGATHER)
    refs = []
    original = resharding.ReshardScope.register

    def spy(self, full, spec, param):
        inner = full.elem if isinstance(full, AsyncCollectiveTensor) else full
        refs.append(StorageWeakRef(inner.untyped_storage()))
        original(self, full, spec, param)

    monkeypatch.setattr(resharding.ReshardScope, "register", spy)
    out = model(torch.randn(3, 8, requires_grad=True))  # the autograd graph is alive
    assert len(refs) == 3
    assert all(r.expired() for r in refs), "an unsharded param outlived forward"
    out.sum().backward()
    assert model.fc1._parameters["weight"].grad is not None


def _gloo_gather_state(rank: int, world_size: int) -> tuple[bool, int]:
    group = torch.distributed.group.WORLD.group_name
    full = collectives.all_gather(torch.ones(2, 3), world_size, group)
    pending = pending_collectives()
    return isinstance(full, AsyncCollectiveTensor), pending


def test_gloo_waits_for_each_eager_collective_when_issued():
    """[Note: one gloo collective in flight]: on gloo nothing is left in flight."""
    assert run_on_ranks(_gloo_gather_state, 2) == [(False, 0), (False, 0)]


def test_packing_makes_no_python_storage_per_saved_tensor(fake_pg):
    """The pack hook looks a saved tensor's storage up by its address
    (``torch._C._storage_id``) and makes no Python storage object for it: such an object
    would live as long as the storage, one more for the garbage collector to track per
    saved tensor per step (most of them activations)."""
    import gc

    model = fczero.parallelize(
        torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(6))),
        init_device_mesh("cpu", (2,)),
    )
    x = torch.randn(3, 8, requires_grad=True)
    model(x).sum().backward()  # (the first step records the gather order)

    def storages() -> int:
        gc.collect()
        return sum(type(o) is torch.UntypedStorage for o in gc.get_objects())

    before = storages()
    out = model(x)  # saves each block's input, its tanh output and its weight, until backward
    assert storages() - before <= 1
    out.sum().backward()


@torch.compiler.disable(recursive=False)
def _runs_eagerly_in_a_compiled_call(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run without Dynamo in this frame only, as a frame Dynamo gave up on runs: the calls
    it makes are still compiled."""
    return torch.relu(block.linear(x) * x)


class _PartlyEagerBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _runs_eagerly_in_a_compiled_call(self, x)


def test_dynamo_never_compiles_the_reshard_hooks(gloo_one_rank, monkeypatch):
    """Each block compiled, its body run eagerly inside the compiled call: the saved-tensor
    hooks of the root's eager forward are called there with Dynamo's frame hook active, and
    run as plain Python ([Note: Dynamo stays out of the hooks]); the grads are the plain
    model's."""
    from torch._dynamo import convert_frame

    compiled = []
    real_compile = convert_frame._compile

    def recording(code, *args, **kwargs):
        compiled.append(code.co_name)
        return real_compile(code, *args, **kwargs)

    monkeypatch.setattr(convert_frame, "_compile", recording)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(_PartlyEagerBlock(), _PartlyEagerBlock())
    model = torch.nn.Sequential(_PartlyEagerBlock(), _PartlyEagerBlock())
    model.load_state_dict(plain.state_dict())
    fczero.parallelize(model, init_device_mesh("cpu", (1,)))
    fczero.compile_blocks(model, backend="eager")
    x = torch.randn(4, 8)
    for _ in range(3):
        model(x).sum().backward()
        plain(x).sum().backward()
    assert compiled, "no block was compiled"
    assert not [name for name in compiled if "pack" in name], compiled
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


class _GatheredNumels(TorchDispatchMode):
    """The numels of each all-gather's inputs (a coalesced one: all of them), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name.startswith("all_gather_into_tensor"):
            inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.numels.append([t.numel() for t in inputs])
        return func(*args, **(kwargs or {}))


def _backward_gathers(model, x: torch.Tensor) -> list[list[int]]:
    loss = model(x).square().mean()
    with _GatheredNumels() as log:
        loss.backward()
    return log.numels


def test_a_units_regathers_do_not_depend_on_which_gathers_are_still_alive(fake_pg, monkeypatch):
    """[Note: decided by structure]: a unit's params are listed for backward at the first
    save of any of them, alive or not. ``back`` saves ``inp``'s tied weight after ``inp``'s
    unit ended; a reference to ``inp``'s gathered bias held past the unit (as gloo's worker
    thread may hold a finished gather's output for a moment, on one rank and not another)
    must not change backward's regathers."""
    model = fczero.parallelize(UnevenTiedMLP(), init_device_mesh("cpu", (2,)), comm_policy=REGATHER)
    x = torch.randn(6, 5)
    plain = _backward_gathers(model, x)
    stash: list[torch.Tensor] = []
    register = resharding.ReshardScope.register

    def holding(self, full, spec, param):
        if full.shape == (13,):  # inp's bias, the only 1-d param of 13
            stash.append(full)
        register(self, full, spec, param)

    monkeypatch.setattr(resharding.ReshardScope, "register", holding)
    held = _backward_gathers(model, x)
    assert len(stash) == 1
    assert held == plain == [[35, 7], [21, 3], [28], [52, 4]]  # (shard numels)


def test_a_regather_is_reused_only_inside_the_node_that_made_it(fake_pg, monkeypatch):
    """[Note: decided by structure]: a weight read once and used by two matmuls is saved
    by both nodes and regathered for each. Holding the first regather alive (as a process
    group's thread may) must not make the second node reuse it."""

    class TwiceUsed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.weight  # one gather, saved by both matmuls
            return torch.tanh(x @ w) @ w

    options = dict(comm_policy=REGATHER, units=None)
    model = fczero.parallelize(TwiceUsed(), init_device_mesh("cpu", (2,)), **options)
    x = torch.randn(4, 8, requires_grad=True)
    plain = _backward_gathers(model, x)
    stash: list[torch.Tensor] = []
    finish = resharding.ReshardScope._finish

    def holding(entry, pending):
        full = finish(entry, pending)
        stash.append(full)
        return full

    monkeypatch.setattr(resharding.ReshardScope, "_finish", staticmethod(holding))
    held = _backward_gathers(model, x)
    assert len(stash) == 2  # one regather per node
    assert held == plain == [[32], [32]]
