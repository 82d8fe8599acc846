"""``fczero.offload.state_budget``: the bytes of optimizer state ``device_bytes="auto"`` keeps.

The allocator's peak is injected (the CPU has none); the end-to-end behaviour is in
test_optimizer.py."""

from __future__ import annotations

import logging

import pytest
import torch

from fczero.core import memory
from fczero.offload import state_budget

CPU = torch.device("cpu")


def test_in_flight_bytes_sets_aside_three_of_the_largest_chunk():
    assert state_budget.in_flight_bytes([], device_step=False) == 0  # no chunks
    assert state_budget.in_flight_bytes([100, 300, 200], device_step=False) == 3 * 2 * 300
    # under param offload each chunk's params and grads come in as stand-ins too
    assert state_budget.in_flight_bytes([100, 300], device_step=True) == 3 * 4 * 300


def test_plan_keeps_what_the_budget_leaves(monkeypatch, caplog):
    monkeypatch.setattr(memory, "peak_allocated", lambda device: 600 * 2**20)
    with caplog.at_level(logging.INFO, logger="fczero"):
        kept, sizing = state_budget.plan_device_bytes(CPU, 1000 * 2**20, 100 * 2**20)
    assert kept == 300 * 2**20
    assert sizing == (
        "auto: memory_budget 1000.0 MiB - peak before the first step 600.0 MiB - 100.0 MiB "
        "for the chunks in flight = 300.0 MiB of states kept"
    )
    assert [r.levelname for r in caplog.records] == ["INFO"]


def test_a_users_budget_below_the_peak_names_the_minimum(monkeypatch):
    monkeypatch.setattr(memory, "peak_allocated", lambda device: 10**6)
    with pytest.raises(ValueError, match="Raise memory_budget to 1000000 or more"):
        state_budget.plan_device_bytes(CPU, 10**6 - 1, 0)


def test_the_default_budget_below_the_peak_offloads_everything_with_a_warning(
    monkeypatch, caplog
):
    monkeypatch.setattr(memory, "peak_allocated", lambda device: 10**6)
    monkeypatch.setattr(memory, "device_budget", lambda device, budget: budget or 10**6 + 10)
    with caplog.at_level(logging.INFO, logger="fczero"):
        kept, sizing = state_budget.plan_device_bytes(CPU, None, 100)  # 10 bytes short
    assert kept == 0 and sizing.endswith("= 0.0 MiB of states kept")
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_no_budget_or_no_peak_offloads_everything():
    assert state_budget.plan_device_bytes(CPU, None, 0) == (
        0, "auto: no memory_budget on cpu, every state offloaded"
    )  # fmt: skip
    assert state_budget.plan_device_bytes(CPU, 10**9, 0)[1] == (
        "auto: no allocator peak on cpu, every state offloaded"
    )
