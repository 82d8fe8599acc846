"""The whole-param reduce (fczero/comm/whole_grads.py) on 2 gloo ranks: each route turns a whole
grad into this rank's averaged rows, and stage 1's buckets are planned in reverse
registration order without mixing dtypes."""

from __future__ import annotations

import torch

from fczero.comm.whole_grads import Reducer, Route, reduce_whole_grad
from fczero.testing.distributed import run_on_ranks


def _route(kind: str, rank: int, group: str, rows: int = 3, dtype=torch.float32) -> Route:
    per_rank = -(-rows // 2)
    start = min(rank * per_rank, rows)
    return Route(
        kind=kind,
        group_size=2,
        group_name=group,
        rows_per_rank=per_rank,
        local_rows=min(per_rank, rows - start),
        start=start,
        reduce_dtype=dtype,
        shard_dtype=torch.float64,
        index=-1,
    )


def _reduce(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    grad = torch.arange(6.0).reshape(3, 2) * (rank + 1)  # rank 1's grad is twice rank 0's
    return {
        kind: reduce_whole_grad(grad, _route(kind, rank, group))
        for kind in ("scatter", "rows", "all")
    }


def test_each_route_gives_this_ranks_rows_of_the_average():
    mean = torch.arange(6.0).reshape(3, 2) * 1.5  # (1x + 2x) / 2
    for rank, out in enumerate(run_on_ranks(_reduce, 2)):
        rows = mean[:2] if rank == 0 else mean[2:]  # 3 rows: 2 on rank 0, 1 on rank 1
        assert out["scatter"].dtype == torch.float64  # back in the shard's dtype
        assert torch.equal(out["scatter"], rows.double())
        assert torch.equal(out["rows"], rows.double())
        assert torch.equal(out["all"], mean.double())


def test_stage1_buckets_start_from_the_last_param_and_keep_dtypes_apart():
    def slot(rows: int, dtype: torch.dtype):
        return (None, _route("rows", 0, "0", rows, dtype), torch.Size([rows, 4]))

    # 16 bytes per row at fp32: slots of 64, 64, 32 (bf16) and 64 bytes, a 128-byte cap
    slots = [slot(4, torch.float32), slot(4, torch.float32), slot(4, torch.bfloat16), slot(4, torch.float32)]
    assert Reducer(slots, 128).buckets == [[3], [2], [1, 0]]
