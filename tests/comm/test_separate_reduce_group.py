"""``CommPolicy(separate_reduce_group=True)``: the reduce-scatters run on a second process
group over the same ranks, the all-gathers stay on the first; training matches a single
process, eagerly and compiled; the combinations it does not cover are refused before
anything is sharded."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import fczero
from fczero.models import Llama, LlamaConfig
from fczero.testing import parity
from fczero.testing.backends import recording
from fczero.testing.distributed import run_on_ranks
from fczero.testing.graphs import op_name
from tests.models import token_batches

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=40)
SEPARATE = fczero.CommPolicy(separate_reduce_group=True)


def _llama() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG)


def _groups(graph: torch.fx.GraphModule) -> dict[str, set[str]]:
    """Collective name -> the group names it was issued on, in one graph."""
    out: dict[str, set[str]] = {}
    for node in graph.graph.nodes:
        name = op_name(node) if node.op == "call_function" else ""
        if name.startswith(("all_gather", "reduce_scatter")):
            out.setdefault(name, set()).add(node.args[-1])
    return out


def test_compiled_reduce_scatters_name_the_second_group(fake_pg):
    model = fczero.parallelize(_llama(), init_device_mesh("cpu", (2,)), comm_policy=SEPARATE)
    graphs: list = []
    compiled = torch.compile(model, backend=recording(graphs))
    compiled(torch.randint(0, 64, (2, 8))).float().pow(2).mean().backward()
    gathers = set().union(*(g for m in map(_groups, graphs) for k, g in m.items() if k.startswith("all_gather")))
    reduces = set().union(*(g for m in map(_groups, graphs) for k, g in m.items() if k.startswith("reduce_scatter")))
    assert gathers == {dist.group.WORLD.group_name}, gathers
    (reduce_group,) = reduces
    assert reduce_group != dist.group.WORLD.group_name
    assert dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(reduce_group)) == [0, 1]


class _GroupsOfCollectives(TorchDispatchMode):
    """Records the group name of every functional all-gather and reduce-scatter issued."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name.startswith(("all_gather_into_tensor", "reduce_scatter_tensor")):
            self.seen.setdefault(name.split("_into")[0].split("_tensor")[0], set()).add(args[-1])
        return func(*args, **(kwargs or {}))


def test_eager_reduce_scatters_name_the_second_group(fake_pg):
    model = fczero.parallelize(_llama(), init_device_mesh("cpu", (2,)), comm_policy=SEPARATE)
    for _ in range(2):  # the first step records the gathers, the second buckets them
        with _GroupsOfCollectives() as groups:
            model(torch.randint(0, 64, (2, 8))).float().pow(2).mean().backward()
        assert groups.seen["all_gather"] == {dist.group.WORLD.group_name}, groups.seen
        (reduce_group,) = groups.seen["reduce_scatter"]
        assert reduce_group != dist.group.WORLD.group_name


def _train(rank: int, world: int, backend: str | None) -> parity.Trace:
    return parity.train_parallel(
        rank, world, _llama, token_batches(steps=3), parity.cross_entropy,
        optimizer="adamw", lr=1e-3, compile_backend=backend, comm_policy=SEPARATE,
    )  # fmt: skip


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_trains_like_one_process(backend):
    trace = run_on_ranks(functools.partial(_train, backend=backend), 2)[0]
    expected = parity.train_reference(
        _llama, token_batches(steps=3), parity.cross_entropy, optimizer="adamw", lr=1e-3
    )
    parity.assert_close(trace, expected, rtol=1e-5, atol=1e-6)


def test_other_stages_are_refused_before_any_param_changes(fake_pg):
    model = _llama()
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"separate_reduce_group=True\) applies to stage=3"):
        fczero.parallelize(model, init_device_mesh("cpu", (2,)), stage=2, comm_policy=SEPARATE)
    assert {n: p for n, p in model.named_parameters()} == before
    assert not fczero.is_parallelized(model)


def test_the_option_is_a_flag():
    with pytest.raises(TypeError, match="separate_reduce_group must be True or False"):
        fczero.CommPolicy(separate_reduce_group=1)


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_an_axis_that_leaves_ranks_out_is_refused(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _llama()
    with pytest.raises(ValueError, match=r"needs the data-parallel axis to span every rank \(it has 2 of 4\)"):
        fczero.parallelize(model, mesh, axis="dp", comm_policy=SEPARATE)
    assert not fczero.is_parallelized(model)
