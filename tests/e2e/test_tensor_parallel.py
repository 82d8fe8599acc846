"""Tensor parallelism (``parallelize_module``) on one mesh axis, fczero on the other.

World size 4 on gloo: a (dp=2, tp=2) mesh. Numerics against one process training
the whole batch; the sharded params' 2-d layout; and the errors for a mesh that
does not match the tensor-parallel layout (all raised before anything changes).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.multiprocessing.reductions import StorageWeakRef

import fczero
from fczero.core.state import module_state
from fczero.runtime import resharding
from fczero.testing import parity
from fczero.testing.comm import CollectiveLog
from fczero.testing.distributed import run_on_ranks
from tests.cases import REGATHER
from tests.models import TINY_LLAMA, mlp_batches, tiny_llama, token_batches


class TensorParallelMLP(nn.Module):
    """Plain linears around a column-wise / row-wise pair (30 hidden rows: 15 per tp rank,
    8 + 7 per dp rank, so the dp split of a tensor-parallel piece is uneven)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 16)
        self.up = nn.Linear(16, 30)  # ColwiseParallel: weight and bias Shard(0) on tp
        self.down = nn.Linear(30, 16)  # RowwiseParallel: weight Shard(1), bias Replicate()
        self.out = nn.Linear(16, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.down(torch.relu(self.up(h)))
        return self.out(torch.tanh(h))


def tp_mlp(model: nn.Module, mesh) -> None:
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})


def tp_llama_ffn(model: nn.Module, mesh) -> None:
    plan = {}
    for i in range(TINY_LLAMA.n_layers):
        plan[f"layers.{i}.mlp.w1"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.w3"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.w2"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)


DP_TP = {
    "mesh_shape": (2, 2),
    "mesh_dim_names": ("dp", "tp"),
    "data_axes": ("dp",),
    "axis": "dp",
}
TP_DP = {**DP_TP, "mesh_dim_names": ("tp", "dp")}  # tp first: plain Shard(0) on both axes
CASES = {
    "mlp-sgd-eager": (TensorParallelMLP, mlp_batches, parity.mse, "sgd", tp_mlp, None),
    "mlp-sgd-eager-tp-first": (TensorParallelMLP, mlp_batches, parity.mse, "sgd", tp_mlp, None),
    "llama-adamw-eager": (
        tiny_llama,
        partial(token_batches, steps=3),
        parity.cross_entropy,
        "adamw",
        tp_llama_ffn,
        None,
    ),
    "mlp-adamw-compiled": (
        TensorParallelMLP,
        mlp_batches,
        parity.mse,
        "adamw",
        tp_mlp,
        "aot_eager_with_passes",
    ),
}
LR = {"sgd": 0.05, "adamw": 0.01}


def _run_all(rank: int, world_size: int) -> dict[str, object]:
    results: dict[str, object] = {}
    for key, (build, batches, criterion, optimizer, plan, backend) in CASES.items():
        results[key] = parity.train_parallel(
            rank,
            world_size,
            build,
            batches(),
            criterion,
            optimizer=optimizer,
            lr=LR[optimizer],
            compile_backend=backend,
            prepare=plan,
            **(TP_DP if key.endswith("tp-first") else DP_TP),
        )
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = TensorParallelMLP()
    tp_mlp(model, mesh)
    seen = {}
    model.up.register_forward_pre_hook(
        lambda m, args: seen.update(weight=m.weight, placements=m.weight.placements)
    )
    fczero.parallelize(model, mesh, axis="dp")
    model(torch.randn(4, 5)).sum().backward()
    results["layout"] = {
        n: (tuple(p.device_mesh.mesh_dim_names), tuple(p.placements), tuple(p.to_local().shape))
        for n, p in model.named_parameters()
    }
    results["grad_placements"] = {n: tuple(p.grad.placements) for n, p in model.named_parameters()}
    results["module_sees"] = (type(seen["weight"]).__name__, tuple(seen["placements"]))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    model = TensorParallelMLP()
    tp_mlp(model, mesh)
    fczero.parallelize(model, mesh, axis="dp")
    results["tp_first_layout"] = tuple(model.up._parameters["weight"].placements)
    results["round_trip"] = _round_trip()
    return results


