"""Installing the passes in Inductor (fczero/passes/install.py): the user's pass runs
first, the cache key follows the code and the settings."""

from __future__ import annotations

from pathlib import Path

import torch
from torch._inductor import config as inductor_config
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.passes import registry
from fczero.passes.install import FczeroPostGradPass
from tests.models import ThreeBlocks


def test_installed_pass_runs_the_users_pass_first(fake_pg):
    calls = []

    class UserPass:
        def __call__(self, graph):
            calls.append("user")

    with inductor_config.patch(post_grad_custom_post_pass=UserPass()):
        fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)))
        installed = inductor_config.post_grad_custom_post_pass
        assert isinstance(installed, FczeroPostGradPass)
        assert installed.uuid() is None  # the user's pass has no uuid: no caching, as before
        assert inductor_config.reorder_for_peak_memory is False
        gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        gm.graph.output(None)
        installed(gm.graph)
    assert calls == ["user"]


class _Root:
    """What the registry reads of a root: its ``passes``."""

    def __init__(self, passes: registry.PassSettings) -> None:
        self.passes = passes


def test_the_cache_key_follows_the_pass_settings(monkeypatch):
    monkeypatch.setattr(registry, "_ROOTS", {})
    hook = FczeroPostGradPass([])
    first = hook.uuid()
    assert isinstance(first, bytes) and hook.uuid() == first  # stable while nothing changes
    root = _Root(registry.new_settings("0", bucket_bytes=1 << 20, prefetch=1, memory_budget=None))
    registry.register("0", root)
    assert hook.uuid() != first


def test_the_caches_may_keep_fczeros_graphs_even_without_its_passes(fake_pg):
    from torch._prims.rng_prims import graphsafe_run_with_rng_state

    from fczero.passes.install import GATHER_FUNCTION, code_hash_of

    with inductor_config.patch(unsafe_marked_cacheable_functions={}):
        policy = fczero.CommPolicy(compile_passes=False)
        fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=policy)
        marked = inductor_config.unsafe_marked_cacheable_functions
        # keyed by the gather's source: a changed gather misses the cache
        source = fczero.comm.collectives.__file__
        assert marked[GATHER_FUNCTION] == code_hash_of(Path(source))
        # [Note: a checkpointed graph's RNG replay and the FX graph cache]: cacheable on
        # every torch fczero supports (marked by torch itself from 2.13)
        assert graphsafe_run_with_rng_state.cacheable()


def test_dynamo_leaves_each_gather_as_one_call(fake_pg):
    from torch._dynamo.testing import EagerAndRecordGraphs

    from fczero.comm import collectives

    model = fczero.parallelize(ThreeBlocks(dim=64), init_device_mesh("cpu", (2,)))
    backend = EagerAndRecordGraphs()
    torch.compile(model, backend=backend)(torch.randn(4, 64)).sum().backward()
    (graph,) = backend.graphs
    # the gathers that backward repeats sit in checkpoint bodies: subgraphs of their own
    nodes = [n for module in graph.modules() if isinstance(module, torch.fx.GraphModule)
             for n in module.graph.nodes]  # fmt: skip
    calls = [n for n in nodes if n.op == "call_function"]
    gathers = [n for n in calls if n.target is collectives.gather_shard]
    assert len(gathers) == 7  # three blocks' weights and biases, the head's weight
    # not inlined: no autograd.Function body in Dynamo's graph
    assert not [n for n in calls if "autograd_function_apply" in str(n.target)]
