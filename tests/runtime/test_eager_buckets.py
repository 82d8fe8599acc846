"""Eager bucketing (``fczero/runtime/eager_buckets.py``): from the second forward on, consecutive
gathers go out as one all-gather and their grads come back through one reduce-scatter,
with numerics unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.core.state import module_state, root_state
from fczero.runtime import eager_buckets
from fczero.testing import parity
from fczero.testing.comm import CollectiveLog
from fczero.testing.distributed import run_on_ranks
from tests.models import ThreeBlocks, UnevenTiedMLP, block_batches, tiny_llama, token_batches

BLOCK = (512 * 512 + 512) * 4  # one ThreeBlocks block (weight + bias), fp32


def _step_log(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    x = torch.randn(4, 512, requires_grad=True)
    with CollectiveLog() as fwd:
        loss = model(x).sum()
    with CollectiveLog() as bwd:
        loss.backward()
    return fwd.ops, bwd.ops


@pytest.mark.parametrize(
    ("bucket_bytes", "forward", "reduces", "regathers"),
    [
        # the default: a bucket per unit (each block, the head), never across units
        (128 * 2**20, 4, 4, 4),
        (BLOCK + 16384, 4, 4, 4),  # a block fits; the head (16 KiB) stays in its own unit
        # a weight and its bias no longer fit: each param alone, forward and backward (a
        # unit's regather is then its params one by one)
        (BLOCK - 1, 7, 7, 7),
    ],
)
def test_collectives_per_bucket(fake_pg, bucket_bytes, forward, reduces, regathers):
    """Backward regathers the blocks and the head, each unit whole (bucketed along the
    saved order, from the first step); forward gathers and reduces are bucketed from the
    second."""
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(bucket_bytes=bucket_bytes, keep_unsharded=0))
    first_fwd, first_bwd = _step_log(model)  # records the order: one gather per param
    assert first_fwd.count("all_gather_into_tensor") == 7
    assert first_bwd.count("reduce_scatter_tensor") == 7
    assert first_bwd.count("all_gather_into_tensor") == regathers
    for _ in range(2):
        fwd, bwd = _step_log(model)
        assert fwd.count("all_gather_into_tensor") == forward
        assert bwd.count("reduce_scatter_tensor") == reduces
        assert bwd.count("all_gather_into_tensor") == regathers


def test_no_buckets_without_prefetch_or_bucket_bytes(fake_pg):
    for options in (
        fczero.CommPolicy(prefetch=0, keep_unsharded=0),
        fczero.CommPolicy(bucket_bytes=0, keep_unsharded=0),
    ):
        model = fczero.parallelize(
            ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=options
        )
        _step_log(model)
        fwd, bwd = _step_log(model)
        assert fwd.count("all_gather_into_tensor") == 7, options
        assert bwd.count("reduce_scatter_tensor") == 7, options
        assert bwd.count("all_gather_into_tensor") == 7, options  # units: biases too


def test_plan_follows_bytes_and_leaves_checkpointed_gathers_alone(fake_pg):
    """UnevenTiedMLP's recorded gathers: inp.weight (260 bytes), inp.bias (52),
    hidden.weight (364), hidden.bias (28), frozen.weight (196), out.weight (140), out.bias
    (20), back.weight (the tied inp.weight again, 260). The 0-d ``scale`` is replicated,
    never gathered, so it is not in the order."""
    model = fczero.parallelize(UnevenTiedMLP(), init_device_mesh("cpu", (2,)), units=None)
    model(torch.randn(4, 5)).sum().backward()
    order = root_state(model).prefetch.order
    assert [spec.unsharded_bytes(p) for spec, p, _ in order] == [260, 52, 364, 28, 196, 140, 20, 260]
    assert eager_buckets.plan(order, 10**9) == [list(range(8))]
    # 312 bytes: runs close when the next gather would not fit; runs of one are no bucket
    assert eager_buckets.plan(order, 312) == [[0, 1], [3, 4], [5, 6]]
    in_place = [(s, p, i == 4) for i, (s, p, _) in enumerate(order)]  # a checkpointed gather
    assert eager_buckets.plan(in_place, 10**9) == [[0, 1, 2, 3], [5, 6, 7]]
    assert eager_buckets.plan(order, 1) == []
    # with units (the default) no bucket crosses a unit's edge: here each module is a unit
    # ([Note: a bucket never spans two units])
    units = fczero.parallelize(UnevenTiedMLP(), init_device_mesh("cpu", (2,)))
    units(torch.randn(4, 5)).sum().backward()
    assert eager_buckets.plan(root_state(units).prefetch.order, 10**9) == [[0, 1], [2, 3], [5, 6]]


def _train(rank: int, world_size: int) -> list[parity.Trace]:
    small = {"comm_policy": fczero.CommPolicy(bucket_bytes=700)}  # cuts inside modules: many buckets of 2-3 gathers
    return [
        parity.train_parallel(rank, world_size, UnevenTiedMLP, _mlp_batches(), parity.mse),
        parity.train_parallel(rank, world_size, UnevenTiedMLP, _mlp_batches(), parity.mse, **small),
        parity.train_parallel(
            rank, world_size, tiny_llama, token_batches(steps=4), parity.cross_entropy,
            optimizer="adamw", lr=1e-3, comm_policy=fczero.CommPolicy(bucket_bytes=40_000),
        ),  # fmt: skip
        parity.train_parallel(rank, world_size, ThreeBlocks, block_batches(steps=4), parity.mse),
    ]


def _mlp_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 5, generator=g), torch.randn(8, 13, generator=g)) for _ in range(4)]


def test_bucketed_training_matches_the_reference():
    """Four steps (three of them bucketed) on 2 gloo ranks: uneven shards, a tied weight,
    a 0-d and a frozen param, buckets cut inside modules, Llama with AdamW."""
    mlp, mlp_small, llama, blocks = run_on_ranks(_train, 2)[0]
    expected_mlp = parity.train_reference(UnevenTiedMLP, _mlp_batches(), parity.mse)
    parity.assert_close(mlp, expected_mlp, rtol=1e-5, atol=1e-6)
    parity.assert_close(mlp_small, expected_mlp, rtol=1e-5, atol=1e-6)
    expected = parity.train_reference(
        tiny_llama, token_batches(steps=4), parity.cross_entropy, optimizer="adamw", lr=1e-3
    )
    parity.assert_close(llama, expected, rtol=1e-5, atol=1e-6)
    expected = parity.train_reference(ThreeBlocks, block_batches(steps=4), parity.mse)
    parity.assert_close(blocks, expected, rtol=1e-5, atol=1e-6)


def test_a_bucket_waits_once_and_hands_each_member_out_once(fake_pg):
    """[Note: plain bucket slices], [Note: coalesced, not flat]: a bucket is one coalesced
    all-gather whose outputs (one per member, each registered on its own) are plain
    tensors, waited when the first member is asked for (whichever it is); every member
    then has storage of its own, holds the param's values, and is handed out once."""
    from fczero.testing.distributed import pending_collectives

    model = fczero.parallelize(ThreeBlocks(dim=64), init_device_mesh("cpu", (2,)))
    members = [
        (state.spec, model.blocks[0]._parameters[name])
        for name, state in module_state(model.blocks[0]).params.items()
    ]
    before = pending_collectives()
    with CollectiveLog() as log:
        bucket = eager_buckets.gather_bucket(members)
    assert log.count("all_gather_into_tensor") == 1
    assert pending_collectives() == before + len(members)
    with CollectiveLog() as log:
        last = bucket.member(len(members) - 1)  # the last member first: it waits for the bucket
    assert log.ops == []  # the hand-off issues nothing
    assert pending_collectives() == before
    fulls = [bucket.member(k) for k in range(len(members) - 1)] + [last]
    storages = {full.untyped_storage().data_ptr() for full in fulls}
    assert len(storages) == len(members)
    for (spec, param), full in zip(members, fulls):
        assert type(full) is torch.Tensor and full.shape == spec.shape
        # on the fake process group only this rank's rows are real: they must be the shard
        local = param.to_local()
        torch.testing.assert_close(full[: local.shape[0]], local, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="handed out twice"):
        bucket.member(0)
    bucket = eager_buckets.gather_bucket(members)  # never used: settle waits for it
    bucket.settle()
    assert pending_collectives() == before


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bucket_grads_are_the_per_param_reduce(world):
    """One bucket's backward (grads cast and padded, averaged, one coalesced
    reduce-scatter) gives each shard the grad that a per-param gather's backward gives:
    uneven rows, padding, bf16 compute with fp32 reduce."""
    assert run_on_ranks(_bucket_vs_single_grads, world) == [True] * world