def _round_trip() -> dict[tuple, bool]:
    """Does ``full_tensor()`` of every sharded param give back the initial whole param?
    Hidden sizes 31 and 3 split unevenly over tp (16 + 15, 2 + 1), then over dp (down to 0 rows)."""
    found = {}
    for names in (("dp", "tp"), ("tp", "dp")):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        for rows in (31, 30, 3):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, rows), nn.Linear(rows, 6))
            initial = [p.detach().clone() for p in model.parameters()]
            plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
            parallelize_module(model, mesh["tp"], plan)
            fczero.parallelize(model, mesh, axis="dp")
            found[(names, rows)] = all(
                torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), initial)
            )
    return found


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_run_all, 4)


@pytest.mark.parametrize("key", list(CASES))
def test_tensor_parallel_matches_single_process_reference(ranks, key):
    build, batches, criterion, optimizer, _, _ = CASES[key]
    expected = parity.train_reference(
        build, batches(), criterion, optimizer=optimizer, lr=LR[optimizer]
    )
    for rank_result in ranks:
        parity.assert_close(rank_result[key], expected, rtol=2e-4, atol=2e-5)
    torch.manual_seed(0)
    initial = dict(build().named_parameters())
    moved = [n for n, p in expected.params.items() if not torch.allclose(p, initial[n], atol=1e-3)]
    assert len(moved) == len(expected.params)  # real training: every param moved


def test_full_tensor_round_trips_uneven_splits(ranks):
    for rank_result in ranks:
        assert rank_result["round_trip"] == dict.fromkeys(rank_result["round_trip"], True)
        assert len(rank_result["round_trip"]) == 6


def test_sharded_params_are_dp_tp_dtensors(ranks):
    layout = ranks[0]["layout"]
    # column-wise: tp splits rows first, dp splits each tp piece (15 rows -> 8 + 7)
    assert layout["up.weight"] == (
        ("dp", "tp"),
        (_StridedShard(0, split_factor=2), Shard(0)),
        (8, 16),
    )
    assert [r["layout"]["up.weight"][2] for r in ranks] == [(8, 16), (8, 16), (7, 16), (7, 16)]
    assert layout["down.weight"] == (("dp", "tp"), (Shard(0), Shard(1)), (8, 15))
    assert layout["down.bias"] == (("dp", "tp"), (Shard(0), Replicate()), (8,))
    assert layout["inp.weight"] == (("dp",), (Shard(0),), (8, 5))  # plain params: dp only
    assert ranks[0]["tp_first_layout"] == (Shard(0), Shard(0))  # tp splits, then dp: in order
    grads = ranks[0]["grad_placements"]
    assert grads["up.weight"] == layout["up.weight"][1]
    assert grads["down.weight"] == (Shard(0), Shard(1))
    # the module computes with the tensor-parallel DTensor its plan made
    assert ranks[0]["module_sees"] == ("DTensor", (Shard(0),))


# --- a mesh that does not match the tensor-parallel layout (fake process group) ---------


