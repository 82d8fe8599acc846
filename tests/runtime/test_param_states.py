"""ZeRO stages 1 and 2: parity with the single-process reference, graphs, buckets, errors.

Parity tolerances as in test_numerics: fp32 rtol 1e-5 / atol 1e-6 (only the order of
sums differs); bf16 compute with fp32 reduction rtol/atol 2e-2 against the fp32
reference.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs, CompileCounterWithBackend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fczero
from fczero.runtime import param_states
from fczero.testing import backends, parity
from fczero.testing.distributed import gpu_world_size, run_on_ranks
from fczero.testing.graphs import collective_sequence
from tests.cases import BF16, BF16_MP, BF16_OPTS, FP32, Case, run_cases, tiny_llama_with_inductor
from tests.models import TwoLayer, UnevenTiedMLP, mlp_batches, tiny_llama, token_batches

CASES = [
    Case("mlp", options=(("stage", 1),)),
    Case("mlp", "adamw", options=(("stage", 2),)),
    Case("llama", "adamw", options=(("stage", 1), ("comm_policy", fczero.CommPolicy(bucket_bytes=4096)))),  # several buckets
    Case("llama", options=(("stage", 2),)),
    Case("mlp", options=(("stage", 1), ("comm_policy", fczero.CommPolicy(bucket_bytes=0)))),  # one param per bucket
    Case("llama", options=(("stage", 1), *BF16_OPTS)),
    Case("mlp", backend="aot_eager", options=(("stage", 1),)),
    Case("mlp", backend="aot_eager", options=(("stage", 2),)),
    Case("llama", backend="aot_eager", options=(("stage", 1),)),
    Case("llama", "adamw", backend="aot_eager_with_passes", options=(("stage", 2),)),
    Case("llama", backend="aot_eager_with_passes", options=(("stage", 1),)),  # bucketed
]


def _bucket_launches(rank: int, world_size: int) -> dict:
    """Eager stage 1 with small buckets: which buckets were launched, in which order, and
    how many before backward ended."""
    torch.manual_seed(0)
    model = tiny_llama()
    fczero.parallelize(model, init_device_mesh("cpu", (world_size,)), stage=1, comm_policy=fczero.CommPolicy(bucket_bytes=4096))
    red = param_states.root_state(model).reducer
    log: list[tuple[int, bool]] = []
    launch, finish = red._launch, red.finish
    in_finish = [False]

    def recording_launch(b):
        log.append((b, in_finish[0]))
        launch(b)

    def recording_finish():
        in_finish[0] = True
        finish()
        in_finish[0] = False

    red._launch, red.finish = recording_launch, recording_finish
    tokens, target = parity._slice(token_batches(steps=1)[0], rank, world_size, "cpu")
    parity.cross_entropy(model(tokens), target).backward()
    names = {id(p): n for n, p in model.named_parameters()}
    first = [names[id(red.params[i][0])] for i in red.buckets[0]]
    grads_are_shards = all(isinstance(p.grad, DTensor) for p in model.parameters())
    return {"log": log, "n": len(red.buckets), "first": first, "dtensor_grads": grads_are_shards}


def _steady_state_frames(rank: int, world_size: int, stage: int) -> list[int]:
    """Compiled frames after each of 4 steps: the in-place refresh must not recompile."""
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    fczero.parallelize(model, init_device_mesh("cpu", (world_size,)), stage=stage)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    frames = []
    for batch in mlp_batches(steps=4):
        inputs, target = parity._slice(batch, rank, world_size, "cpu")
        parity.mse(compiled(inputs), target).backward()
        opt.step()
        opt.zero_grad()
        frames.append(counter.frame_count)
    return frames


def _refresh_after_manual_change(rank: int, world_size: int) -> list[str]:
    """Shards changed outside an optimizer: stale whole copies until refresh_params."""
    torch.manual_seed(0)
    model = tiny_llama()
    fczero.parallelize(model, init_device_mesh("cpu", (world_size,)), stage=2)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(2.0)
    states = param_states.root_state(model).params
    stale = [s for s in states if not torch.equal(s.whole, s.param.full_tensor())]
    fczero.refresh_params(model)
    still = [s for s in states if not torch.equal(s.whole, s.param.full_tensor())]
    return [f"{len(stale)} stale of {len(states)}", f"{len(still)} stale after refresh"]


def _two_forwards_then_two_backwards(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Eager stage 1: both forwards announce their reads before either backward runs, so
    the first backward reduces every bucket and the second's grads arrive late."""
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    fczero.parallelize(model, init_device_mesh("cpu", (world_size,)), stage=1, comm_policy=fczero.CommPolicy(bucket_bytes=64))
    (x1, y1), (x2, y2) = (parity._slice(b, rank, world_size, "cpu") for b in mlp_batches(2))
    loss1, loss2 = parity.mse(model(x1), y1), parity.mse(model(x2), y2)
    loss1.backward()
    loss2.backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def _rank_main(rank: int, world_size: int) -> dict:
    return {
        "late": _two_forwards_then_two_backwards(rank, world_size),
        "traces": run_cases(rank, world_size, CASES),
        "buckets": _bucket_launches(rank, world_size),
        "frames": {s: _steady_state_frames(rank, world_size, s) for s in (1, 2)},
        "refresh": _refresh_after_manual_change(rank, world_size),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(_rank_main, 2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_single_process_reference(ranks, case):
    actual = ranks[0]["traces"][CASES.index(case)]
    for other in ranks[1:]:
        assert other["traces"][CASES.index(case)].losses == actual.losses
    build, batches, criterion = case.setup()
    expected = parity.train_reference(
        build, batches, criterion, optimizer=case.optimizer, lr=case.lr
    )
    tol = BF16 if dict(case.options).get("mp_policy") == BF16_MP else FP32
    parity.assert_close(actual, expected, **tol)


def test_stage1_grads_arriving_after_their_bucket_are_reduced(ranks):
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    (x1, y1), (x2, y2) = mlp_batches(2)
    (parity.mse(model(x1), y1) + parity.mse(model(x2), y2)).backward()
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for r in ranks:
        assert r["late"].keys() == expected.keys()
        for name, grad in expected.items():
            torch.testing.assert_close(
                r["late"][name], grad, **FP32, msg=lambda m, name=name: f"{name}: {m}"
            )


def test_stage1_buckets_reduce_in_fixed_order(ranks):
    for r in ranks:
        info = r["buckets"]
        assert info["n"] > 2
        assert [b for b, _ in info["log"]] == list(range(info["n"]))  # each once, in order
        assert any(not at_end for _, at_end in info["log"]), "no bucket went out during backward"
        assert info["first"] == ["output.weight"]  # the last registered param comes first
        assert info["dtensor_grads"]
    assert ranks[0]["buckets"]["log"] == ranks[1]["buckets"]["log"]


@pytest.mark.parametrize("stage", [1, 2])
def test_compiled_steps_do_not_recompile(ranks, stage):
    for r in ranks:
        frames = r["frames"][stage]
        assert frames[0] > 0 and frames[-1] == frames[0], frames


def test_refresh_params_after_changing_shards(ranks):
    for r in ranks:
        stale, after = r["refresh"]
        assert not stale.startswith("0 "), stale
        assert after == "0 stale after refresh"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_inductor_matches_reference(stage):
    """Stock Inductor (C++ codegen on CPU), end to end on 2 gloo ranks."""

    def expected():
        return parity.train_reference(tiny_llama, token_batches(steps=3), parity.cross_entropy)

    actual = run_on_ranks(functools.partial(tiny_llama_with_inductor, stage=stage), 2)[0]
    parity.assert_close(actual, expected(), **FP32)


GPU_CASES = [
    Case("llama", "adamw", options=(("stage", 1), ("comm_policy", fczero.CommPolicy(bucket_bytes=4096)))),
    Case("mlp", options=(("stage", 2),)),
    Case("llama", backend="inductor", options=(("stage", 1),)),
    Case("llama", "adamw", backend="inductor", options=(("stage", 2),)),
    Case("llama", backend="inductor", options=(("stage", 2), *BF16_OPTS)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_stages_match_reference():
    """NCCL on 2 GPUs (1 rank on one GPU): the stage-1 reducer's all-reduces overlap there
    (async); tolerances as in test_gpu (fp32 rtol 1e-4 / atol 1e-5: cuBLAS orders sums by
    shape)."""
    per_rank = run_on_ranks(run_cases, gpu_world_size(), GPU_CASES, "cuda", backend="nccl")
    for case, actual in zip(GPU_CASES, per_rank[0]):
        build, batches, criterion = case.setup()
        expected = parity.train_reference(
            build, batches, criterion, optimizer=case.optimizer, lr=case.lr, device="cuda"
        )
        bf16 = dict(case.options).get("mp_policy") == BF16_MP
        parity.assert_close(actual, expected, **(BF16 if bf16 else {"rtol": 1e-4, "atol": 1e-5}))


# --- graphs (fake process group: shapes and collectives only) ---------------------------


def _two_layer_graphs(**options):
    torch.manual_seed(0)
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), **options)
    backend = AotEagerAndRecordGraphs()
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(3, 8)).sum().backward()
    assert len(backend.fw_graphs) == 1 and len(backend.bw_graphs) == 1
    return collective_sequence(backend.fw_graphs[0]), collective_sequence(backend.bw_graphs[0])


def test_stage2_graphs_gather_nothing_and_reduce_scatter(fake_pg):
    fw, bw = _two_layer_graphs(stage=2)
    assert fw == []
    reduces = [op for op in bw if op.startswith("reduce_scatter_tensor")]
    assert sorted(reduces) == sorted(
        ["reduce_scatter_tensor[2, 16]", "reduce_scatter_tensor[8]", "reduce_scatter_tensor[8, 8]"]
    )
    assert not any(op.startswith(("all_gather", "all_reduce")) for op in bw)


def test_stage1_graphs_gather_nothing_and_all_reduce(fake_pg):
    fw, bw = _two_layer_graphs(stage=1)
    assert fw == []
    reduces = [op for op in bw if op.startswith("all_reduce")]
    assert sorted(reduces) == sorted(["all_reduce[4, 16]", "all_reduce[16]", "all_reduce[16, 8]"])
    assert not any(op.startswith(("all_gather", "reduce_scatter")) for op in bw)


def test_stage1_compiled_all_reduces_are_bucketed(fake_pg):
    torch.manual_seed(0)
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), stage=1)
    graphs: list[torch.fx.GraphModule] = []
    compiled = torch.compile(model, backend=backends.recording(graphs), fullgraph=True)
    compiled(torch.randn(3, 8)).sum().backward()
    fw, bw = (collective_sequence(g) for g in graphs)
    assert fw == []
    # fc1.weight (128) + fc1.bias (16) + fc2.weight (64): one bucket (under 1 MiB)
    assert bw == ["all_reduce[208]", "wait_tensor[208]"]