def _bucket_vs_single_grads(rank: int, world: int) -> bool:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same weights on every rank, however the rank was started
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    mp = fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fczero.parallelize(model, mesh, mp_policy=mp)
    members = [
        (state.spec, sub._parameters[name])
        for sub in model
        for name, state in module_state(sub).params.items()
    ]
    g = torch.Generator().manual_seed(rank)
    upstream = [torch.randn(spec.shape, generator=g).to(torch.bfloat16) for spec, _ in members]
    bucket = eager_buckets.gather_bucket(members)
    fulls = [bucket.member(k) for k in range(len(members))]
    torch.autograd.backward(fulls, upstream)
    bucketed = [p.grad.to_local().clone() for _, p in members]
    for _, p in members:
        p.grad = None
    singles = [spec.gather(p.to_local()) for spec, p in members]
    torch.autograd.backward([s.wait() if hasattr(s, "wait") else s for s in singles], upstream)
    ok = all(
        torch.equal(b, p.grad.to_local()) and torch.equal(f, s)
        for b, (_, p), f, s in zip(bucketed, members, fulls, singles)
    )
    return ok


def _one_rank_bucket(mp: fczero.MixedPrecisionPolicy | None) -> tuple[list, list[torch.Tensor]]:
    """Two 5 x 5 weights and a bias of one model over one rank, issued as one bucket:
    ``(members, their unsharded params)``."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 5, bias=False), torch.nn.Linear(5, 5))
    fczero.parallelize(model, init_device_mesh("cpu", (1,)), mp_policy=mp)
    members = [
        (state.spec, sub._parameters[name])
        for sub in model
        for name, state in module_state(sub).params.items()
    ]
    bucket = eager_buckets.gather_bucket(members)
    return members, [bucket.member(k) for k in range(len(members))]


def test_one_rank_bucket_backward_casts_each_grad_once(gloo_one_rank):
    """[Note: a bucket of one rank], backward: with nothing to reduce, the bucket's backward
    is one cast per member (bf16 grads to the fp32 reduce dtype, which is the shards'),
    with no flat buffer laid out and split again (a ``cat``, then a slice and a view per
    member), and each shard gets its grad exactly."""
    mp = fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    members, fulls = _one_rank_bucket(mp)
    g = torch.Generator().manual_seed(0)
    upstream = [torch.randn(f.shape, generator=g).bfloat16() for f in fulls]
    with _OpCount() as ops:
        grads = torch.autograd.grad(fulls, [p for _, p in members], upstream)
    assert ops.counts == {"_to_copy": len(members)}
    for grad, want, (_, param) in zip(grads, upstream, members):
        assert grad.dtype == torch.float32 and grad.placements == param.placements
        assert torch.equal(grad.to_local(), want.float())


def test_one_rank_bucket_grads_never_share_storage(gloo_one_rank):
    """Autograd may hand one tensor to several outputs (the grads of ``a + b``); over one
    rank, where nothing copies grads into a reduce buffer, each param still gets a grad
    of its own, also when no cast is needed."""
    members, fulls = _one_rank_bucket(None)
    upstream = torch.ones(5, 5)  # contiguous: AddBackward hands this one tensor to both
    (fulls[0] + fulls[1]).backward(upstream)
    g0, g1 = (p.grad.to_local() for _, p in members[:2])
    assert torch.equal(g0, upstream) and torch.equal(g1, upstream)
    assert len({g0.data_ptr(), g1.data_ptr(), upstream.data_ptr()}) == 3
    g0.add_(1)  # (what an in-place clip or optimizer does to one grad)
    assert torch.equal(g1, upstream)


class _OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts every op dispatched below autograd, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("blocks", [2, 6])
@pytest.mark.parametrize("bf16", [False, True])
def test_per_step_copies_follow_buckets_not_params(fake_pg, blocks, bf16):
    """No per-step work grows with the params where a per-bucket op would do
    ([Note: coalesced, not flat]). A model of N blocks, one bucket per block (2 params
    each), in a bucketed eager step: one collective per bucket, no copy out of a gathered
    buffer, no clone or copy; a shard already in the gathered dtype is its own all-gather input,
    one cast to it takes one ``_foreach_copy_`` per bucket, and so does each reduced
    bucket's grads (the fake group divides them in place, so they are copied first)."""

    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(blocks))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.relu(block(x))
            return x

    block_bytes = (16 * 16 + 16) * (2 if bf16 else 4)
    mp = fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fczero.parallelize(
        Blocks(),
        init_device_mesh("cpu", (2,)),
        comm_policy=fczero.CommPolicy(bucket_bytes=block_bytes, keep_unsharded=0),
        mp_policy=mp if bf16 else None,
    )
    model(torch.randn(4, 16)).sum().backward()  # the first step records the order
    with _OpCount() as ops:
        model(torch.randn(4, 16)).sum().backward()
    c = ops.counts
    # forward: a bucket per block; backward regathers each block whose weight is saved
    # (the first block's is not: its input needs no grad), whole (a unit), one bucket each
    gathers = blocks + (blocks - 1)
    assert c["all_gather_into_tensor_coalesced"] == gathers
    assert c["reduce_scatter_tensor_coalesced"] == blocks
    assert "all_gather_into_tensor" not in c and "reduce_scatter_tensor" not in c
    assert c["wait_tensor"] == 2 * (gathers + blocks)  # each member's output, once
    assert c.get("_foreach_copy_", 0) == (gathers if bf16 else 0) + blocks
    # (``copy_``: a leaf's ``AccumulateGrad`` copies a grad that something else refers to)
    for op in ("split_with_sizes_copy", "cat", "_chunk_cat", "clone", "copy_"):
        assert c.get(op, 0) == 0, op


