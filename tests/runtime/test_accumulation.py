"""Gradient accumulation: parity with one K-times-larger batch, graphs, recompiles, misuse.

Parity runs on 2 gloo ranks against ``parity.train_reference`` on the whole batches:
each rank splits its slice of a batch into K micro-batches and scales each loss by
1/K, so the reduced sum of their grads is the large batch's gradient. fp32 tolerances
as in test_numerics (rtol 1e-5, atol 1e-6): only the order of sums differs.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing import parity
from fczero.testing.distributed import gpu_world_size, run_on_ranks
from fczero.testing.graphs import collective_sequence
from tests.accumulation import accumulation_setup, train_accumulating
from tests.cases import REGATHER
from tests.models import TwoLayer, tiny_llama

FP32 = {"rtol": 1e-5, "atol": 1e-6}
REDUCES = ("reduce_scatter_tensor", "all_reduce")


CASES = [
    # (model, stage, backend, k, api)
    ("mlp", 1, None, 2, "context"),
    ("mlp", 2, None, 2, "flag"),
    ("mlp", 3, None, 2, "late"),
    ("llama", 3, None, 2, "context"),
    ("mlp", 1, "aot_eager", 2, "context"),
    ("mlp", 2, "aot_eager", 2, "late"),
    ("mlp", 3, "aot_eager_with_passes", 4, "flag"),
    ("llama", 3, "blocks:aot_eager", 2, "context"),  # each block compiled on its own
    # checkpointed blocks: the synced micro-batch's recompute reads no accumulated grad
    ("gqa", 3, None, 2, "context"),
    ("gqa", 3, "blocks:aot_eager", 2, "flag"),
    ("gqa", 3, "aot_eager_with_passes", 2, "context"),
]


def _run_cases(rank: int, world_size: int, cases: list, device_type: str = "cpu") -> list:
    out = []
    for case in cases:
        torch._dynamo.reset()
        out.append(train_accumulating(rank, world_size, *case, device_type=device_type))
    return out


@pytest.fixture(scope="module")
def traces() -> dict:
    per_rank = run_on_ranks(_run_cases, 2, CASES)
    return dict(zip(CASES, per_rank[0]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_accumulation_matches_one_large_batch(traces, case):
    trace, frames = traces[case]
    build, batches, criterion = accumulation_setup(case[0])
    expected = parity.train_reference(build, batches, criterion)
    parity.assert_close(trace, expected, **FP32)
    if case[2] is not None:
        # an unsynced and a synced graph (and the pieces the param_dtype-free model has),
        # compiled during the first step only: later steps reuse them
        assert frames[0] > 0
        assert frames[-1] == frames[0], f"recompiled after the first step: {frames}"
    if case == ("gqa", 3, "aot_eager_with_passes", 2, "context"):
        # checkpointed blocks: the synced micro-batch's bookkeeping inside each checkpoint
        # breaks no graph, so the whole model is one unsynced and one synced graph (it was
        # 6 frames, the forward falling back to eager around per-block graphs)
        assert frames[0] == 2, frames


GPU_CASES = [
    ("llama", 1, None, 2, "context"),
    ("llama", 2, "inductor", 2, "late"),
    ("llama", 3, "inductor", 2, "context"),
    # CUDA graphs: the accumulator's first grad leaves the graphs' pool ([Note: a grad kept
    # across CUDA-graph runs] in fczero/core/cuda_graphs.py); without that, the stage-3 case
    # raised "accessing tensor output of CUDAGraphs that has been overwritten" (one H100)
    ("llama", 1, "inductor-cudagraphs", 2, "flag"),
    ("llama", 2, "inductor-cudagraphs", 2, "late"),
    ("llama", 3, "inductor-cudagraphs", 2, "context"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_accumulation_matches_one_large_batch():
    """NCCL on 2 GPUs, or 1 rank on one GPU (the stage-1 reducer overlaps there);
    tolerances as in test_gpu."""
    per_rank = run_on_ranks(_run_cases, gpu_world_size(), GPU_CASES, "cuda", backend="nccl")
    for case, (trace, frames) in zip(GPU_CASES, per_rank[0]):
        build, batches, criterion = accumulation_setup(case[0])
        expected = parity.train_reference(build, batches, criterion, device="cuda")
        parity.assert_close(trace, expected, rtol=1e-4, atol=1e-5)
        assert frames[-1] == frames[0], (case, frames)


# --- graphs (fake process group: shapes and collectives only) ---------------------------


def _graphs(stage: int, sync: bool, **options):
    torch.manual_seed(0)
    if stage == 3:
        options.setdefault("comm_policy", REGATHER)  # the backward regather is what is looked at
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), stage=stage, **options)
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    fczero.set_requires_gradient_sync(model, sync)
    compiled(torch.randn(3, 8)).sum().backward()
    assert len(backend.fw_graphs) == 1 and len(backend.bw_graphs) == 1
    return collective_sequence(backend.fw_graphs[0]), collective_sequence(backend.bw_graphs[0])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unsynced_backward_graph_has_no_reduce(fake_pg, stage):
    fw, bw = _graphs(stage, sync=False)
    assert not any(op.startswith(REDUCES) for op in bw), bw
    if stage == 3:
        # stage 3 still gathers: in forward, and again in backward to recompute
        assert "all_gather_into_tensor[16, 8]" in fw
        assert any(op.startswith("all_gather_into_tensor") for op in bw)
    else:
        assert fw == [] and bw == []


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_synced_backward_graph_reduces(fake_pg, stage):
    _, bw = _graphs(stage, sync=True)
    expected = "all_reduce[16, 8]" if stage == 1 else "reduce_scatter_tensor[8, 8]"
    assert expected in bw, bw


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_synced_graph_after_accumulating_takes_the_sum(fake_pg, stage):
    """fullgraph: handing the accumulated sum to the synced step needs no graph break."""
    torch.manual_seed(0)
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), stage=stage)
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with fczero.no_sync(model):
        compiled(torch.randn(3, 8)).sum().backward()
    states = fczero.runtime.param_states.root_state(model).params
    assert all(s.acc is not None and s.acc.grad is not None for s in states)
    compiled(torch.randn(3, 8)).sum().backward()
    assert len(backend.fw_graphs) == 2 and len(backend.bw_graphs) == 2
    assert any(op.startswith(REDUCES) for op in collective_sequence(backend.bw_graphs[1]))
    assert all(s.acc is None for s in states)  # taken by the synced forward, then freed
    assert all(p.grad is not None for p in model.parameters())


def test_stage3_unsynced_forward_saves_no_unsharded_param(fake_pg):
    from fczero.testing.graphs import saved_unsharded

    torch.manual_seed(0)
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), comm_policy=REGATHER)
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with fczero.no_sync(model):
        compiled(torch.randn(3, 8)).sum().backward()
    assert saved_unsharded(backend.fw_graphs[0]) == []


# --- misuse -------------------------------------------------------------------------------


def test_step_with_unreduced_grads_is_refused(fake_pg):
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), stage=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    with fczero.no_sync(model):
        model(torch.randn(3, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="never reduced"):
        opt.step()
    for n, p in model.named_parameters():  # refused before anything changed
        torch.testing.assert_close(p.to_local(), before[n])


def test_toggle_inside_forward_is_refused(fake_pg):
    class Toggles(TwoLayer):
        def forward(self, x):
            fczero.set_requires_gradient_sync(self, False)
            return super().forward(x)

    model = fczero.parallelize(Toggles(), init_device_mesh("cpu", (2,)), stage=2)
    with pytest.raises(RuntimeError, match="inside a forward"):
        model(torch.randn(3, 8))
    assert fczero.runtime.param_states.root_state(model).sync is True  # unchanged


def test_bad_targets_and_values(fake_pg):
    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), stage=2)
    with pytest.raises(TypeError, match="True or False"):
        fczero.set_requires_gradient_sync(model, 0)
    with pytest.raises(ValueError, match="root module"):
        fczero.set_requires_gradient_sync(model.fc1, False)
    fczero.set_requires_gradient_sync(torch.compile(model), False)  # the wrapper is accepted
    assert fczero.runtime.param_states.root_state(model).sync is False
    with pytest.raises(ValueError, match="root module"), fczero.no_sync(TwoLayer()):
        pass


@pytest.mark.parametrize("keep", [0, None], ids=["regathered", "kept"])
def test_eager_accumulation_waits_for_every_gather(fake_pg, keep):
    """Every eager gather a module gets is waited (``collectives.settle``): a read through
    the accumulation path computed with a view of the gather, which never waited for it,
    so each micro-batch left its gathers in torch's registry of unwaited collectives (over
    NCCL: nothing ordered the compute after the gather, and their buffers stayed held)."""
    from torch._C._distributed_c10d import _get_work_registry_size

    kept = {} if keep is None else {"keep_unsharded": keep}
    policy = fczero.CommPolicy(prefetch=0, **kept)
    model = fczero.parallelize(tiny_llama(), init_device_mesh("cpu", (2,)), comm_policy=policy)
    tokens = torch.randint(0, 64, (2, 8))
    before = _get_work_registry_size()
    for _ in range(2):
        with fczero.no_sync(model):
            model(tokens).float().sum().backward()
        model(tokens).float().sum().backward()
    assert _get_work_registry_size() == before
