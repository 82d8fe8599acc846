"""The pass registry (fczero/passes/registry.py): parallelize's settings per process group,
found again from a graph's collectives, and part of the cache key."""

from __future__ import annotations

import torch
import torch.fx as fx

from fczero.passes import registry


def _graph_on(group: str) -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    mm = g.call_function(torch.ops.aten.mm.default, (x, x))
    g.call_function(torch.ops._c10d_functional.all_reduce.default, (mm, "sum", group))
    return g


def test_a_graph_finds_the_settings_of_its_group(monkeypatch):
    monkeypatch.setattr(registry, "_BY_GROUP", {})
    before = registry.snapshot()
    registry.register("5", bucket_bytes=64, prefetch=2, memory_budget=None, replicate_group="6")
    settings = registry.settings_for_graph(_graph_on("5"))
    assert settings.groups == frozenset({"5"}) and settings.replicate_groups == frozenset({"6"})
    assert (settings.bucket_bytes, settings.prefetch) == (64, 2)
    assert registry.settings_for_graph(_graph_on("7")) is None  # not fczero's group
    assert registry.snapshot() != before
    registry.register("5", bucket_bytes=128, prefetch=2, memory_budget=None)  # the later wins
    assert registry.settings_for_graph(_graph_on("5")).bucket_bytes == 128
    registry.unregister("5")
    assert registry.settings_for_graph(_graph_on("5")) is None
    assert registry.snapshot() == before


def test_a_later_parallelize_on_a_group_starts_its_plans_and_warnings_afresh(monkeypatch):
    monkeypatch.setattr(registry, "_BY_GROUP", {})
    registry.register("5", bucket_bytes=64, prefetch=1, memory_budget=None, check_timeout_s=9.0)
    first = registry.settings_of("5")
    first.plans.append("a plan")
    first.warned.add("budget")
    assert registry.check_timeouts() == {"5": 9.0}
    before = registry.snapshot()
    registry.register("5", bucket_bytes=64, prefetch=1, memory_budget=None)
    again = registry.settings_of("5")
    assert again.plans == [] and again.warned == set()
    assert registry.check_timeouts() == {}  # unchecked now
    assert registry.snapshot() != before  # the timeout is a setting: part of the cache key
    assert registry.settings_of("6") is None
