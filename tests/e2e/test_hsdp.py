"""HSDP: params sharded over one mesh axis, replicated over the other (world size 4, gloo).

Numerics are checked against one process training the whole batch; the layout of
the sharded params (a 2-d DTensor, ``(Replicate(), Shard(0))``) and the compiled
graphs (reduce-scatter over the shard group, then all-reduce over the replicate
group, bucketing intact) are checked directly.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import fczero
from fczero.passes import run_passes
from fczero.passes.registry import settings_for_graph
from fczero.testing import parity
from fczero.testing.distributed import run_on_ranks
from fczero.testing.graphs import collective_sequence
from tests.models import ThreeBlocks, UnevenTiedMLP, mlp_batches, tiny_llama, token_batches

HSDP = {
    "mesh_shape": (2, 2),
    "mesh_dim_names": ("replicate", "shard"),
    "data_axes": ("replicate", "shard"),
    "axis": "shard",
    "replicate_axis": "replicate",
}

CASES = {
    # uneven rows, a 0-d param, a tied weight, a frozen param
    "mlp-sgd-eager": (UnevenTiedMLP, mlp_batches, parity.mse, "sgd", None),
    "llama-adamw-eager": (
        tiny_llama,
        partial(token_batches, steps=3),
        parity.cross_entropy,
        "adamw",
        None,
    ),
    "mlp-adamw-compiled": (
        UnevenTiedMLP,
        mlp_batches,
        parity.mse,
        "adamw",
        "aot_eager_with_passes",
    ),
}
LR = {"sgd": 0.05, "adamw": 0.01}


def _layout_facts(model: torch.nn.Module) -> dict[str, object]:
    """What each sharded param and its grad look like after one backward (this rank)."""
    facts = {}
    for name, p in model.named_parameters():
        facts[name] = (
            tuple(p.device_mesh.mesh_dim_names),
            tuple(p.placements),
            None if p.grad is None else tuple(p.grad.placements),
        )
    return facts


def _run_all(rank: int, world_size: int) -> dict[str, object]:
    results: dict[str, object] = {}
    for key, (build, batches, criterion, optimizer, backend) in CASES.items():
        results[key] = parity.train_parallel(
            rank,
            world_size,
            build,
            batches(),
            criterion,
            optimizer=optimizer,
            lr=LR[optimizer],
            compile_backend=backend,
            **HSDP,
        )
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fczero.parallelize(UnevenTiedMLP(), mesh, axis="shard", replicate_axis="replicate")
    model(torch.randn(4, 5)).sum().backward()
    results["layout"] = _layout_facts(model)
    results["state_dict"] = {
        k: (tuple(v.placements), tuple(v.to_local().shape))
        for k, v in model.state_dict().items()
        if hasattr(v, "placements")
    }
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_run_all, 4)


@pytest.mark.parametrize("key", list(CASES))
def test_hsdp_matches_single_process_reference(ranks, key):
    build, batches, criterion, optimizer, _ = CASES[key]
    expected = parity.train_reference(
        build, batches(), criterion, optimizer=optimizer, lr=LR[optimizer]
    )
    for rank_result in ranks:
        parity.assert_close(rank_result[key], expected, rtol=2e-4, atol=2e-5)
    torch.manual_seed(0)
    initial = dict(build().named_parameters())
    moved = [n for n, p in expected.params.items() if not torch.allclose(p, initial[n], atol=1e-3)]
    assert len(moved) >= len(expected.params) - 1  # real training (all but the frozen param)


def test_sharded_params_are_replicate_shard_dtensors(ranks):
    layout = ranks[0]["layout"]
    mesh_axes = ("replicate", "shard")
    assert layout["inp.weight"] == (mesh_axes, (Replicate(), Shard(0)), (Replicate(), Shard(0)))
    assert layout["scale"] == (mesh_axes, (Replicate(), Replicate()), (Replicate(), Replicate()))
    assert layout["frozen.weight"][2] is None  # no grad for a frozen param
    # 13 rows over the 2 shard ranks: 7 + 6, the same on both replicas
    shapes = [r["state_dict"]["inp.weight"][1] for r in ranks]
    assert shapes == [(7, 5), (6, 5), (7, 5), (6, 5)]


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_compiled_backward_reduce_scatters_then_all_reduces(fake_pg):
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fczero.parallelize(ThreeBlocks(dim=64), mesh, axis="shard", replicate_axis="replicate")
    backend = AotEagerAndRecordGraphs()
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 64)).sum().backward()
    (bw,) = backend.bw_graphs
    shard = mesh["shard"].get_group().group_name
    replicate = mesh["replicate"].get_group().group_name
    groups = {
        n.target.__name__.split(".")[0]: n.args[-1]
        for n in bw.graph.nodes
        if n.op == "call_function"
        and n.target.__name__.split(".")[0] in ("reduce_scatter_tensor", "all_reduce")
    }
    assert groups == {"reduce_scatter_tensor": shard, "all_reduce": replicate}
    before = collective_sequence(bw)
    assert before.count("reduce_scatter_tensor[32, 64]") == 3  # each block's weight, halved
    assert before.count("all_reduce[32, 64]") == 3
    settings = settings_for_graph(bw.graph)
    assert settings is not None and settings.groups == {shard}
    assert settings.replicate_groups == {replicate}
    after = collective_sequence(run_passes(bw))
    # bucketing merges the reduce-scatters, then the all-reduces of the reduced shards (half
    # of each param): every param would fit in one bucket, but the first and the last block
    # of backward go alone ([Note: small ends]): the head (4 x 64), blocks 2 and 1
    # (2 * (32*64 + 32)), block 0 (32*64 + 32)
    reduces = [op for op in after if op.startswith(("reduce_scatter", "all_reduce"))]
    assert reduces == [
        "reduce_scatter_tensor[4, 64]",
        "all_reduce[4, 64]",
        "reduce_scatter_tensor[4160]",
        "all_reduce[4160]",
        "reduce_scatter_tensor[2080]",
        "all_reduce[2080]",
    ]


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
@pytest.mark.parametrize(
    ("shape", "options", "message"),
    [
        ((4,), {"replicate_axis": 0}, r"replicate_axis=0 needs a mesh with a replicate axis"),
        ((2, 2), {"replicate_axis": "replicate"}, r"name the shard axis too"),
        ((2, 2), {"axis": "shard", "replicate_axis": "shard"}, r"axis and replicate_axis are both"),
        (
            (2, 2),
            {"axis": "shard", "replicate_axis": "replica"},
            r"replicate_axis='replica' is not",
        ),
        ((2, 2), {"axis": "shard", "replicate_axis": 2}, r"replicate_axis=2 is out of range"),
        ((2, 2), {"axis": "shard", "replicate_axis": 1.0}, r"replicate_axis must be a mesh axis"),
    ],
)
def test_bad_replicate_axis_is_an_error_before_anything_changes(fake_pg, shape, options, message):
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = UnevenTiedMLP()
    with pytest.raises((ValueError, TypeError), match=message):
        fczero.parallelize(model, mesh, **options)
    assert not fczero.is_parallelized(model)
    assert not any(hasattr(p, "placements") for p in model.parameters())


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_integer_axes_name_the_same_roles(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fczero.parallelize(UnevenTiedMLP(), mesh, axis=1, replicate_axis=0)
    weight = model.inp._parameters["weight"]
    assert weight.device_mesh.mesh_dim_names == ("replicate", "shard")
    assert tuple(weight.placements) == (Replicate(), Shard(0))


def _hsdp_inductor_rank(rank: int, world_size: int) -> parity.Trace:
    return parity.train_parallel(
        rank,
        world_size,
        UnevenTiedMLP,
        mlp_batches(steps=3),
        parity.mse,
        compile_backend="inductor",
        **HSDP,
    )


@pytest.mark.slow
def test_hsdp_with_inductor_matches_reference():
    expected = parity.train_reference(UnevenTiedMLP, mlp_batches(steps=3), parity.mse)
    for trace in run_on_ranks(_hsdp_inductor_rank, 4):
        parity.assert_close(trace, expected, rtol=2e-4, atol=2e-5)
