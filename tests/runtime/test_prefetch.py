"""Eager prefetch: the next block's all-gather is issued before this block's matmul."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing.comm import CollectiveLog
from fczero.testing.distributed import pending_collectives, run_on_ranks
from tests.models import ThreeBlocks

PER_BLOCK = 3 << 19  # 1.5 MiB: one 1 MiB block of ThreeBlocks at a time


def _forward_log(model: torch.nn.Module) -> list[str]:
    with CollectiveLog(matmuls=True) as log:
        model(torch.randn(4, 512)).sum().backward()
    return log.ops


def test_second_forward_gathers_a_block_ahead(fake_pg):
    model = fczero.parallelize(
        ThreeBlocks(),
        init_device_mesh("cpu", (2,)),
        comm_policy=fczero.CommPolicy(bucket_bytes=PER_BLOCK, keep_unsharded=0),
    )
    first = _forward_log(model)  # records the gather order: gathers interleave with matmuls
    assert first[:4] == [
        "all_gather_into_tensor",
        "all_gather_into_tensor",
        "addmm",
        "all_gather_into_tensor",
    ]
    second = _forward_log(model)
    # one bucket per block (weight and bias, eager_buckets): blocks.0's, then blocks.1's,
    # both before blocks.0's addmm
    assert second[:3] == ["all_gather_into_tensor"] * 2 + ["addmm"]
    # forward: 4 buckets (a block each, and the head: a bucket never spans two units), was
    # 7. Backward regathers blocks.1, blocks.2 and the head, each unit whole: one bucket each
    assert first.count("all_gather_into_tensor") == 7 + 3
    assert second.count("all_gather_into_tensor") == 4 + 3


def _backward_log(model: torch.nn.Module) -> list[str]:
    loss = model(torch.randn(4, 512)).sum()
    with CollectiveLog(matmuls=True) as log:
        loss.backward()
    return log.ops


def test_backward_regathers_a_layer_ahead(fake_pg):
    """Backward regathers head.weight, then blocks.2.weight, then blocks.1.weight (blocks.0
    saves no weight: its input needs no grad). With prefetch (and its buckets), blocks.2's
    weight comes in the head's bucket, before the head's matmuls, and blocks.1's regather
    is issued before blocks.2's matmuls; nothing is gathered twice. Per read (units off):
    with units each block is regathered whole (tests/core/test_unsharding.py)."""
    mesh = init_device_mesh("cpu", (2,))
    model = fczero.parallelize(
        ThreeBlocks(), mesh, units=None,
        comm_policy=fczero.CommPolicy(bucket_bytes=PER_BLOCK, keep_unsharded=0),
    )  # fmt: skip
    ops = _backward_log(model)
    assert ops[:2] == ["all_gather_into_tensor", "mm"]  # the head's bucket (with blocks.2's)
    assert ops.count("all_gather_into_tensor") == 2
    # the window (1.5 MiB) cannot hold blocks.1's 1 MiB beside blocks.2's weight: it is
    # issued when blocks.2's weight is unpacked, ahead of blocks.2's two matmuls
    second = ops.index("all_gather_into_tensor", 1)
    assert ops[second - 1 : second + 2] == ["reduce_scatter_tensor", "all_gather_into_tensor", "mm"]
    assert ops[second:].count("mm") == 5  # blocks.2's two, blocks.1's two, blocks.0's one
    off = fczero.parallelize(
        ThreeBlocks(), mesh, units=None, comm_policy=fczero.CommPolicy(prefetch=0, keep_unsharded=0)
    )
    ops_off = _backward_log(off)
    assert ops_off[:2] == ["all_gather_into_tensor", "mm"]
    assert ops_off.count("all_gather_into_tensor") == 3


def test_prefetch_off(fake_pg):
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(prefetch=0))
    first, second = _forward_log(model), _forward_log(model)
    assert first == second  # without prefetch nothing moves


def test_changed_order_turns_prefetch_off_for_that_step(fake_pg):
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(bucket_bytes=PER_BLOCK))
    _forward_log(model)
    model.blocks = torch.nn.ModuleList(reversed(list(model.blocks)))  # a different order
    log = _forward_log(model)
    assert log.count("addmm") == 3 and model.blocks[0]._parameters["weight"].grad is not None


def _skip_a_block(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(0)
    model = ThreeBlocks()
    reference = copy.deepcopy(model)
    fczero.parallelize(model, init_device_mesh("cpu", (world_size,)), comm_policy=fczero.CommPolicy(bucket_bytes=PER_BLOCK))
    errors = []
    for skip in [set(), set(), {1}, set(), set()]:  # record, replay, change, re-record, replay
        model.skip = reference.skip = skip
        x = torch.randn(4, 512)
        with torch.no_grad():
            errors.append((model(x) - reference(x)).abs().max().item())
    return errors


def test_changed_order_never_computes_with_another_params_prefetch():
    """Skipping block 1 makes gather 2 ask for blocks.2 where blocks.1 was prefetched."""
    for errors in run_on_ranks(_skip_a_block, 2):
        assert max(errors) < 1e-5, errors


class _ReadsShapes(ThreeBlocks):
    """Reads each block's weight for its shape only (a gather nobody computes with), and
    runs block 1 under a non-reentrant checkpoint, whose recompute stops early."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert all(block.weight.shape == (512, 512) for block in self.blocks)
        x = torch.relu(self.blocks[0](x))
        x = torch.utils.checkpoint.checkpoint(self.blocks[1], x, use_reentrant=False)
        return self.head(torch.relu(self.blocks[2](x)))