def test_stage1_eager_buckets_follow_reverse_registration(fake_pg):
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), stage=1, comm_policy=fczero.CommPolicy(bucket_bytes=600))
    red = param_states.root_state(model).reducer
    names = {id(p): n for n, p in model.named_parameters()}
    plan = [[names[id(red.params[i][0])] for i in bucket] for bucket in red.buckets]
    # fc2.weight is 4*16*4 = 256 bytes, fc1.bias 64, fc1.weight 512: a 600-byte cap
    assert plan == [["fc2.weight", "fc1.bias"], ["fc1.weight"]]


def test_whole_copies_are_what_modules_read(fake_pg):
    model = fczero.parallelize(
        TwoLayer(), init_device_mesh("cpu", (2,)), stage=2, mp_policy=fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    )
    with torch.no_grad():
        w = model.fc1.weight
    assert not isinstance(w, DTensor) and w.shape == (16, 8) and w.dtype == torch.bfloat16
    assert w is param_states.root_state(model).params[0].whole
    assert model.fc1._parameters["weight"].to_local().shape == (8, 8)  # still sharded


# --- options --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, 4, "2", 2.0, True])
def test_stage_that_does_not_exist(fake_pg, bad):
    model = TwoLayer()
    with pytest.raises(ValueError, match="does not exist"):
        fczero.parallelize(model, init_device_mesh("cpu", (2,)), stage=bad)
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing changed
    assert not fczero.is_parallelized(model)


def test_stage_is_an_option(fake_pg):
    assert inspect.signature(fczero.parallelize).parameters["stage"].default == 3
    with pytest.raises(TypeError, match="Did you mean 'stage'"):
        fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), stages=2)
