"""Selective unsharding (``CommPolicy.keep_unsharded``): which blocks stay gathered, and that they
then skip the backward all-gather, eager and compiled, with unchanged numerics."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs, CompileCounterWithBackend
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.core import memory, unsharding
from fczero.core.spec import ShardSpec
from fczero.core.state import module_state, root_state
from fczero.core.unsharding import block_of
from fczero.testing import parity
from fczero.testing.comm import CollectiveLog
from fczero.testing.distributed import run_on_ranks
from fczero.testing.graphs import collective_sequence, saved_unsharded
from tests.accumulation import accumulation_setup, train_accumulating
from tests.models import ThreeBlocks, block_batches

BLOCK = (512 * 512 + 512) * 4  # one ThreeBlocks block (weight + bias), fp32
HEAD = 512 * 8 * 4


def _kept(model: torch.nn.Module) -> list[str]:
    return [
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        for name, state in getattr(module_state(module), "params", {}).items()
        if state.spec.keep_unsharded
    ]


def _last_two_kept(**comm) -> torch.nn.Module:
    """ThreeBlocks on a 2-rank mesh keeping its last two blocks (blocks.2 and the head)."""
    policy = fczero.CommPolicy(keep_unsharded=HEAD + BLOCK, **comm)
    return fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=policy)


def test_block_of_groups_indexed_containers():
    assert block_of("layers.3.attn.wq") == "layers.3"
    assert block_of("layers.12") == "layers.12"
    assert block_of("embed") == "embed"
    assert block_of("") == ""


@pytest.mark.parametrize(
    ("budget", "kept"),
    [
        (0, []),
        (HEAD - 1, []),  # the last block (the head) does not fit: nothing after it is kept
        (HEAD, ["head.weight"]),
        (HEAD + BLOCK - 1, ["head.weight"]),
        (HEAD + BLOCK, ["blocks.2.weight", "blocks.2.bias", "head.weight"]),
        (10 * BLOCK, [f"blocks.{i}.{n}" for i in range(3) for n in ("weight", "bias")] + ["head.weight"]),
    ],
)
def test_whole_blocks_are_kept_from_the_last_one_back(fake_pg, budget, kept):
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(keep_unsharded=budget))
    assert sorted(_kept(model)) == sorted(kept)


ALL = [f"blocks.{i}.{n}" for i in range(3) for n in ("weight", "bias")] + ["head.weight"]


@pytest.mark.parametrize(
    ("fake_pg", "kept"),
    [
        (1, ALL),  # one rank: the whole model is one shard
        (2, ["blocks.2.weight", "blocks.2.bias", "head.weight"]),  # 1.04 of 1.51 MiB
        (4, ["head.weight"]),  # 0.76 MiB: blocks.2 (1.00 MiB) does not fit
    ],
    indirect=["fake_pg"],
)
def test_the_default_keeps_one_shard_of_the_model(fake_pg, kept, caplog):
    """[Note: the default kept bytes]: the model's unsharded bytes over the world size."""
    with caplog.at_level("INFO", logger="fczero"):
        model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (fake_pg,)))
    assert sorted(_kept(model)) == sorted(kept)
    total = 3 * BLOCK + HEAD
    assert f"keep_unsharded='shard': {total / 2**20:.1f} MiB of unsharded params" in caplog.text


def test_the_default_counts_param_dtype_bytes(fake_pg):
    """bf16 params: what is kept is counted in the dtype a gather produces."""
    mp = fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), mp_policy=mp)
    plan = root_state(model).kept
    assert plan.budget == (3 * BLOCK + HEAD) // 2 // 2  # bf16 bytes over 2 ranks
    assert plan.kept_bytes == (BLOCK + HEAD) // 2
    assert sorted(_kept(model)) == ["blocks.2.bias", "blocks.2.weight", "head.weight"]


