"""parallelize(): what the sharded model looks like, and every bad input it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fczero
from fczero.core.state import root_state
from fczero.testing import parity
from fczero.testing.distributed import run_on_ranks
from tests.models import (
    ThreeBlocks,
    TwoLayer,
    UnevenTiedMLP,
    block_batches,
    tiny_llama,
    token_batches,
)


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_params_become_sharded_dtensors(fake_pg):
    model = UnevenTiedMLP()
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    fczero.parallelize(model, init_device_mesh("cpu", (4,)))

    params = dict(model.named_parameters())
    assert params.keys() == whole.keys()  # the tied weight is still listed once
    for name, p in params.items():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), name
        assert p.shape == whole[name].shape, name
    assert params["inp.weight"].placements == (Shard(0),)
    # 13 rows on 4 ranks: torch.chunk gives rank 0 rows [0, 4)
    assert params["inp.weight"].to_local().shape == (4, 5)
    torch.testing.assert_close(params["inp.weight"].to_local(), whole["inp.weight"][:4])
    assert params["scale"].placements == (Replicate(),)  # 0-d cannot be split
    assert params["frozen.weight"].requires_grad is False
    assert model.back._parameters["weight"] is model.inp._parameters["weight"]
    assert isinstance(model.shift, torch.Tensor) and not isinstance(model.shift, DTensor)

    state = model.state_dict()
    assert all(isinstance(v, DTensor) for k, v in state.items() if k != "shift")
    assert type(model.inp).__name__ == "FCZeroLinear"


def test_module_sees_unsharded_param(fake_pg):
    model = TwoLayer()
    fczero.parallelize(model, init_device_mesh("cpu", (2,)), mp_policy=fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    w = model.fc1.weight + 0  # gathered on access (the add waits for the all-gather)
    assert not isinstance(w, DTensor)
    assert w.shape == (16, 8) and w.dtype == torch.bfloat16
    assert model.fc1._parameters["weight"].dtype == torch.float32  # the shard keeps its dtype


def test_returns_same_model_and_reports_parallelized(fake_pg):
    model = TwoLayer()
    assert not fczero.is_parallelized(model)
    assert fczero.parallelize(model, init_device_mesh("cpu", (2,))) is model
    assert fczero.is_parallelized(model)


# ---- bad input: a clear error before anything is sharded ----------------------------


def _assert_untouched(model: nn.Module) -> None:
    assert not fczero.is_parallelized(model)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_multi_axis_mesh_needs_axis(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
    model = TwoLayer()
    with pytest.raises(
        ValueError, match=r"mesh has 2 axes \(names: .*\); say which one is data-parallel"
    ):
        fczero.parallelize(model, mesh)
    _assert_untouched(model)
    with pytest.raises(ValueError, match=r"axis='dp' is not one of the mesh's axes"):
        fczero.parallelize(model, mesh, axis="dp")
    fczero.parallelize(model, mesh, axis="shard")
    assert model.fc1._parameters["weight"].device_mesh.mesh_dim_names == ("shard",)


def test_parallelize_twice(fake_pg):
    model = TwoLayer()
    mesh = init_device_mesh("cpu", (2,))
    fczero.parallelize(model, mesh)
    with pytest.raises(ValueError, match="already parallelized; call parallelize once"):
        fczero.parallelize(model, mesh)
    with pytest.raises(ValueError, match="already parallelized"):
        fczero.parallelize(model.fc1, mesh)


def test_non_floating_param(fake_pg):
    model = TwoLayer()
    model.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match=r"'steps' has dtype torch.int64; .* as a buffer"):
        fczero.parallelize(model, init_device_mesh("cpu", (2,)))
    _assert_untouched(model)


def test_unknown_option_suggests_the_closest(fake_pg):
    model = TwoLayer()
    with pytest.raises(TypeError, match=r"unknown option 'mp_polcy'. Did you mean 'mp_policy'"):
        fczero.parallelize(model, init_device_mesh("cpu", (2,)), mp_polcy=None)
    # a misspelled old name points at its new home, not at the deprecated name
    with pytest.raises(
        TypeError, match=r"'param_dtyp'. Did you mean mp_policy=fczero.MixedPrecisionPolicy"
    ):
        fczero.parallelize(model, init_device_mesh("cpu", (2,)), param_dtyp=torch.bfloat16)
    _assert_untouched(model)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"reshard_after_forward": 1}, r"reshard_after_forward must be True .* or False"),
        ({"axis": 1.5}, r"axis must be a mesh axis name \(str\) or index \(int\)"),
    ],
)
def test_wrong_option_types(fake_pg, option, message):
    model = TwoLayer()
    with pytest.raises((TypeError, ValueError), match=message):
        fczero.parallelize(model, init_device_mesh("cpu", (2,)), **option)
    _assert_untouched(model)


def test_not_a_mesh_or_module(fake_pg):
    with pytest.raises(TypeError, match="needs a DeviceMesh, e.g. .*init_device_mesh"):
        fczero.parallelize(TwoLayer(), "cpu")
    with pytest.raises(TypeError, match="needs an nn.Module"):
        fczero.parallelize(lambda x: x, init_device_mesh("cpu", (2,)))


def _two_models_side_by_side(rank: int, world_size: int) -> list[parity.Trace]:
    """Two models parallelized in one process, with different options, trained in one
    loop: both forwards run before one backward of the summed losses, so any state they
    shared (prefetch, reshard scope, reducer, step hooks) would mix them up."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    small_buckets = fczero.CommPolicy(bucket_bytes=1 << 20)
    blocks = fczero.parallelize(ThreeBlocks(), mesh, comm_policy=small_buckets)
    torch.manual_seed(1)
    llama = fczero.parallelize(tiny_llama(), mesh, stage=2)
    models = (blocks, llama)
    optimizers = [parity.make_optimizer("sgd", m.parameters(), 0.05) for m in models]
    criteria = (parity.mse, parity.cross_entropy)
    data = list(zip(block_batches(steps=3), token_batches(steps=3)))
    losses: list[list[float]] = [[], []]
    for step_batches in data:
        total = []
        for i, (model, (inputs, target)) in enumerate(zip(models, step_batches)):
            size = inputs.shape[0] // world_size
            rows = slice(rank * size, (rank + 1) * size)
            total.append(criteria[i](model(inputs[rows]), target[rows]))
        sum(total).backward()
        for i, (opt, loss) in enumerate(zip(optimizers, total)):
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[i].append(_mean_over_ranks(loss, world_size))
    return [
        parity.Trace(losses[i], {n: p.full_tensor().detach() for n, p in m.named_parameters()})
        for i, m in enumerate(models)
    ]


