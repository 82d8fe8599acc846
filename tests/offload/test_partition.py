"""The partitioner hook (fczero/offload/partition.py): Inductor's hook keeps the user's
partitioner as its base and a cache key that follows fczero's settings; graphs of groups
that are not fczero's are split as the base splits them, and nothing is recorded for them.
(The plans of fczero's graphs: tests/offload/test_activations.py and test_report.py.)
Under CUDA graphs a graph holding offload's host tensors is not captured: one warning says
so (on a GPU: tests/e2e/test_offload_gpu.py)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.offload import partition
from fczero.passes import registry
from fczero.testing import backends
from tests.models import ThreeBlocks


class _UsersPartitioner(CustomPartitionerFn):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gm, joint_inputs, **kwargs):
        self.calls += 1
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def uuid(self):
        return b"the user's"


class _Root:
    """What the registry reads of a root: its ``passes``."""

    def __init__(self, passes: registry.PassSettings) -> None:
        self.passes = passes


def test_the_hook_is_installed_once_over_the_users_partitioner(monkeypatch):
    monkeypatch.setattr(registry, "_ROOTS", {})
    users = _UsersPartitioner()
    with inductor_config.patch(custom_partitioner_fn=users):
        partition.install(required=False)
        hook = inductor_config.custom_partitioner_fn
        assert isinstance(hook, partition.FczeroPartitioner) and hook.before is users
        partition.install(required=True)
        assert inductor_config.custom_partitioner_fn is hook  # not wrapped twice
        first = hook.uuid()
        root = _Root(registry.new_settings("0", bucket_bytes=1, prefetch=1, memory_budget=None))
        registry.register("0", root)
        assert hook.uuid() != first  # the settings decide what the hook does


def test_a_graph_of_no_fczero_group_is_split_by_the_base_alone(monkeypatch):
    monkeypatch.setattr(registry, "_ROOTS", {})
    users = _UsersPartitioner()

    def split(gm, joint_inputs, **kwargs):
        return partition.partition(gm, joint_inputs, base=users, **kwargs)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward), partition_fn=split
    )
    x = torch.randn(4, 4, requires_grad=True)
    torch.compile(lambda t: torch.relu(t).sum(), backend=backend)(x).backward()
    assert users.calls == 1 and torch.equal(x.grad, (x > 0).float())
    assert registry._ROOTS == {}  # no settings made, no plan recorded


# --- [Note: offload under CUDA graphs] -------------------------------------------------


def test_reduce_overhead_is_the_inductor_setting_the_hook_reads():
    """The hook knows CUDA graphs were asked for from ``triton.cudagraphs``, which
    ``mode="reduce-overhead"`` sets for the compile (torch 2.11 and 2.13 alike)."""
    assert torch._TorchCompileInductorWrapper("reduce-overhead", None, False).config == {
        "triton.cudagraphs": True
    }
    assert not torch._TorchCompileInductorWrapper("default", None, False).config


def _compile_three_blocks(cudagraphs: bool, **options) -> list[str]:
    """Compile ThreeBlocks (fake group, fczero's partitioner) with ``triton.cudagraphs`` as
    given; the messages of the warnings fczero gave."""
    torch._dynamo.reset()
    model = fczero.parallelize(ThreeBlocks(64), init_device_mesh("cpu", (2,)), **options)
    with (
        warnings.catch_warnings(record=True) as caught,
        inductor_config.patch({"triton.cudagraphs": cudagraphs}),
    ):
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend=backends.aot_eager_with_passes)
        for _ in range(2):
            compiled(torch.randn(8, 64)).sum().backward()
    return [str(w.message) for w in caught if "reduce-overhead" in str(w.message)]


def test_param_offload_under_cuda_graphs_warns_once(fake_pg, monkeypatch):
    """A model whose shards live in host memory (its settings made so: a CPU mesh keeps them
    where they are) warns once for all its graphs under CUDA graphs, and not without them."""
    new_settings = registry.new_settings

    def as_on_a_gpu(*args, **kwargs):
        return new_settings(*args, **{**kwargs, "param_offload": True})

    monkeypatch.setattr(registry, "new_settings", as_on_a_gpu)
    assert _compile_three_blocks(cudagraphs=False) == []
    (message,) = _compile_three_blocks(cudagraphs=True)  # forward and backward: one warning
    assert "cannot capture parameter offload (OffloadPolicy.params)" in message
    assert "outside the CUDA graphs" in message


def test_no_offload_under_cuda_graphs_says_nothing(fake_pg):
    assert _compile_three_blocks(cudagraphs=True) == []


def test_activation_offload_warns_only_where_it_moved_something_off_a_gpu():
    settings = registry.PassSettings(frozenset({"g"}), 1, 1, None)

    plan = types.SimpleNamespace(offloaded=[("relu", 4096)], device_type="cpu")

    partition._warn_uncapturable(settings, plan)  # a CPU graph: no CUDA graphs to lose
    assert settings.warned == set()
    plan.device_type = "cuda"
    with pytest.warns(RuntimeWarning, match="cannot capture activation offload"):
        partition._warn_uncapturable(settings, plan)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        partition._warn_uncapturable(settings, plan)  # once per settings
    assert again == [] and settings.warned == {"cuda-graphs"}