def _autograd_nodes(loss: torch.Tensor) -> list:
    """Every node of ``loss``'s autograd graph, each once."""
    nodes, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return nodes


def test_a_bucket_is_one_autograd_node_over_its_members(fake_pg):
    """The bucket's node takes the members' leaves as its inputs: no node per member
    between them (what ``_EagerLocal`` would add), and the grads the params get are
    DTensors laid out like them."""
    model = fczero.parallelize(
        ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(bucket_bytes=BLOCK + 16384)
    )
    x = torch.randn(4, 512)
    model(x).sum().backward()  # the first step records the order
    loss = model(x).sum()
    names = [type(node).__name__ for node in _autograd_nodes(loss)]
    assert names.count("_BucketGatherBackward") == 3  # a bucket per block (head in blocks.2's)
    assert "_EagerLocalBackward" not in names
    loss.backward()
    params = dict(model.named_parameters())
    assert all(isinstance(p.grad, torch.distributed.tensor.DTensor) for p in params.values())
    assert all(p.grad.placements == p.placements for p in params.values())


@pytest.mark.parametrize("bf16", [False, True])
def test_one_rank_eager_issues_no_collective(gloo_one_rank, bf16):
    """[Note: one rank communicates nothing in eager] and [Note: a bucket of one rank]:
    over one rank an eager step (first, recording, and bucketed after it; forward,
    backward regathers and reduces) issues no collective, and its grads are the plain
    model's: in fp32, and with bf16 params and fp32 reduces against the plain model cast
    to bf16 (each member copied once, cast, from its shard)."""
    torch.manual_seed(0)
    ref = ThreeBlocks()
    mp = fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fczero.parallelize(
        copy.deepcopy(ref),
        init_device_mesh("cpu", (1,)),
        comm_policy=fczero.CommPolicy(bucket_bytes=BLOCK + 16384),
        mp_policy=mp if bf16 else None,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(4, 512)
        with CollectiveLog() as log:
            model(x).sum().backward()
        assert log.ops == []
        if bf16:
            low = copy.deepcopy(ref).bfloat16()
            low(x.bfloat16()).sum().backward()
            expected = [p.grad.float() for p in low.parameters()]
        else:
            ref(x).sum().backward()
            expected = [p.grad for p in ref.parameters()]
        for (name, p), want in zip(model.named_parameters(), expected):
            assert isinstance(p.grad, torch.distributed.tensor.DTensor), name
            torch.testing.assert_close(p.grad.full_tensor(), want, rtol=0, atol=0, msg=name)
        if bf16:  # the plain model steps on the grads fczero reduced (the same values)
            for p, want in zip(ref.parameters(), expected):
                p.grad = want.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)


