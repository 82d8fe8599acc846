"""fczero's state: one ``_fczero`` attribute per module, model and optimizer, and the
records behind it point at the right params."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.backends.debugging import aot_eager
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fczero
from fczero.core.state import ModuleState, ParamState, module_state, optimizer_state, root_state
from tests.models import ThreeBlocks, UnevenTiedMLP


def _fczero_names(obj: object) -> set[str]:
    return {k for k in vars(obj) if k.startswith("_fczero")}


def test_one_attribute_on_modules_and_optimizers(fake_pg):
    model = fczero.parallelize(UnevenTiedMLP(), init_device_mesh("cpu", (2,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    names = set().union(*(_fczero_names(m) for m in model.modules()), _fczero_names(opt))
    assert names == {"_fczero"}
    assert not any(k.startswith("_fczero") for cls in type(model).__mro__ for k in vars(cls))
    assert optimizer_state(opt).params  # the step hooks looked its params up once


def test_module_states_point_at_their_own_sharded_params(fake_pg):
    model = fczero.parallelize(UnevenTiedMLP(), init_device_mesh("cpu", (2,)))
    root = root_state(model)
    assert root is not None and root_state(model.inp) is None
    assert module_state(model).params.keys() == {"scale"}  # the root owns a param too
    seen: dict[int, ParamState] = {}
    for module in model.modules():
        record = module_state(module)
        if record is None:
            continue
        assert isinstance(record, ModuleState)
        for name, state in record.params.items():
            assert state.param is module._parameters[name]
            assert state.root is root
            seen.setdefault(id(state.param), state)
            assert seen[id(state.param)] is state  # a tied param has one state
    assert [id(s.param) for s in root.params] == list(seen)  # registration order
    assert len(root.params) == len(list(model.parameters()))


def test_a_submodule_is_not_a_root(fake_pg):
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)))
    assert root_state(model) is not None
    assert all(root_state(m) is None for m in model.blocks)
    assert module_state(model.blocks[0]).root is None


def test_an_optimizer_of_other_params_gets_no_attribute(fake_pg):
    fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)))  # the global hooks exist
    other = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert _fczero_names(opt) == set()


@pytest.fixture
def gloo_one_rank():
    """A real gloo group of one rank, in this process: collectives are copies, so numerics
    are exact against the plain model."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_compiled_graphs_differentiate_plain_leaves_not_dtensors(gloo_one_rank):
    """[Note: what a compiled graph differentiates]: Dynamo sees no DTensor input (no
    per-param DTensor guard, flatten or rewrap), and every grad still reaches its sharded
    param as a DTensor of the param's spec, accumulating over backwards without zero_grad
    as AccumulateGrad would, equal to the plain model's."""
    torch.manual_seed(0)
    ref = UnevenTiedMLP()
    model = fczero.parallelize(copy.deepcopy(ref), init_device_mesh("cpu", (1,)))
    inputs: list[object] = []

    def recording(gm, example_inputs):  # Dynamo's inputs, then AOT autograd as usual
        inputs.extend(example_inputs)
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(model, backend=recording)
    batches = [torch.randn(4, 5) for _ in range(2)]
    for x in batches:  # two backwards, no zero_grad in between
        compiled(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    assert inputs and not any(isinstance(t, DTensor) for t in inputs)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        if not p.requires_grad:
            assert p.grad is None
            continue
        assert isinstance(p.grad, DTensor), name
        assert p.grad.placements == p.placements and p.grad.shape == p.shape
        assert p.grad.dtype == p.dtype and p.grad._local_tensor.is_contiguous()
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-6, atol=1e-7)
    leaves = [s.leaf for s in root_state(model).params]
    assert all(leaf.grad is None for leaf in leaves)  # handed over, not kept twice
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()  # the leaves share the shards' storage: the next graph reads the update
    assert all(
        leaf.data_ptr() == s.param._local_tensor.data_ptr()
        for leaf, s in zip(leaves, root_state(model).params)
    )


def test_a_dropped_compiled_model_frees_its_leaves(gloo_one_rank):
    """The leaf's grad hook holds its state weakly: a hook lives in C++, where the garbage
    collector cannot break a cycle, and a strong one kept every dropped model's shards."""
    import gc
    import weakref

    model = fczero.parallelize(UnevenTiedMLP(), init_device_mesh("cpu", (1,)))
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(4, 5)).sum().backward()
    leaf = weakref.ref(root_state(model).params[0].leaf)
    del model, compiled
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    assert leaf() is None
