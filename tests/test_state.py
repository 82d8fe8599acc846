"""fczero's state: one ``_fczero`` attribute per module, model and optimizer, and the
records behind it point at the right params."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.state import ModuleState, ParamState, module_state, optimizer_state, root_state
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