def test_eager_grads_land_on_the_leaves(gloo_one_rank):
    """[Note: eager grads land on the leaf too]: a bucket's autograd node takes each
    member's plain leaf, so AccumulateGrad never sees a DTensor; each param still gets a
    DTensor grad of its spec (accumulated over two backwards). A param frozen after
    ``parallelize`` is gathered through the DTensor and gets no grad."""
    torch.manual_seed(0)
    ref = ThreeBlocks()
    model = fczero.parallelize(
        copy.deepcopy(ref),
        init_device_mesh("cpu", (1,)),
        comm_policy=fczero.CommPolicy(bucket_bytes=BLOCK + 16384),
    )
    dict(model.named_parameters())["blocks.1.bias"].requires_grad_(False)  # the sharded param
    ref.blocks[1].bias.requires_grad_(False)
    x = torch.randn(4, 512)
    model(x).sum().backward()  # records the order
    model.zero_grad(set_to_none=True)
    loss = model(x).sum()
    variables = [node.variable for node in _autograd_nodes(loss) if hasattr(node, "variable")]
    states = root_state(model).params
    leaves = {id(s.leaf) for s in states if s.param.requires_grad}
    assert variables and all(id(v) in leaves for v in variables)
    assert not any(isinstance(v, torch.distributed.tensor.DTensor) for v in variables)
    loss.backward()
    model(x).sum().backward()  # a second backward without zero_grad accumulates
    for _ in range(2):
        ref(x).sum().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        if not p.requires_grad:
            assert p.grad is None, name
            continue
        assert isinstance(p.grad, torch.distributed.tensor.DTensor), name
        assert p.grad.placements == p.placements
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-6, atol=1e-6)
    assert all(s.leaf.grad is None for s in states)  # handed over, not kept twice


