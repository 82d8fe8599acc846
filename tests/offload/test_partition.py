"""The partitioner hook (fczero/offload/partition.py): Inductor's hook keeps the user's
partitioner as its base and a cache key that follows fczero's settings; graphs of groups
that are not fczero's are split as the base splits them, and nothing is recorded for them.
(The plans of fczero's graphs: tests/offload/test_activations.py and test_report.py.)"""

from __future__ import annotations

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from fczero.offload import partition
from fczero.passes import registry


class _UsersPartitioner(CustomPartitionerFn):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gm, joint_inputs, **kwargs):
        self.calls += 1
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def uuid(self):
        return b"the user's"


def test_the_hook_is_installed_once_over_the_users_partitioner(monkeypatch):
    monkeypatch.setattr(registry, "_BY_GROUP", {})
    users = _UsersPartitioner()
    with inductor_config.patch(custom_partitioner_fn=users):
        partition.install(required=False)
        hook = inductor_config.custom_partitioner_fn
        assert isinstance(hook, partition.FczeroPartitioner) and hook.before is users
        partition.install(required=True)
        assert inductor_config.custom_partitioner_fn is hook  # not wrapped twice
        first = hook.uuid()
        registry.register("0", bucket_bytes=1, prefetch=1, memory_budget=None)
        assert hook.uuid() != first  # the settings decide what the hook does


def test_a_graph_of_no_fczero_group_is_split_by_the_base_alone(monkeypatch):
    monkeypatch.setattr(registry, "_BY_GROUP", {})
    users = _UsersPartitioner()

    def split(gm, joint_inputs, **kwargs):
        return partition.partition(gm, joint_inputs, base=users, **kwargs)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), partition_fn=split)
    x = torch.randn(4, 4, requires_grad=True)
    torch.compile(lambda t: torch.relu(t).sum(), backend=backend)(x).backward()
    assert users.calls == 1 and torch.equal(x.grad, (x > 0).float())
    assert registry._BY_GROUP == {}  # no settings made, no plan recorded
