"""Installing the passes in Inductor (fczero/passes/install.py): the user's pass runs
first, the cache key follows the code and the settings."""

from __future__ import annotations

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