def _tp_model(mesh_for_tp) -> TensorParallelMLP:
    torch.manual_seed(0)
    model = TensorParallelMLP()
    parallelize_module(model, mesh_for_tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _assert_untouched(model: TensorParallelMLP) -> None:
    assert not fczero.is_parallelized(model)
    assert isinstance(model.up.weight, DTensor) and model.up.weight.placements == (Shard(0),)
    assert not isinstance(model.inp.weight, DTensor)


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_tp_on_the_data_parallel_axis_is_an_error(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tp_model(mesh["dp"])  # tensor parallelism applied on the axis fczero shards
    with pytest.raises(ValueError, match=r"'up.weight' is already distributed over mesh axis 'dp'"):
        fczero.parallelize(model, mesh, axis="dp")
    _assert_untouched(model)
    model = _tp_model(mesh["tp"])
    with pytest.raises(ValueError, match=r"already distributed over mesh axis 'tp'"):
        fczero.parallelize(model, mesh, axis="tp")  # axes swapped
    _assert_untouched(model)


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_tp_on_another_mesh_is_an_error(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))  # same name, other ranks
    model = _tp_model(other)
    with pytest.raises(ValueError, match=r"'up.weight' is a DTensor on mesh .* not a sub-mesh"):
        fczero.parallelize(model, mesh, axis="dp")
    _assert_untouched(model)
    unnamed = init_device_mesh("cpu", (2, 2))
    model = _tp_model(mesh["tp"])
    with pytest.raises(ValueError, match="by name"):
        fczero.parallelize(model, unnamed, axis=0)
    _assert_untouched(model)


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_partial_placement_is_an_error(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = nn.Linear(4, 4)
    local = torch.randn(4, 4)
    model.weight = nn.Parameter(DTensor.from_local(local, mesh["tp"], [Partial()]))
    with pytest.raises(ValueError, match=r"'weight' has placement P\(sum\) on mesh axis 'tp'"):
        fczero.parallelize(model, mesh, axis="dp")
    assert not fczero.is_parallelized(model) and model.weight.placements == (Partial(),)


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_tp_mesh_without_names_is_an_error(fake_pg):
    mesh = init_device_mesh("cpu", (4,))
    model = _tp_model(init_device_mesh("cpu", (4,)))
    with pytest.raises(ValueError, match="mesh without axis names"):
        fczero.parallelize(model, mesh)
    _assert_untouched(model)


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_eager_stage3_frees_tensor_parallel_params_after_forward(fake_pg, monkeypatch):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tp_model(mesh["tp"])
    fczero.parallelize(model, mesh, axis="dp", comm_policy=REGATHER)
    refs = []
    original = resharding.ReshardScope.register

    def spy(self, full, spec, param):
        inner = full.elem if isinstance(full, AsyncCollectiveTensor) else full
        refs.append((spec.tensor_parallel is not None, StorageWeakRef(inner.untyped_storage())))
        original(self, full, spec, param)

    monkeypatch.setattr(resharding.ReshardScope, "register", spy)
    out = model(torch.randn(4, 5, requires_grad=True))  # the autograd graph is alive
    assert sum(tp for tp, _ in refs) == 4  # up and down, weight and bias
    assert all(r.expired() for _, r in refs), "an unsharded param outlived forward"
    with CollectiveLog() as bwd:
        out.sum().backward()
    # every weight is saved for an input grad (x requires grad): all four gathered again
    assert bwd.count("all_gather_into_tensor") == 4
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_hsdp_with_tensor_parallel_layout(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = _tp_model(mesh["tp"])
    fczero.parallelize(model, mesh, axis="shard", replicate_axis="replicate")
    up = model.up._parameters["weight"]
    assert up.device_mesh.mesh_dim_names == ("replicate", "shard", "tp")
    assert tuple(up.placements) == (Replicate(), _StridedShard(0, split_factor=2), Shard(0))
    down = model.down._parameters["weight"]
    assert tuple(down.placements) == (Replicate(), Shard(0), Shard(1))
    inp = model.inp._parameters["weight"]
    assert inp.device_mesh.mesh_dim_names == ("replicate", "shard")
    assert tuple(inp.placements) == (Replicate(), Shard(0))
    spec = module_state(model.up).params["weight"].spec
    assert spec.replicate == (2, mesh["replicate"].get_group().group_name)
    assert spec.group_name == mesh["shard"].get_group().group_name
    with CollectiveLog() as log:
        model(torch.randn(4, 5)).sum().backward()
    assert log.count("reduce_scatter_tensor") == 8  # one per param, over the shard group
    assert log.count("all_reduce") >= 8  # and its all-reduce over the replicas (+ TP's own)


def _hsdp_tp_rank(rank: int, world_size: int) -> parity.Trace:
    return parity.train_parallel(
        rank,
        world_size,
        TensorParallelMLP,
        mlp_batches(),
        parity.mse,
        optimizer="adamw",
        lr=0.01,
        mesh_shape=(2, 2, 2),
        mesh_dim_names=("replicate", "shard", "tp"),
        data_axes=("replicate", "shard"),
        prepare=tp_mlp,
        axis="shard",
        replicate_axis="replicate",
    )


@pytest.mark.slow
def test_hsdp_with_tensor_parallel_matches_reference():
    """World size 8: 2 replicas x 2 shards x 2 tensor-parallel ranks."""
    expected = parity.train_reference(
        TensorParallelMLP, mlp_batches(), parity.mse, optimizer="adamw", lr=0.01
    )
    for trace in run_on_ranks(_hsdp_tp_rank, 8):
        parity.assert_close(trace, expected, rtol=2e-4, atol=2e-5)


def _tp_inductor_rank(rank: int, world_size: int) -> parity.Trace:
    return parity.train_parallel(
        rank,
        world_size,
        TensorParallelMLP,
        mlp_batches(steps=3),
        parity.mse,
        compile_backend="inductor",
        prepare=tp_mlp,
        **DP_TP,
    )


@pytest.mark.slow
def test_tensor_parallel_with_inductor_matches_reference():
    expected = parity.train_reference(TensorParallelMLP, mlp_batches(steps=3), parity.mse)
    for trace in run_on_ranks(_tp_inductor_rank, 4):
        parity.assert_close(trace, expected, rtol=2e-4, atol=2e-5)
