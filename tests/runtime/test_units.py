"""Units ([Note: units] in fczero/runtime/units.py): which modules are units, bad ``units``
refused before anything changes, and models whose reads depend on the data (experts
skipped on one rank only, a branch taken on one rank only) training on 2 gloo ranks like
one process, eager and compiled, with the first step's grads compared one by one; so do
grouped-query Llamas with tied embeddings and every block checkpointed (full, selective)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fczero
from fczero.models import Llama, LlamaConfig
from fczero.runtime.units import auto_unit_paths, unit_paths
from fczero.testing import parity
from fczero.testing.distributed import run_on_ranks
from tests.models import tiny_gqa, tiny_llama, token_batches
from tests.models.moe import (
    BranchModel,
    Expert,
    branch_batches,
    loop_moe,
    moe_batches,
    packed_moe,
)

FP32 = {"rtol": 1e-5, "atol": 1e-6}

_GQA_FULL = functools.partial(tiny_gqa, "full")
_GQA_SELECTIVE = functools.partial(tiny_gqa, "selective")
_TOKENS = functools.partial(token_batches, steps=3)

#: name -> (model for a rank, model for the one-process reference, batches, loss)
CASES = {
    "loop": (loop_moe, loop_moe, moe_batches, parity.cross_entropy),
    "packed": (packed_moe, packed_moe, moe_batches, parity.cross_entropy),
    "branch": (BranchModel, functools.partial(BranchModel, 2), branch_batches, parity.mse),
    "gqa-full": (_GQA_FULL, _GQA_FULL, _TOKENS, parity.cross_entropy),
    "gqa-selective": (_GQA_SELECTIVE, _GQA_SELECTIVE, _TOKENS, parity.cross_entropy),
}


def test_auto_units_are_the_blocks_and_each_owner_outside_them():
    # the blocks, not the experts inside them; outside them, each module with params of its own
    assert auto_unit_paths(loop_moe()) == ["embed", "layers.0", "layers.1", "head"]
    assert auto_unit_paths(tiny_llama()) == ["embed", "layers.0", "layers.1", "norm", "output"]
    assert unit_paths(loop_moe(), "auto") == ["", "embed", "layers.0", "layers.1", "head"]
    assert unit_paths(loop_moe(), None) == []


def test_named_units_are_found_by_module_or_class():
    model = loop_moe()
    paths = unit_paths(model, [Expert, model.layers[1]])
    outside = ["embed", "layers.0.norm", "layers.0.moe.router"]  # owners outside the named
    assert paths == ["", *outside, *[f"layers.0.moe.experts.{e}" for e in range(4)], "layers.1",
                     *[f"layers.1.moe.experts.{e}" for e in range(4)], "head"]  # fmt: skip


def test_auto_units_read_digits_in_names_as_names():
    """``layer1.0`` (ResNet's naming) and ``t5.encoder.block.1`` are blocks: a component is
    an index only when all of it is digits."""
    def block() -> nn.Module:  # owns no param itself: its linears do
        return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))

    model = nn.Sequential()
    model.add_module("t5", nn.ModuleDict({"layer1": nn.Sequential(block(), block())}))
    model.add_module("fc2", nn.Linear(2, 2))
    assert auto_unit_paths(model) == ["t5.layer1.0", "t5.layer1.1", "fc2"]


@pytest.mark.parametrize(
    "units, error, says",
    [
        ("blocks", ValueError, "units='blocks' is not an option"),
        ([3], TypeError, "must hold nn.Module instances or classes"),
        ([nn.Linear(2, 2)], ValueError, "not a submodule of the model"),
    ],
)
def test_bad_units_are_refused_before_any_param_changes(fake_pg, units, error, says):
    model = loop_moe()
    with pytest.raises(error, match=says):
        fczero.parallelize(model, init_device_mesh("cpu", (2,)), units=units)
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert not fczero.is_parallelized(model)


def test_a_unit_gathers_each_param_once_however_often_it_is_read(fake_pg):
    from fczero.testing.comm import CollectiveLog

    model = fczero.parallelize(packed_moe(), init_device_mesh("cpu", (2,)), units="auto")
    tokens = moe_batches()[0][0][:2]  # rank 0's rows: all four experts active
    with CollectiveLog() as log:
        model(tokens)
    # 12 params (embed, head; per layer norm weight and bias, router, up, down), each once
    assert log.count("all_gather_into_tensor") == 12


class _WrappedGather(torch.autograd.Function):
    """What an eager gather over NCCL hands over: an ``AsyncCollectiveTensor``."""

    @staticmethod
    def forward(ctx, shard):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        return AsyncCollectiveTensor(shard * 2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_gathers_wrapped_as_over_nccl_are_tied_too():
    """Over gloo the gathers are plain tensors; over NCCL they come wrapped, and the tie
    must hold for them as well: a grad for one param brings zeros for the unread one."""
    from fczero.runtime.units import together

    shards = [torch.randn(3, requires_grad=True) for _ in range(2)]
    read, unread = together([_WrappedGather.apply(s) for s in shards])
    assert type(read) is torch.Tensor and type(unread) is torch.Tensor
    read.sum().backward()
    torch.testing.assert_close(shards[0].grad, torch.full((3,), 2.0))
    torch.testing.assert_close(shards[1].grad, torch.zeros(3))  # reduced as zeros, not skipped


class _TwoOut(torch.autograd.Function):
    """Two outputs of one node, as an eager bucket hands out its members."""

    @staticmethod
    def forward(ctx, a, b):
        return a * 2, b * 2

    @staticmethod
    def backward(ctx, ga, gb):  # autograd materializes the grad an output did not get
        return ga * 2, gb * 2


def test_gathers_of_one_bucket_are_not_tied_again():
    """Members of one bucket share its node, which already brings zeros for the unread
    member: no second node around them ([Note: one node, one tie])."""
    from fczero.runtime.units import together

    shards = [torch.randn(3, requires_grad=True) for _ in range(2)]
    fulls = list(_TwoOut.apply(*shards))
    read, unread = together(fulls)
    assert read is fulls[0] and unread is fulls[1]
    read.sum().backward()
    torch.testing.assert_close(shards[1].grad, torch.zeros(3))
    apart = [s * 1 for s in shards]  # two nodes: tied into one
    assert all(a is not b for a, b in zip(together(apart), apart))


def _train_all(rank: int, world: int) -> dict:
    out = {}
    for name, (build, _, batches, criterion) in CASES.items():
        for backend in (None, "aot_eager"):
            torch._dynamo.reset()
            out[name, backend] = (
                parity.train_parallel(
                    rank, world, build, batches(), criterion, compile_backend=backend,
                    units="auto",
                ),
                _first_grads(rank, world, build, batches()[0], criterion, backend),
            )  # fmt: skip
    return out


def _first_grads(rank, world, build, batch, criterion, backend) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build()
    fczero.parallelize(model, init_device_mesh("cpu", (world,)), units="auto")
    step = torch.compile(model, backend=backend) if backend else model
    x, y = batch
    rows = x.shape[0] // world
    criterion(step(x[rank * rows : (rank + 1) * rows]), y[rank * rows : (rank + 1) * rows]).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def trained():
    return run_on_ranks(_train_all, 2)


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("name", list(CASES))
def test_data_dependent_reads_train_like_one_process(trained, name, backend):
    _, build_reference, batches, criterion = CASES[name]
    expected = parity.train_reference(build_reference, batches(), criterion)
    torch.manual_seed(0)
    reference = build_reference()
    x, y = batches()[0]
    criterion(reference(x), y).backward()
    for per_rank in trained:
        trace, grads = per_rank[name, backend]
        parity.assert_close(trace, expected, **FP32)
        assert grads.keys() == dict(reference.named_parameters()).keys()
        for param_name, param in reference.named_parameters():
            torch.testing.assert_close(grads[param_name], param.grad, **FP32, msg=param_name)


def _passed_graphs(units) -> list[list[str]]:
    from fczero.testing.backends import recording
    from fczero.testing.graphs import collective_sequence, saved_unsharded

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fczero.parallelize(
        tiny_llama(), init_device_mesh("cpu", (2,)), units=units,
        comm_policy=fczero.CommPolicy(keep_unsharded=0, bucket_bytes=8 * 1024),
    )  # fmt: skip
    graphs: list = []
    tokens = torch.randint(0, 64, (2, 16))
    torch.compile(model, backend=recording(graphs), fullgraph=True)(tokens).sum().backward()
    fw, bw = graphs
    return [collective_sequence(fw), collective_sequence(bw), saved_unsharded(fw)]


def test_compiled_graphs_after_the_passes_do_not_depend_on_units(fake_pg):
    """A unit's gathers are traced where it begins; the passes issue each where it is used
    and bucket in that order, so the compiled forward and backward issue the same
    collectives in the same order with units as without, and save no unsharded param."""
    with_units, without = _passed_graphs("auto"), _passed_graphs(None)
    assert with_units == without
    fw, _, saved = with_units
    assert len([c for c in fw if c.startswith("all_gather")]) >= 3 and saved == []


# ---- REUSE_BLOCKS: one compiled subgraph for every block ([Note: a block compiled once]) ----


def test_reuse_blocks_is_ignored_on_gpus_before_torch_2_13(monkeypatch, caplog):
    """It trained wrongly on torch 2.11 on GPUs (HF's Llama with its checkpointing): there it
    stays off, and says so; the CPU honours it."""
    from fczero.runtime import units

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with caplog.at_level(logging.WARNING, logger="fczero"):
        assert units._regions_work_on(torch.device("cuda", 0)) is False
        assert units._regions_work_on(torch.device("cpu")) is True
    assert "REUSE_BLOCKS is ignored on cuda with torch 2.11.0+cu130" in caplog.text
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    assert units._regions_work_on(torch.device("cuda", 0)) is True


def test_reused_blocks_keep_their_inputs(fake_pg, monkeypatch, caplog):
    """With REUSE_BLOCKS, ``parallelize`` turns off AOT autograd's donated buffers, and says
    so ([Note: a region's backward must not write over its inputs])."""
    import torch._functorch.config as functorch_config

    from fczero.runtime import units

    monkeypatch.setattr(units, "REUSE_BLOCKS", True)
    # (config.patch, not monkeypatch: on torch 2.11 monkeypatch's undo deletes the setting)
    with functorch_config.patch(donated_buffer=True):
        with caplog.at_level(logging.INFO, logger="fczero"):
            fczero.parallelize(_four_blocks(), init_device_mesh("cpu", (2,)))
        assert functorch_config.donated_buffer is False
    assert "donated_buffer=False" in caplog.text


def test_a_region_backward_under_inductor_needs_its_inputs_kept():
    """The torch behaviour behind the note, without fczero: an embedding, then three
    calls of one ``nested_compile_region``, compiled by Inductor. With donated buffers
    the embedding's grad is built in the buffer of the grad it reads (torch 2.11 and
    2.13); without them it matches eager. Fails when torch stops doing either."""
    import torch._functorch.config as functorch_config

    torch.manual_seed(0)
    emb = torch.nn.Parameter(torch.randn(32, 16) * 0.1)
    weights = [torch.nn.Parameter(torch.randn(16, 16) * 0.3) for _ in range(3)]

    def block(x, w):
        return x + torch.relu(x @ w.t())

    region = torch.compiler.nested_compile_region(block)

    def loss(tokens, fn):
        x = torch.nn.functional.embedding(tokens, emb)
        for w in weights:
            x = fn(x, w)
        return (x * x).sum()

    tokens = torch.randint(0, 32, (4, 8))  # (the grad of x fills as many floats as emb)
    expected = torch.autograd.grad(loss(tokens, block), emb)[0]
    errors = {}
    for donated in (True, False):
        torch._dynamo.reset()
        with (
            functorch_config.patch(donated_buffer=donated),
            torch._inductor.config.patch(force_disable_caches=True),
        ):
            compiled = torch.compile(lambda t: loss(t, region), backend="inductor", fullgraph=True)
            errors[donated] = (torch.autograd.grad(compiled(tokens), emb)[0] - expected).abs().max()
    assert errors[False] < 1e-4
    assert errors[True] > 1e-2


def _four_blocks() -> Llama:
    return Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_dim=40))


def _region_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The subgraph each ``invoke_subgraph`` call of ``gm`` runs, in order."""
    return [
        n.args[0].target
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph
    ]


def _block_graphs(monkeypatch, reuse: bool):
    """Dynamo's graph, then AOT's forward and backward after fczero's passes."""
    from fczero.runtime import units
    from fczero.testing.backends import recording

    monkeypatch.setattr(units, "REUSE_BLOCKS", reuse)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fczero.parallelize(_four_blocks(), init_device_mesh("cpu", (2,)))
    dynamo: list = []
    graphs: list = []
    after_passes = recording(graphs)

    def backend(gm, example_inputs):
        dynamo.append(gm)
        return after_passes(gm, example_inputs)

    tokens = torch.randint(0, 64, (2, 16))
    torch.compile(model, backend=backend, fullgraph=True)(tokens).sum().backward()
    (traced,) = dynamo
    fw, bw = graphs
    return traced, fw, bw


def _saved_bytes(fw: torch.fx.GraphModule) -> int:
    output = next(n for n in fw.graph.nodes if n.op == "output")
    vals = [a.meta.get("val") for a in output.args[0][1:] if isinstance(a, torch.fx.Node)]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def test_reused_blocks_compile_one_subgraph_with_the_gathers_outside(fake_pg, monkeypatch):
    """With REUSE_BLOCKS the 4 blocks call one subgraph (Dynamo's, then AOT's forward and
    backward); every collective stays in the outer graphs, which after the passes issue
    the same collectives as without regions and save the same bytes for backward (no
    unsharded param: backward regathers)."""
    from fczero.testing.graphs import collective_sequence, saved_unsharded

    traced, fw, bw = _block_graphs(monkeypatch, reuse=True)
    assert _region_calls(traced) == ["subgraph_0"] * 4
    for gm in (fw, bw):
        calls = _region_calls(gm)
        assert len(calls) == 4 and len(set(calls)) == 1
        assert collective_sequence(getattr(gm, calls[0])) == []  # none inside the region
    _, fw_plain, bw_plain = _block_graphs(monkeypatch, reuse=False)
    assert _region_calls(fw_plain) == []
    assert collective_sequence(fw) == collective_sequence(fw_plain)
    assert collective_sequence(bw) == collective_sequence(bw_plain)
    assert any(c.startswith("all_gather") for c in collective_sequence(bw))  # regathered
    assert len(saved_unsharded(fw)) == len(saved_unsharded(fw_plain))  # (names differ)
    assert _saved_bytes(fw) == _saved_bytes(fw_plain)


def _train_reused_blocks(rank: int, world: int):
    from fczero.runtime import units
    from fczero.testing.backends import recording

    units.REUSE_BLOCKS = True
    torch._dynamo.reset()
    graphs: list = []
    trace = parity.train_parallel(
        rank, world, _four_blocks, _TOKENS(), parity.cross_entropy,
        compile_backend=recording(graphs),
    )  # fmt: skip
    return trace, len(_region_calls(graphs[0]))


def test_reused_blocks_train_like_one_process():
    expected = parity.train_reference(_four_blocks, _TOKENS(), parity.cross_entropy)
    for trace, regions in run_on_ranks(_train_reused_blocks, 2):
        assert regions == 4
        parity.assert_close(trace, expected, **FP32)


class _Gathers(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the functional all-gathers and reduce-scatters issued."""

    def __init__(self) -> None:
        super().__init__()
        self.gathers = self.reduces = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        self.gathers += name.startswith("all_gather_into_tensor")
        self.reduces += name.startswith("reduce_scatter_tensor")
        return func(*args, **(kwargs or {}))


def _eager_counts(tie: bool) -> tuple[int, int, int]:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=40, tie_embeddings=tie)
    model = fczero.parallelize(Llama(cfg), init_device_mesh("cpu", (2,)))
    for _ in range(2):  # the second step replays the recorded, bucketed order
        with _Gathers() as counted:
            out = model(torch.randint(0, 64, (2, 8)))
            forward = counted.gathers
            out.float().pow(2).mean().backward()
    return forward, counted.gathers, counted.reduces


def test_a_tied_embedding_is_gathered_and_reduced_once_per_eager_step(fake_pg):
    """[Note: a param that two units read]: the head reads the embedding's gather, held to
    the end of the forward, instead of gathering the tied param again; its grad comes back
    through that one gather's reduce-scatter."""
    untied, tied = _eager_counts(tie=False), _eager_counts(tie=True)
    # untied: embedding, the two blocks, the final norm, the head; tied: no head gather
    assert tied[0] == untied[0] - 1, (tied, untied)
    assert tied[1] == untied[1] - 1 and tied[2] == untied[2] - 1, (tied, untied)
