"""Eager prefetch: the next block's all-gather is issued before this block's matmul."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing.comm import CollectiveLog
from fczero.testing.distributed import run_on_ranks
from tests.models import ThreeBlocks

PER_BLOCK = 3 << 19  # 1.5 MiB: one 1 MiB block of ThreeBlocks at a time


def _forward_log(model: torch.nn.Module) -> list[str]:
    with CollectiveLog(matmuls=True) as log:
        model(torch.randn(4, 512)).sum().backward()
    return log.ops


def test_second_forward_gathers_a_block_ahead(fake_pg):
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), bucket_bytes=PER_BLOCK)
    first = _forward_log(model)  # records the gather order: gathers interleave with matmuls
    assert first[:4] == [
        "all_gather_into_tensor",
        "all_gather_into_tensor",
        "addmm",
        "all_gather_into_tensor",
    ]
    second = _forward_log(model)
    # blocks.0 (weight, bias), then blocks.1's weight and bias, all before blocks.0's addmm
    assert second[:5] == ["all_gather_into_tensor"] * 4 + ["addmm"]
    assert second.count("all_gather_into_tensor") == first.count("all_gather_into_tensor")


def test_prefetch_off(fake_pg):
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), prefetch=0)
    first, second = _forward_log(model), _forward_log(model)
    assert first == second  # without prefetch nothing moves


def test_changed_order_turns_prefetch_off_for_that_step(fake_pg):
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), bucket_bytes=PER_BLOCK)
    _forward_log(model)
    model.blocks = torch.nn.ModuleList(reversed(list(model.blocks)))  # a different order
    log = _forward_log(model)
    assert log.count("addmm") == 3 and model.blocks[0]._parameters["weight"].grad is not None


def _skip_a_block(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(0)
    model = ThreeBlocks()
    reference = copy.deepcopy(model)
    fczero.parallelize(model, init_device_mesh("cpu", (world_size,)), bucket_bytes=PER_BLOCK)
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
