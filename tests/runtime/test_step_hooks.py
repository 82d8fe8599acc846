"""The optimizer step hooks (fczero/runtime/step_hooks.py): registered once per process,
they refresh stage 1/2's whole copies after a step, and run once around a step made of
several ``step()`` calls."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

import fczero
from fczero.core.state import OptimizerState
from fczero.runtime import step_hooks
from tests.models import TwoLayer


def test_hooks_are_registered_once_per_process(fake_pg):
    for _ in range(2):
        fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)))
        step_hooks.install()
    assert list(_global_optimizer_pre_hooks.values()).count(step_hooks._before_step) == 1
    assert list(_global_optimizer_post_hooks.values()).count(step_hooks._after_step) == 1


def test_a_step_in_parts_refreshes_the_whole_copies_once(fake_pg, monkeypatch):
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), stage=2)
    refreshed = []
    monkeypatch.setattr(step_hooks, "refresh", lambda states: refreshed.append(len(states)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert refreshed == [3]  # fc1's weight and bias, fc2's weight
    with step_hooks.one_step_in_parts(opt):
        assert OptimizerState.of(opt).in_parts
        opt.step()
        opt.step()
    assert refreshed == [3, 3] and not OptimizerState.of(opt).in_parts


def test_an_optimizer_of_other_params_is_left_alone(fake_pg, monkeypatch):
    step_hooks.install()
    refreshed = []
    monkeypatch.setattr(step_hooks, "refresh", lambda states: refreshed.append(len(states)))
    plain = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(torch.randn(1, 2)).sum().backward()
    opt.step()
    assert refreshed == [] and "_fczero" not in opt.__dict__


def test_an_optimizer_of_other_params_is_cleared_without_a_lookup_per_param(fake_pg, monkeypatch):
    # its params' ids meet neither fczero's sharded params nor the params parallelize
    # replaced, so neither per-param lookup runs (222 -> 30 us per step at 115 params);
    # an optimizer built before parallelize is still refused (tests/runtime/test_guards.py)
    fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)))

    def per_param(*args):
        raise AssertionError("looked up per param")

    monkeypatch.setattr(step_hooks, "state_of", per_param)
    monkeypatch.setattr(step_hooks.guards, "check_optimizer", per_param)
    plain = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(torch.randn(1, 2)).sum().backward()
    opt.step()
    assert "_fczero" not in opt.__dict__