def _pending_after_steps(rank: int, world_size: int) -> list[int]:
    torch.manual_seed(0)
    model = fczero.parallelize(
        _ReadsShapes(), init_device_mesh("cpu", (world_size,)), comm_policy=fczero.CommPolicy(bucket_bytes=PER_BLOCK)
    )
    pending = []
    for _ in range(3):  # record the order, then replay it with prefetch
        model(torch.randn(4, 512)).sum().backward()
        pending.append(pending_collectives())
    return pending


def test_every_eager_gather_is_waited():
    """A gather whose result is never used must still be waited: an abandoned functional
    collective pins its buffers for good and, on gloo, corrupts the heap."""
    for pending in run_on_ranks(_pending_after_steps, 2):
        assert pending == [0, 0, 0]


def test_per_step_bookkeeping_grows_with_params_not_their_square(fake_pg, monkeypatch):
    """Eager prefetch and the backward's regathers keep running byte counts: one step
    looks at each param's size a bounded number of times, however many params there are."""
    from fczero.core.spec import ShardSpec
    from fczero.models.llama import Llama, LlamaConfig

    calls = []
    size_of = ShardSpec.unsharded_bytes
    monkeypatch.setattr(ShardSpec, "unsharded_bytes", lambda s, p: calls.append(1) or size_of(s, p))
    per_param = []
    for layers in (4, 16):
        cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=4, ffn_dim=64)
        model = fczero.parallelize(Llama(cfg), init_device_mesh("cpu", (2,)))
        tokens = torch.randint(0, 64, (2, 16))
        for _ in range(2):  # record the order, then replay it with prefetch
            model(tokens).float().sum().backward()
        calls.clear()
        model(tokens).float().sum().backward()
        per_param.append(len(calls) / len(list(model.parameters())))
    assert per_param[1] <= per_param[0] * 1.25, per_param  # flat in the number of params


def test_a_repeated_step_plans_no_buckets(fake_pg, monkeypatch):
    """The forward's buckets are planned when the gather order is recorded, and the
    backward's regather buckets when the saved list changes (``RegatherPlans``): a step
    that repeats the last one plans nothing, and one that saves other params plans again."""
    from fczero.runtime import eager_buckets

    plans = []
    plan = eager_buckets.plan
    monkeypatch.setattr(eager_buckets, "plan", lambda *a: plans.append(1) or plan(*a))
    policy = fczero.CommPolicy(bucket_bytes=PER_BLOCK)
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=policy)
    x = torch.randn(4, 512)
    for _ in range(2):
        model(x).sum().backward()
    plans.clear()
    model(x).sum().backward()
    assert plans == []
    model(x.requires_grad_()).sum().backward()  # blocks.0 now saves its weight too
    assert len(plans) == 1


def test_a_repeated_order_is_kept_and_a_changed_one_recorded(fake_pg):
    """A forward that gathers the recorded params in the recorded order, with the same
    specs, keeps the recorded list itself (it builds no entry per gather); one whose
    gathers differ records its own order: a param gathered with another spec (as the
    automatic keep plan gives it), or a forward that ends early."""
    import dataclasses

    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(bucket_bytes=PER_BLOCK))
    prefetch = fczero.core.state.root_state(model).prefetch
    x = torch.randn(4, 512)
    model(x).sum().backward()
    order = prefetch.order
    assert len(order) == 7
    for _ in range(2):
        model(x).sum().backward()
        assert prefetch.order is order
    state = fczero.core.state.module_state(model.blocks[1]).params["weight"]
    state.spec = dataclasses.replace(state.spec, keep_unsharded=True)
    model(x).sum().backward()
    assert prefetch.order is not order and len(prefetch.order) == 7
    assert [spec for spec, _, _ in prefetch.order][2] is state.spec
    assert all(a[1] is b[1] for a, b in zip(order, prefetch.order))
    recorded = prefetch.order

    def stop(*_):
        raise RuntimeError("stop")

    handle = model.blocks[1].register_forward_pre_hook(stop)
    with pytest.raises(RuntimeError, match="stop"):
        model(x)  # blocks.0's two gathers, then the forward ends
    handle.remove()
    assert prefetch.order == recorded[:2]