@pytest.mark.parametrize(
    "offload",
    [
        fczero.OffloadPolicy(params=True),
        fczero.OffloadPolicy(activations="all"),
        fczero.OffloadPolicy(activations="auto"),
    ],
)
def test_the_default_keeps_nothing_under_offload(fake_pg, offload, caplog):
    """Offload asks for the least device memory (and activation offload would move kept
    params to the host and back): the default keeps nothing, and says why."""
    with caplog.at_level("INFO", logger="fczero"):
        model = fczero.parallelize(
            ThreeBlocks(), init_device_mesh("cpu", (2,)), offload_policy=offload
        )
    assert _kept(model) == []
    plan = root_state(model).kept
    assert plan.budget == 0 and "with OffloadPolicy." in plan.source
    # an explicit number still keeps, offload or not
    model = fczero.parallelize(
        ThreeBlocks(),
        init_device_mesh("cpu", (2,)),
        offload_policy=offload,
        comm_policy=fczero.CommPolicy(keep_unsharded=HEAD),
    )
    assert _kept(model) == ["head.weight"]


@pytest.mark.parametrize("options", [{"stage": 1}, {"stage": 2}, {"reshard_after_forward": False}])
def test_the_default_is_accepted_where_every_param_stays_whole(fake_pg, options):
    """An explicit budget there is refused (below); the default simply has nothing to do."""
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), **options)
    assert _kept(model) == []


