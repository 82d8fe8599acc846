"""A param's layout: ``shard_tensor`` splits rows as ``torch.chunk`` does, and the
``ShardSpec`` it returns says how to put them back."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fczero
from fczero.config import Options
from fczero.spec import shard_tensor


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
@pytest.mark.parametrize(("rows", "per_rank", "local"), [(13, 4, 4), (3, 1, 1), (16, 4, 4)])
def test_rows_follow_torch_chunk(fake_pg, rows, per_rank, local):
    tensor = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
    param, spec = shard_tensor(tensor, init_device_mesh("cpu", (4,)), Options(), True)
    assert isinstance(param, DTensor) and tuple(param.placements) == (Shard(0),)
    assert param.requires_grad and param.shape == tensor.shape
    assert spec.shape == tensor.shape and spec.group_size == 4
    assert spec.rows_per_rank == per_rank and spec.local_rows == local  # rank 0's rows
    assert torch.equal(param.to_local(), torch.chunk(tensor, 4)[0])
    assert spec.unsharded_bytes(param) == tensor.numel() * 4


def test_a_0d_param_is_replicated_and_mixed_precision_is_copied_in(fake_pg):
    options = Options(mp=fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    param, spec = shard_tensor(torch.tensor(2.0), init_device_mesh("cpu", (2,)), options, False)
    assert tuple(param.placements) == (Replicate(),) and spec.is_scalar
    assert not param.requires_grad
    assert spec.param_dtype == torch.bfloat16 and spec.reduce_dtype is None
    assert spec.unsharded_bytes(param) == 2  # counted in the dtype the gather casts to