def test_issue_bytes_counts_a_whole_bucket_at_each_member():
    bucket = [1, 2]
    assert eager_buckets.issue_bytes([1, 2, 3, 4], {1: bucket, 2: bucket}) == [1, 5, 5, 4]
    assert eager_buckets.issue_bytes([7], {}) == [7]


class _OpSequence(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op dispatched below autograd, by name (a coalesced collective under the name
    of the one it coalesces), in order; with ``with_storage``, each collective with the
    storages of the tensors it produces, and each wait and add with the storage it reads."""

    def __init__(self, with_storage: bool = False) -> None:
        super().__init__()
        self.names: list[str] = []
        self.events: list[tuple[str, tuple[int, ...]]] = []
        self._with_storage = with_storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1].removesuffix("_coalesced")
        out = func(*args, **(kwargs or {}))
        self.names.append(name)
        if self._with_storage:
            read = {"wait_tensor": args[0], "add_": args[-1]}.get(name)
            tensors = [read] if read is not None else out if name in _COLLECTIVES else []
            self.events.append((name, tuple(t.untyped_storage().data_ptr() for t in tensors)))
        return out


_COLLECTIVES = ("reduce_scatter_tensor", "all_gather_into_tensor")


class _TwoLinearBlocks(torch.nn.Module):
    """Four blocks of two Linear(16, 16) each: a unit of two buckets at one Linear's bytes."""

    LINEAR = (16 * 16 + 16) * 4

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
            for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _bucketed_two_linear_blocks() -> torch.nn.Module:
    policy = fczero.CommPolicy(bucket_bytes=_TwoLinearBlocks.LINEAR, keep_unsharded=0)
    model = fczero.parallelize(_TwoLinearBlocks(), init_device_mesh("cpu", (2,)), comm_policy=policy)
    model(torch.randn(4, 16)).sum().backward()  # the first step records the order
    model.zero_grad(set_to_none=True)
    return model


def test_the_next_unit_goes_out_whole(fake_pg):
    """A unit of two buckets, with a window of one: when a block begins to compute, both
    buckets of the block after it are in flight ([Note: the next unit goes out whole]),
    not only the first (the second would be issued and waited for when that block begins)."""
    model = _bucketed_two_linear_blocks()
    with _OpSequence() as ops:
        model(torch.randn(4, 16)).sum()
    gathers_before_block = []
    gathers = 0
    matmuls = 0
    for name in ops.names:
        if name == "all_gather_into_tensor":
            gathers += 1
        elif name in ("addmm", "mm"):
            if matmuls % 2 == 0:  # a block's first matmul
                gathers_before_block.append(gathers)
            matmuls += 1
    assert gathers == 8  # two buckets a block
    assert gathers_before_block == [4, 6, 8, 8]


def test_a_units_reduces_stay_in_flight_until_the_next_units(fake_pg):
    """Backward waits for a block's reduce-scatters only after the block before it has
    computed its grads and issued its own, and for the last block's when it ends: one
    unit's reduces in flight at a time, none left after backward ([Note: a reduce-scatter
    left in flight]). A block's two buckets reduce back to back, so waiting for the first
    when the second issues would stall the compute stream for it."""
    from fczero.testing.distributed import pending_collectives

    model = _bucketed_two_linear_blocks()
    loss = model(torch.randn(4, 16)).sum()
    with _OpSequence(with_storage=True) as ops:
        loss.backward()
    assert pending_collectives() == 0
    events = ops.events
    reduces = [(i, keys) for i, (name, keys) in enumerate(events) if name == "reduce_scatter_tensor"]
    assert len(reduces) == 8  # two buckets a block; a block's two reduce when its grads are in
    for k, (i, keys) in enumerate(reduces):
        waited = min(  # the first wait for any of the bucket's outputs
            next(j for j in range(i + 1, len(events)) if events[j] == ("wait_tensor", (key,)))
            for key in keys
        )
        block, other = k // 2, reduces[k + 1 - 2 * (k % 2)][0]  # the other bucket's reduce
        assert waited > other, k  # never between the two reduces of one block
        if block + 1 < len(reduces) // 2:  # the block before computes, then reduces
            assert "mm" in [name for name, _ in ops.events[i:waited]], k
            assert waited > reduces[2 * block + 2][0], k


def test_an_accumulated_grad_waits_for_its_reduce_first(fake_pg):
    """A second backward without zero_grad adds each reduced grad to the one the param
    holds: the reduce it comes from is waited before the add reads it, even while the
    reduce is left in flight for the next bucket's ([Note: a reduce-scatter left in
    flight])."""
    model = _bucketed_two_linear_blocks()
    model(torch.randn(4, 16)).sum().backward()  # the grads the next backward adds to
    loss = model(torch.randn(4, 16)).sum()
    with _OpSequence(with_storage=True) as ops:
        loss.backward()
    reduced: dict[int, int] = {}  # storage -> index of the reduce that wrote it last
    waited: set[tuple[int, int]] = set()  # (storage, reduce index) waited so far
    adds = 0
    for i, (name, keys) in enumerate(ops.events):
        if name == "reduce_scatter_tensor":
            reduced.update((key, i) for key in keys)
        elif name == "wait_tensor" and keys[0] in reduced:
            waited.add((keys[0], reduced[keys[0]]))
        elif name == "add_" and keys[0] in reduced:
            # the add read a reduce still in flight
            assert (keys[0], reduced[keys[0]]) in waited, i
            adds += 1
    assert adds == 16  # every param's grad, each from its bucket's reduce


def test_a_backward_after_one_that_raised_waits_for_its_last_reduce(fake_pg):
    """A backward that raises runs no end-of-backward callback and leaves its last block's
    reduces in flight; the next backward waits for those and for all of its own."""
    from fczero.testing.distributed import pending_collectives

    model = _bucketed_two_linear_blocks()
    x = torch.randn(4, 16, requires_grad=True)

    def fail(grad):  # the input's grad comes last, after every bucket's reduce
        raise RuntimeError("stop here")

    x.register_hook(fail)
    with pytest.raises(RuntimeError, match="stop here"):
        model(x).sum().backward()
    # the raising backward's last block's two reduces, a weight's and a bias's output each
    assert pending_collectives() == 4
    model.zero_grad(set_to_none=True)  # (an add to a held grad would wait for it anyway)
    model(torch.randn(4, 16)).sum().backward()
    assert pending_collectives() == 0