def _mean_over_ranks(loss: torch.Tensor, world_size: int) -> float:
    reduced = loss.detach().clone()
    torch.distributed.all_reduce(reduced)
    return reduced.item() / world_size


def _my_rows(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int):
    size = batch[0].shape[0] // world_size
    return tuple(t[rank * size : (rank + 1) * size] for t in batch)


def _interleaved(rank: int, world_size: int) -> tuple[list[parity.Trace], list[bool]]:
    """Two stage-3 models with eager prefetch and resharding on (other buckets and windows),
    stepped as forward A, forward B, backward A, backward B: each forward's gathers must go
    through its own root's prefetch, and each backward regather through the reshard scope
    of its own forward. Also returns, per model, that its recorded gather order holds its
    own params (their leaves) only."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    blocks = fczero.parallelize(
        ThreeBlocks(), mesh, comm_policy=fczero.CommPolicy(bucket_bytes=1 << 20)
    )
    torch.manual_seed(1)
    llama = fczero.parallelize(
        tiny_llama(), mesh, comm_policy=fczero.CommPolicy(bucket_bytes=4096, prefetch=2)
    )
    models = (blocks, llama)
    optimizers = [parity.make_optimizer("sgd", m.parameters(), 0.05) for m in models]
    criteria = (parity.mse, parity.cross_entropy)
    losses: list[list[float]] = [[], []]
    for step_batches in zip(block_batches(steps=3), token_batches(steps=3)):
        pending = []
        for model, criterion, batch in zip(models, criteria, step_batches):
            inputs, target = _my_rows(batch, rank, world_size)
            pending.append(criterion(model(inputs), target))  # forward A, then forward B
        for loss in pending:
            loss.backward()  # backward A, then backward B
        for i, (opt, loss) in enumerate(zip(optimizers, pending)):
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[i].append(_mean_over_ranks(loss, world_size))
    own = []
    for model in models:
        root = root_state(model)
        # (a gather records the param it differentiates: its leaf, or the param itself)
        params = {id(t) for s in root.params for t in (s.param, s.leaf)}
        order = root.prefetch.order
        own.append(bool(order) and all(id(p) in params for _, p, _ in order))
    traces = [
        parity.Trace(losses[i], {n: p.full_tensor().detach() for n, p in m.named_parameters()})
        for i, m in enumerate(models)
    ]
    return traces, own


class _Around(nn.Module):
    """A model whose forward calls another model, kept outside its module tree (so both
    can be parallelized, each as a root): the inner root runs inside the outer's forward."""

    def __init__(self, inner: nn.Module, dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.out = nn.Linear(8, 8)
        self.inner = [inner]  # a plain list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inner[0](torch.relu(self.inp(x)))))


NESTED_DIM = 32


def _build_nested() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(2)
    inner = ThreeBlocks(NESTED_DIM)
    return _Around(inner, NESTED_DIM), inner


def _params_of(outer: nn.Module, inner: nn.Module, whole) -> dict[str, torch.Tensor]:
    named = [*outer.named_parameters(), *(("inner." + n, p) for n, p in inner.named_parameters())]
    return {n: whole(p).detach().clone() for n, p in named}


def _nested_reference() -> parity.Trace:
    outer, inner = _build_nested()
    opt = parity.make_optimizer("sgd", [*outer.parameters(), *inner.parameters()], 0.05)
    losses = []
    for inputs, target in block_batches(steps=3, dim=NESTED_DIM):
        loss = parity.mse(outer(inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return parity.Trace(losses, _params_of(outer, inner, lambda p: p))


def _nested(rank: int, world_size: int) -> tuple[parity.Trace, dict[str, object]]:
    """A parallelized root called from another root's forward joins the outer root's eager
    context: while it runs, both roots' getters reach one context, which the outer root
    opened; the outer root's prefetch records the gathers of both."""
    mesh = init_device_mesh("cpu", (world_size,))
    outer, inner = _build_nested()
    fczero.parallelize(inner, mesh, comm_policy=fczero.CommPolicy(bucket_bytes=4096))
    fczero.parallelize(outer, mesh, comm_policy=fczero.CommPolicy(bucket_bytes=4096))
    outer_root, inner_root = root_state(outer), root_state(inner)
    seen: list[bool] = []

    def probe(module: nn.Module, args: object, output: object) -> None:
        context = inner_root.context
        seen.append(context is not None and context is outer_root.context)
        seen.append(context is not None and context.owner is outer_root)

    inner.blocks[1].register_forward_hook(probe)
    opt = parity.make_optimizer("sgd", [*outer.parameters(), *inner.parameters()], 0.05)
    losses = []
    for batch in block_batches(steps=3, dim=NESTED_DIM):
        inputs, target = _my_rows(batch, rank, world_size)
        loss = parity.mse(outer(inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(_mean_over_ranks(loss, world_size))
    facts = {
        "joined": seen,
        "closed": outer_root.context is None and inner_root.context is None,
        "outer records": len(outer_root.prefetch.order),
        "inner records": inner_root.prefetch.order,
    }
    return parity.Trace(losses, _params_of(outer, inner, lambda p: p.full_tensor())), facts


def _three_ways(rank: int, world_size: int) -> dict[str, object]:
    return {
        "summed": _two_models_side_by_side(rank, world_size),
        "interleaved": _interleaved(rank, world_size),
        "nested": _nested(rank, world_size),
    }


def test_two_models_in_one_process_share_nothing():
    """Each parallelized model trains as the plain model does, whether its forward and
    backward run between another model's, with another model's, or inside another
    parallelized root's forward."""
    out = run_on_ranks(_three_ways, 2)[0]
    expected_blocks = parity.train_reference(ThreeBlocks, block_batches(steps=3), parity.mse, seed=0)
    expected_llama = parity.train_reference(
        tiny_llama, token_batches(steps=3), parity.cross_entropy, seed=1
    )
    blocks, llama = out["summed"]
    parity.assert_close(blocks, expected_blocks, rtol=1e-5, atol=1e-6)
    parity.assert_close(llama, expected_llama, rtol=1e-5, atol=1e-6)
    (blocks, llama), own_orders = out["interleaved"]
    parity.assert_close(blocks, expected_blocks, rtol=1e-5, atol=1e-6)
    parity.assert_close(llama, expected_llama, rtol=1e-5, atol=1e-6)
    assert own_orders == [True, True]
    nested, facts = out["nested"]
    parity.assert_close(nested, _nested_reference(), rtol=1e-5, atol=1e-6)
    assert facts["joined"] == [True] * 6  # 3 forwards, 2 facts each
    assert facts["closed"]
    assert facts["outer records"] == 4 + 7  # its own 4 gathers and the inner root's 7
    assert facts["inner records"] is None  # the inner root never prefetched on its own


def _different_seeds(rank: int, world: int) -> tuple[str, bool]:
    torch.manual_seed(rank)  # a different model on each rank
    model = UnevenTiedMLP()
    try:
        fczero.parallelize(model, init_device_mesh("cpu", (world,)))
    except ValueError as e:
        return str(e), any(isinstance(p, DTensor) for p in model.parameters())
    return "no error", True


def test_ranks_with_different_weights_are_refused_before_sharding():
    """[Note: the same weights on every rank]: one checksum all-gather, every rank raises,
    naming the first param that differs; nothing is sharded."""
    for message, sharded in run_on_ranks(_different_seeds, 2):
        assert "parameter 'inp.weight' differs between ranks 0 and 1 before sharding" in message
        assert "torch.manual_seed(<same seed>)" in message
        assert not sharded
