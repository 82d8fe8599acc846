"""The optimizer step on local shards ([Note: local step] in fczero/runtime/local_step.py).

On two gloo ranks: elementwise optimizers give bitwise the same params and states as the
same optimizer stepping DTensors (a subclass, which fczero leaves on DTensors), and
after each step the optimizer holds exactly what it held before (the sharded params,
DTensor states laid out like them, no grads on the local tensors). The model has a 0-d
param, uneven shards, a tied weight and a frozen param.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fczero
from fczero.core.state import OptimizerState
from fczero.runtime import local_step
from fczero.testing.distributed import run_on_ranks
from tests.models import UnevenTiedMLP, train_steps

OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adam-amsgrad-loop": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False, amsgrad=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
}


def _on_dtensors(make):
    """The same optimizer as a subclass: not an exact ELEMENTWISE type, so it steps DTensors."""

    def build(params):
        opt = make(params)
        opt.__class__ = type("Sub" + type(opt).__name__, (type(opt),), {})
        return opt

    return build


def _train(make_opt, steps: int = 3):
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    fczero.parallelize(model, init_device_mesh("cpu", (2,)))
    opt = make_opt(model.parameters())
    seen: list[set[type]] = []
    opt.register_step_pre_hook(
        lambda o, *_: seen.append({type(p) for g in o.param_groups for p in g["params"]})
    )
    train_steps(model, opt, steps)
    return model, opt, seen


def _ids(tensors) -> list[int]:
    return [id(t) for t in tensors]


def _compare(rank: int, world: int, name: str) -> None:
    model, opt, seen = _train(OPTIMIZERS[name])
    ref_model, ref_opt, ref_seen = _train(_on_dtensors(OPTIMIZERS[name]))
    # the first step makes the states on DTensors, the later ones run on local tensors
    assert seen == [{DTensor}, {torch.Tensor}, {torch.Tensor}], seen
    assert ref_seen == [{DTensor}] * 3, ref_seen
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
    params = list(model.parameters())
    assert _ids(p for g in opt.param_groups for p in g["params"]) == _ids(params)  # same objects
    assert _ids(opt.state) == _ids(p for p in params if p.requires_grad)
    for p, ref_p in zip(params, ref_model.parameters()):
        assert p._local_tensor.grad is None
        if not p.requires_grad:
            continue
        states, ref_states = opt.state[p], ref_opt.state[ref_p]
        assert states.keys() == ref_states.keys()
        for key, value in states.items():
            ref = ref_states[key]
            assert type(value) is type(ref), (key, type(value), type(ref))
            if isinstance(value, DTensor):
                assert value.placements == p.placements and value.shape == p.shape
                value, ref = value.to_local(), ref.to_local()
            assert torch.equal(value, ref), key


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_local_step_matches_the_step_on_dtensors(name):
    run_on_ranks(_compare, 2, name)


def _raising_step(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    fczero.parallelize(model, init_device_mesh("cpu", (2,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = list(model.parameters())

    def fail(*_):
        raise RuntimeError("boom")

    model(torch.randn(6, 5)).sum().backward()
    opt.step()  # the first step makes the states (on DTensors)
    handle = opt.register_step_pre_hook(fail)  # runs after fczero's global hook
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert all(type(p) is torch.Tensor for p in opt.param_groups[0]["params"])  # left swapped
    local_step.restore(opt)
    assert _ids(opt.param_groups[0]["params"]) == _ids(params)
    handle.remove()
    opt.step()  # steps normally after the failed one
    assert _ids(opt.param_groups[0]["params"]) == _ids(params)
    assert all(isinstance(v, DTensor) for st in opt.state.values() for k, v in st.items() if k != "step")


def test_a_step_that_raises_can_be_restored():
    run_on_ranks(_raising_step, 2)


def _mixed(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    fczero.parallelize(model, init_device_mesh("cpu", (2,)))
    extra = nn.Parameter(torch.ones(3))  # not a sharded param: the step stays on DTensors
    opt = torch.optim.AdamW([*model.parameters(), extra], lr=1e-2)
    seen = []
    opt.register_step_pre_hook(lambda o, *_: seen.append({type(p) for p in o.param_groups[0]["params"]}))
    for _ in range(2):
        (model(torch.randn(6, 5)).sum() + extra.sum()).backward()
        opt.step()
    assert seen == [{DTensor, nn.Parameter}] * 2


def test_an_optimizer_with_other_params_steps_dtensors():
    run_on_ranks(_mixed, 2)


def _kept_view(rank: int, world: int) -> None:
    """The local view is built once and kept while the optimizer holds the same objects;
    a state loaded or replaced between steps, or a param's state dict replaced by a copy,
    is seen (the steps match DTensor's own)."""

    def run(make):
        torch.manual_seed(0)
        model = UnevenTiedMLP()
        fczero.parallelize(model, init_device_mesh("cpu", (2,)))
        opt = make(model.parameters())
        views = []

        def between():
            views.append(OptimizerState.of(opt).view)

        train_steps(model, opt, 3, between)  # the view of step 2 serves step 3
        opt.load_state_dict(opt.state_dict())  # new state dicts: a new view
        train_steps(model, opt, 1, between)
        p = next(p for p in model.parameters() if p.requires_grad and p.dim() == 2)
        with torch.no_grad():
            opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"] * 0.5  # a new DTensor value
        train_steps(model, opt, 1, between)
        opt.state[p] = dict(opt.state[p])  # a new dict holding the same values
        train_steps(model, opt, 1, between)
        train_steps(model, opt, 1, between)  # nothing changed since: the view is kept
        return model, opt, views

    model, opt, views = run(OPTIMIZERS["adamw-fused"])
    ref_model, ref_opt, _ = run(_on_dtensors(OPTIMIZERS["adamw-fused"]))
    # step 1 made the states (on DTensors), so step 2 built the view again; step 3 kept it
    assert None not in views and views[1] is not views[0] and views[2] is views[1]
    assert views[3] is not views[2] and views[4] is not views[3]
    assert views[5] is not views[4] and views[6] is views[5]
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
        if p.requires_grad:
            for key, value in opt.state[p].items():
                ref = ref_opt.state[q][key]
                assert type(value) is type(ref), key
                local = value.to_local() if isinstance(value, DTensor) else value
                assert torch.equal(local, ref.to_local() if isinstance(ref, DTensor) else ref), key


def test_the_local_view_is_kept_and_built_again_when_the_optimizer_changes():
    run_on_ranks(_kept_view, 2)


def _replacing_step(rank: int, world: int) -> None:
    """A local step that replaces a state value (here a pre-hook of the optimizer's own,
    which runs inside the swap) hands the optimizer a DTensor around the new local tensor,
    and the view, refreshed, is kept for the next step."""
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    fczero.parallelize(model, init_device_mesh("cpu", (2,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    p = next(p for p in model.parameters() if p.requires_grad and p.dim() == 2)
    train_steps(model, opt, 2)  # states made, then the first local step
    replaced = []

    def replace(optimizer, *_):
        local = optimizer.state[p._local_tensor]  # the local step's mapping
        local["exp_avg"] = local["exp_avg"].clone()
        replaced.append(local["exp_avg"])

    handle = opt.register_step_pre_hook(replace)
    train_steps(model, opt, 1)
    handle.remove()
    value = opt.state[p]["exp_avg"]
    assert isinstance(value, DTensor) and value.placements == p.placements
    assert value._local_tensor.data_ptr() == replaced[0].data_ptr()  # (``from_local``'s alias)
    view = OptimizerState.of(opt).view
    train_steps(model, opt, 1)
    assert view is not None and OptimizerState.of(opt).view is view


def test_a_state_value_the_step_replaces_is_written_back():
    run_on_ranks(_replacing_step, 2)
