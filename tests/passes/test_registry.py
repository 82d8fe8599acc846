"""The pass registry (fczero/passes/registry.py): each root's settings, found again from the
group name its graphs' collectives carry, and part of the cache key."""

from __future__ import annotations

import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.comm.graph_ops import collective_group, op_name
from fczero.core.state import root_state
from fczero.offload.partition import partition
from fczero.passes import registry, run_passes
from tests.models import ThreeBlocks


class _Root:
    """What the registry reads of a root: its ``passes``."""

    def __init__(self, passes: registry.PassSettings | None) -> None:
        self.passes = passes


def _settings(group: str, **kwargs) -> registry.PassSettings:
    return registry.new_settings(group, **{"prefetch": 1, "memory_budget": None, **kwargs})


def _graph_on(*groups: str) -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    mm = g.call_function(torch.ops.aten.mm.default, (x, x))
    for group in groups:
        g.call_function(torch.ops._c10d_functional.all_reduce.default, (mm, "sum", group))
    return g


def test_a_graph_finds_the_settings_of_its_root(monkeypatch):
    monkeypatch.setattr(registry, "_ROOTS", {})
    before = registry.snapshot()
    root = _Root(_settings("5", bucket_bytes=64, prefetch=2, replicate_group="6"))
    registry.register("5", root)
    settings = registry.settings_for_graph(_graph_on("5"))
    assert settings is root.passes
    assert settings.groups == frozenset({"5"}) and settings.replicate_groups == frozenset({"6"})
    assert (settings.bucket_bytes, settings.prefetch) == (64, 2)
    assert registry.settings_for_graph(_graph_on("7")) is None  # no root's group
    assert registry.settings_for_graph(_graph_on("7", "5")) is root.passes  # its first with one
    assert registry.snapshot() != before
    off = _Root(None)  # CommPolicy(compile_passes=False): its graphs are left to Inductor
    registry.register("8", off)
    assert registry.settings_for_graph(_graph_on("8")) is None
    del root, off  # held weakly: the model alone keeps its root
    assert registry.settings_for_graph(_graph_on("5")) is None
    assert registry.snapshot() == before


def test_each_root_has_its_settings_and_records(monkeypatch):
    monkeypatch.setattr(registry, "_ROOTS", {})
    first = _Root(_settings("5", bucket_bytes=64, check_timeout_s=9.0))
    registry.register("5", first)
    first.passes.plans.append("a plan")
    first.passes.warned.add("budget")
    assert registry.check_timeouts(_graph_on("5")) == {"5": 9.0}
    before = registry.snapshot()
    second = _Root(_settings("5.fczero.1", bucket_bytes=64))
    registry.register("5.fczero.1", second)
    assert registry.settings_of("5.fczero.1") is second.passes
    assert second.passes.plans == [] and second.passes.warned == set()
    assert first.passes.plans == ["a plan"]  # the earlier root keeps its own
    assert registry.check_timeouts(_graph_on("5", "5.fczero.1")) == {"5": 9.0}  # second: unchecked
    assert registry.snapshot() != before
    assert registry.settings_of("6") is None


def _all_gathers(gm: fx.GraphModule) -> int:
    return sum(op_name(n).startswith("all_gather_into_tensor") for n in gm.graph.nodes)


def test_two_roots_on_one_group_each_compile_with_their_own_settings(fake_pg):
    """Two models parallelized on one process group with different options: each one's
    collectives carry a name of the group that only it uses, so its compiled graphs get
    its own settings (seen by the passes and by the bucketing they do) and record its own
    plans, whichever was parallelized last."""
    mesh = init_device_mesh("cpu", (2,))
    per_param = fczero.parallelize(
        ThreeBlocks(64), mesh, comm_policy=fczero.CommPolicy(bucket_bytes=0)
    )
    one_bucket = fczero.parallelize(
        ThreeBlocks(64), mesh, comm_policy=fczero.CommPolicy(bucket_bytes=1 << 30)
    )
    first, second = root_state(per_param).passes, root_state(one_bucket).passes
    assert first.groups == {mesh.get_group().group_name}  # the group's own name, then another
    assert second.groups == {f"{mesh.get_group().group_name}.fczero.1"}
    assert dist.distributed_c10d._resolve_process_group("0.fczero.1") is mesh.get_group()
    seen: dict[str, list] = {"per_param": [], "one_bucket": []}

    def backend(label: str):
        def compile_graph(gm: fx.GraphModule, example_inputs):
            names = {collective_group(n) for n in gm.graph.nodes} - {None}
            seen[label].append((names, registry.settings_for_graph(gm.graph)))
            gm = run_passes(gm)
            seen[label].append(_all_gathers(gm))
            return make_boxed_func(gm.forward)

        return aot_autograd(
            fw_compiler=compile_graph, bw_compiler=compile_graph, partition_fn=partition
        )

    for label, model in (("per_param", per_param), ("one_bucket", one_bucket)):
        compiled = torch.compile(model, backend=backend(label))
        compiled(torch.randn(8, 64)).sum().backward()
    for label, model in (("per_param", per_param), ("one_bucket", one_bucket)):
        (fw_names, forward), _, (bw_names, backward), _ = seen[label]
        settings = root_state(model).passes
        assert fw_names == bw_names == settings.groups, label
        assert forward is backward is settings, label
        assert len(settings.plans) == 1, label  # its own forward/backward pair
    per_param_gathers = len(list(per_param.parameters()))  # forward: one gather per param
    assert seen["per_param"][1] == per_param_gathers > seen["one_bucket"][1]  # vs buckets