class Wrapped(torch.nn.Module):
    """ThreeBlocks one level down, with an input layer: ``model.embed`` and ``model.head``
    sit outside the indexed container and must not be kept (or dropped) together."""

    def __init__(self) -> None:
        super().__init__()
        self.model = ThreeBlocks()
        self.model.embed = torch.nn.Linear(512, 512, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(self.model.embed(x))


def test_modules_outside_containers_are_units_of_their_own(fake_pg):
    embed = 512 * 512 * 4
    model = fczero.parallelize(Wrapped(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(keep_unsharded=embed))
    # registration order: blocks.0-2, head, embed; the embed was registered last
    assert sorted(_kept(model)) == ["model.embed.weight"]
    budget = embed + HEAD + 2 * BLOCK  # one byte short of blocks.0 as well
    model = fczero.parallelize(Wrapped(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(keep_unsharded=budget))
    kept = ["model.embed.weight", "model.head.weight"]
    kept += [f"model.blocks.{i}.{n}" for i in (1, 2) for n in ("weight", "bias")]
    assert sorted(_kept(model)) == sorted(kept)


def test_keep_unsharded_without_resharding_is_refused(fake_pg):
    model = ThreeBlocks()
    with pytest.raises(ValueError, match="reshard_after_forward=False every param stays whole"):
        fczero.parallelize(
            model,
            init_device_mesh("cpu", (2,)),
            reshard_after_forward=False,
            comm_policy=fczero.CommPolicy(keep_unsharded=10**9),
        )
    assert not fczero.is_parallelized(model)
    assert _kept(fczero.parallelize(model, init_device_mesh("cpu", (2,)), reshard_after_forward=False)) == []


def test_bad_budget_is_refused_before_anything_changes(fake_pg):
    model = ThreeBlocks()
    with pytest.raises(ValueError, match="keep_unsharded=-1 is negative"):
        fczero.CommPolicy(keep_unsharded=-1)
    with pytest.raises(ValueError, match="keep_unsharded='1GB'; use a number of bytes .*'shard'"):
        fczero.CommPolicy(keep_unsharded="1GB")
    with pytest.raises(TypeError, match="keep_unsharded must be an int"):
        fczero.CommPolicy(keep_unsharded=1.5e9)
    with pytest.raises(ValueError, match="keep_unsharded=-1 is negative"):  # the old spelling
        with pytest.warns(DeprecationWarning):
            fczero.parallelize(model, init_device_mesh("cpu", (2,)), unsharded_budget=-1)
    assert not fczero.is_parallelized(model)


def test_eager_backward_regathers_only_what_is_not_kept(fake_pg):
    model = _last_two_kept(prefetch=0)  # no eager buckets: one regather per param
    loss = model(torch.randn(4, 512, requires_grad=True)).sum()
    with CollectiveLog() as bwd:
        loss.backward()
    # backward needs every weight for input grads; kept: blocks.2 and the head. Each unit
    # (a block) is regathered whole, its bias too: which params a rank saved may depend
    # on its data, the unit's params do not
    assert bwd.count("all_gather_into_tensor") == 4
    assert bwd.count("reduce_scatter_tensor") == 7


def test_compiled_forward_saves_the_kept_params_for_backward(fake_pg):
    model = _last_two_kept(compile_passes=False)
    backend = AotEagerAndRecordGraphs()
    x = torch.randn(4, 512, requires_grad=True)  # every weight is needed in backward
    torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
    fw, bw = backend.fw_graphs[0], backend.bw_graphs[0]
    assert len(saved_unsharded(fw)) == 2  # blocks.2.weight and head.weight (matmul operands)
    regathered = [op for op in collective_sequence(bw) if op.startswith("all_gather")]
    assert regathered == ["all_gather_into_tensor[512, 512]"] * 2  # blocks.0 and blocks.1


def _train(rank: int, world_size: int, backend: str | None) -> parity.Trace:
    return parity.train_parallel(
        rank,
        world_size,
        ThreeBlocks,
        block_batches(steps=3),
        parity.mse,
        compile_backend=backend,
        comm_policy=fczero.CommPolicy(keep_unsharded=HEAD + BLOCK),
    )


AUTO_BUDGET = 10**9


def _fake_peak(monkeypatch, headroom: int) -> None:
    """The allocator's peak, as if ``headroom`` bytes of ``AUTO_BUDGET`` were left."""
    monkeypatch.setattr(memory, "peak_allocated", lambda device: AUTO_BUDGET - headroom)


def _train_auto(rank: int, world_size: int, backend: str | None):
    """``keep_unsharded="auto"`` with a different headroom on each rank: rank 0's (the
    smaller) decides for both. Returns the trace and the blocks each plan kept."""
    headroom = HEAD + BLOCK + 100 if rank == 0 else 10 * BLOCK
    memory.peak_allocated = lambda device: AUTO_BUDGET - headroom
    plans = []
    plan_kept_params = unsharding.plan_kept_params

    def recording(*args, **kwargs):
        plan = plan_kept_params(*args, **kwargs)
        plans.append(plan.blocks)
        return plan

    unsharding.plan_kept_params = recording
    trace = parity.train_parallel(
        rank,
        world_size,
        ThreeBlocks,
        block_batches(steps=4),
        parity.mse,
        compile_backend=backend,
        comm_policy=fczero.CommPolicy(keep_unsharded="auto", prefetch=0),  # no eager buckets:
        memory_budget=AUTO_BUDGET,  # the regathers count params
    )
    unsharding.plan_kept_params = plan_kept_params
    return trace, plans


def _eager_and_compiled(rank: int, world_size: int) -> list:
    fixed = [_train(rank, world_size, None), _train(rank, world_size, "aot_eager")]
    return fixed + [_train_auto(rank, world_size, b) for b in (None, "aot_eager")]


@pytest.fixture(scope="module")
def trained():
    return run_on_ranks(_eager_and_compiled, 2)


def test_numerics_match_the_reference_eager_and_compiled(trained):
    eager, compiled, *_ = trained[0]
    expected = parity.train_reference(ThreeBlocks, block_batches(steps=3), parity.mse)
    parity.assert_close(eager, expected, rtol=1e-5, atol=1e-6)
    parity.assert_close(compiled, expected, rtol=1e-5, atol=1e-6)


def test_auto_plan_is_the_same_on_every_rank_and_keeps_numerics(trained):
    """Each rank measured another headroom: the smallest (rank 0's: the head and one
    block) decides on both, and training through the switch matches the reference."""
    expected = parity.train_reference(ThreeBlocks, block_batches(steps=4), parity.mse)
    for rank_results in trained:
        for trace, plans in rank_results[2:]:
            assert plans == [("blocks.2", "head")]
            parity.assert_close(trace, expected, rtol=1e-5, atol=1e-6)


def _sgd_steps(
    model, step_fn, steps: int, eager_regathers: bool = False
) -> tuple[list[int], list[list[str]]]:
    """Train ``steps`` steps; per step, the backward all-gathers and the kept params after it.
    ``eager_regathers``: count the eager regathers fczero issues (``ShardSpec.regather``)
    instead of all-gathers, which over one rank in eager are not issued at all ([Note: one
    rank communicates nothing in eager])."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    device = next(model.parameters()).device
    x = torch.randn(4, 512, device=device, requires_grad=True)  # backward needs every weight
    regathers, kept = [], []
    calls: list[int] = []
    original = ShardSpec.regather

    def counted(spec, param):
        calls.append(1)
        return original(spec, param)

    for _ in range(steps):
        loss = step_fn(x).sum()
        calls.clear()
        with CollectiveLog() as bwd, mock.patch.object(ShardSpec, "regather", counted):
            loss.backward()
        regathers.append(len(calls) if eager_regathers else bwd.count("all_gather_into_tensor"))
        optimizer.step()
        optimizer.zero_grad()
        kept.append(sorted(_kept(model)))
    return regathers, kept


LAST_TWO = sorted(["blocks.2.weight", "blocks.2.bias", "head.weight"])


def test_auto_plans_after_the_second_step_from_the_headroom(fake_pg, monkeypatch, caplog):
    _fake_peak(monkeypatch, HEAD + BLOCK + 100)
    model = fczero.parallelize(
        ThreeBlocks(),
        init_device_mesh("cpu", (2,)),
        comm_policy=fczero.CommPolicy(keep_unsharded="auto", prefetch=0),  # no eager buckets:
        memory_budget=AUTO_BUDGET,  # the regathers count params
    )
    assert "auto, planned after optimizer step 2 (0 so far)" in str(fczero.memory_report(model))
    with caplog.at_level("INFO", logger="fczero"):
        regathers, kept = _sgd_steps(model, model, 4)
    assert regathers == [7, 7, 4, 4]  # from step 3: blocks.2 and the head are kept
    report = str(fczero.memory_report(model))
    assert "selective unsharding: 2 blocks kept unsharded from forward to backward " in report
    assert "(blocks.2, head)" in report
    assert kept == [[], LAST_TWO, LAST_TWO, LAST_TWO]
    plan = root_state(model).auto_unsharding.plan
    assert plan.blocks == ("blocks.2", "head") and plan.kept_bytes == HEAD + BLOCK
    assert "auto after 2 steps" in plan.source
    assert "2 blocks kept unsharded" in caplog.text


def test_one_rank_counts_the_regathers_eager_makes(gloo_one_rank, monkeypatch):
    """Over one rank eager issues no all-gather, so counting collectives sees no regather;
    the regathers fczero makes are counted instead (as the one-GPU test does), and they
    follow the automatic plan as at two ranks."""
    _fake_peak(monkeypatch, HEAD + BLOCK + 100)
    counts = []
    for eager_regathers in (False, True):
        model = fczero.parallelize(
            ThreeBlocks(),
            init_device_mesh("cpu", (1,)),
            comm_policy=fczero.CommPolicy(keep_unsharded="auto", prefetch=0),
            memory_budget=AUTO_BUDGET,
        )
        counts.append(_sgd_steps(model, model, 4, eager_regathers)[0])
    assert counts == [[0, 0, 0, 0], [7, 7, 4, 4]]  # units: weights and biases


def test_auto_recompiles_once_with_the_kept_params(fake_pg, monkeypatch):
    _fake_peak(monkeypatch, HEAD + BLOCK)
    model = fczero.parallelize(
        ThreeBlocks(),
        init_device_mesh("cpu", (2,)),
        comm_policy=fczero.CommPolicy(keep_unsharded="auto", compile_passes=False),
        memory_budget=AUTO_BUDGET,
    )
    backend = AotEagerAndRecordGraphs()
    counter = CompileCounterWithBackend(backend)
    regathers, _ = _sgd_steps(model, torch.compile(model, backend=counter), 4)
    assert counter.frame_count == 2  # once pure stage 3, once with the kept params
    assert regathers == [4, 4, 2, 2]
    assert len(saved_unsharded(backend.fw_graphs[-1])) == 2  # blocks.2.weight, head.weight


@pytest.mark.parametrize(
    ("headroom", "memory_budget", "why"),
    [
        (HEAD - 1, AUTO_BUDGET, "nothing kept"),  # not even the head fits
        (-5, AUTO_BUDGET, "nothing kept"),  # the peak is over the budget already
        (None, AUTO_BUDGET, "no allocator peak on this device"),  # CPU: no peak counter
        (BLOCK, None, "no memory_budget"),  # CPU without a budget: unlimited, no plan
    ],
)
def test_auto_keeps_nothing_when_nothing_fits_or_nothing_is_measured(
    fake_pg, monkeypatch, caplog, headroom, memory_budget, why
):
    if headroom is not None:
        _fake_peak(monkeypatch, headroom)
    model = fczero.parallelize(
        ThreeBlocks(),
        init_device_mesh("cpu", (2,)),
        comm_policy=fczero.CommPolicy(keep_unsharded="auto", prefetch=0),
        memory_budget=memory_budget,
    )
    with caplog.at_level("INFO", logger="fczero"):
        regathers, kept = _sgd_steps(model, model, 3)
    assert regathers == [7, 7, 7] and kept == [[], [], []]
    assert why in caplog.text


def test_eager_accumulation_gathers_kept_params_once(fake_pg):
    """K micro-batches: the kept blocks (blocks.2 and the head) are gathered by the first
    micro-batch's forward only; the others in every forward (and again in backward)."""
    model = _last_two_kept(prefetch=0)  # no eager buckets: one regather per param
    x = torch.randn(4, 512, requires_grad=True)
    forwards = []
    with fczero.no_sync(model):
        for _ in range(2):
            with CollectiveLog() as fwd:
                loss = model(x).sum()
            loss.backward()
            forwards.append(fwd.count("all_gather_into_tensor"))
    with CollectiveLog() as fwd:
        loss = model(x).sum()
    forwards.append(fwd.count("all_gather_into_tensor"))
    with CollectiveLog() as bwd:
        loss.backward()
    assert forwards == [7, 4, 4]  # 7 params; the 3 kept ones gathered once
    assert bwd.count("all_gather_into_tensor") == 4  # blocks.0, blocks.1 (units, whole)
    assert bwd.count("reduce_scatter_tensor") == 7
    # a new accumulation gathers the kept params again, and so does a micro-batch after
    # the shards changed in place within one
    with fczero.no_sync(model):
        with CollectiveLog() as first:
            model(x).sum().backward()
        with torch.no_grad():
            model.head._parameters["weight"].add_(1.0)  # the sharded param, in place
        with CollectiveLog() as changed:
            model(x).sum().backward()
    assert first.count("all_gather_into_tensor") == 7 + 4  # forward, then backward regathers
    assert changed.count("all_gather_into_tensor") == 4 + 1 + 4  # and the head again


def test_compiled_accumulation_gathers_kept_params_once(fake_pg):
    """Compiled, 3 micro-batches with sync off and a synced one: three graphs (the first
    micro-batch's gathers every param and hands the kept ones back; the later ones take
    them as inputs), none compiled again in the next step."""
    model = _last_two_kept(compile_passes=False)
    backend = AotEagerAndRecordGraphs()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter)
    x = torch.randn(4, 512, requires_grad=True)
    frames = []
    for _ in range(2):
        with fczero.no_sync(model):
            for _ in range(3):
                compiled(x).sum().backward()
        compiled(x).sum().backward()
        frames.append(counter.frame_count)
    assert frames == [3, 3]
    gathers = [
        [op for op in collective_sequence(g) if op.startswith("all_gather")]
        for g in backend.fw_graphs
    ]
    block = ["all_gather_into_tensor[512, 512]", "all_gather_into_tensor[512]"]
    not_kept = block * 2  # blocks.0 and blocks.1
    first = not_kept + block + ["all_gather_into_tensor[8, 512]"]  # and blocks.2, head
    assert gathers == [first, not_kept, not_kept]


def _accumulate(rank: int, world_size: int) -> list[parity.Trace]:
    return [
        train_accumulating(
            rank, world_size, "llama", 3, backend, 2, "context", comm_policy=fczero.CommPolicy(keep_unsharded=10**9)
        )[0]
        for backend in (None, "aot_eager")
    ]


def test_accumulation_with_kept_params_matches_one_large_batch():
    """Every param kept, 2 micro-batches a step, 3 steps, eager and compiled: the reused
    gathers must follow the optimizer's updates."""
    eager, compiled = run_on_ranks(_accumulate, 2)[0]
    expected = parity.train_reference(*accumulation_setup("llama"))
    parity.assert_close(eager, expected, rtol=1e-5, atol=1e-6)
    parity.assert_close(compiled, expected, rtol=1e-5, atol=1e-6)


def _auto_on_cuda(rank: int, world_size: int, memory_budget: int):
    """Four steps with the CUDA allocator's real peak; per step, the backward regathers."""
    torch.manual_seed(0)
    model = fczero.parallelize(
        ThreeBlocks().cuda(),
        init_device_mesh("cuda", (world_size,)),
        comm_policy=fczero.CommPolicy(keep_unsharded="auto", prefetch=0),
        memory_budget=memory_budget,
    )
    regathers, kept = _sgd_steps(model, model, 4, eager_regathers=True)
    plan = root_state(model).auto_unsharding.plan
    return regathers, kept[-1], plan.blocks, plan.source, torch.cuda.max_memory_allocated()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_reads_the_allocator_peak():
    """A budget far above the step's peak keeps every block; one below it keeps none."""
    from fczero.testing.distributed import gpu_world_size

    ranks = gpu_world_size()
    roomy = run_on_ranks(_auto_on_cuda, ranks, 2**32, backend="nccl")
    tight = run_on_ranks(_auto_on_cuda, ranks, 2**20, backend="nccl")
    everything = sorted(f"blocks.{i}.{n}" for i in range(3) for n in ("weight", "bias"))
    for regathers, kept, blocks, source, peak in roomy:
        # two steps of pure stage 3, then every param kept; the calls the first two make
        # depend on the ranks (4 a step on 2 GPUs, 7 on one H200, torch 2.11)
        assert regathers[0] == regathers[1] > 0 and regathers[2:] == [0, 0], source
        assert kept == sorted([*everything, "head.weight"])
        assert blocks == ("blocks.0", "blocks.1", "blocks.2", "head")
        assert 2**20 < peak < 2**32  # what the plan read: a real, plausible peak
    for regathers, kept, blocks, source, _ in tight:
        assert regathers == [roomy[0][0][0]] * 4 and kept == [] and blocks == (), source


class TiedEnds(torch.nn.Module):
    """An input layer whose weight the output layer reads again (tied), around three
    blocks: the shared weight is read first and last in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(512, 512, bias=False)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(3))
        self.out = torch.nn.Linear(512, 512, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.out(x)


def test_a_shared_weight_is_kept_where_it_is_read_last(fake_pg):
    """[Note: a shared param is kept where it is read last]: the tied weight comes first
    in line (the head's backward opens backward), ahead of the last block, and its
    backward regather is gone."""
    tied = 512 * 512 * 4
    policy = fczero.CommPolicy(keep_unsharded=tied, prefetch=0)
    model = fczero.parallelize(TiedEnds(), init_device_mesh("cpu", (2,)), comm_policy=policy)
    assert sorted(_kept(model)) == ["inp.weight", "out.weight"]  # one param, two owners
    assert root_state(model).kept.blocks == ("out",)
    loss = model(torch.randn(4, 512, requires_grad=True)).sum()
    with CollectiveLog() as bwd:
        loss.backward()
    assert bwd.count("all_gather_into_tensor") == 3 * 2  # the blocks' weights and biases only
    # a budget for the last block and the tied weight keeps both
    policy = fczero.CommPolicy(keep_unsharded=tied + BLOCK)
    model = fczero.parallelize(TiedEnds(), init_device_mesh("cpu", (2,)), comm_policy=policy)
    assert root_state(model).kept.blocks == ("blocks.2", "out")
