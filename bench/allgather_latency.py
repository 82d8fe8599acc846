"""All-gather latency by size: NCCL against a symmetric-memory all-gather.

    torchrun --standalone --nproc-per-node 2 -m bench.allgather_latency --out out/ag

For each per-rank shard size, both ways gather the same bf16 shards and the results are
compared element for element; each is timed over ``--iters`` back-to-back calls with CUDA
events, after ``--warmup`` calls. The symmetric-memory way is PyTorch's copy-engine
all-gather (``torch.ops.symm_mem._low_contention_all_gather``): each rank writes its
shard into a buffer every rank can map, then pulls the others' shards with copies
instead of NCCL kernels (no multicast: NVLink multicast stays off). Rank 0 writes
``allgather_latency.json`` and a markdown table to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

logger = logging.getLogger("fczero.bench")

_SIZES_KIB = [16, 64, 256, 1024, 4096, 16384, 65536]


def _time(fn, iters: int, warmup: int) -> float:
    """Mean milliseconds per call, measured on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/allgather"))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    group = dist.group.WORLD
    name = group.group_name
    world = dist.get_world_size()
    if not hasattr(torch.ops.symm_mem, "_low_contention_all_gather"):
        raise SystemExit(f"torch {torch.__version__} has no symm_mem._low_contention_all_gather")
    symm_mem.enable_symm_mem_for_group(name)
    c10d = torch.ops._c10d_functional

    rows = []
    for kib in _SIZES_KIB:
        numel = kib * 1024 // 2  # bf16
        shard = torch.full((numel,), float(dist.get_rank() + 1), device="cuda", dtype=torch.bfloat16)
        shard += torch.arange(numel, device="cuda", dtype=torch.bfloat16) * 1e-3

        def nccl():
            return c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world, name))

        def symmetric():
            return c10d.wait_tensor(torch.ops.symm_mem._low_contention_all_gather(shard, name))

        same = torch.equal(nccl(), symmetric())
        row = {
            "shard_kib": kib,
            "nccl_ms": _time(nccl, args.iters, args.warmup),
            "symm_mem_ms": _time(symmetric, args.iters, args.warmup),
            "equal": same,
        }
        rows.append(row)
        if dist.get_rank() == 0:
            logger.info("%s", row)
    dist.barrier()
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "world": world}
        (args.out / "allgather_latency.json").write_text(json.dumps({**meta, "rows": rows}))
        lines = ["| shard (KiB) | NCCL (ms) | symmetric memory (ms) | equal |", "|---|---|---|---|"]
        lines += [
            f"| {r['shard_kib']} | {r['nccl_ms']:.4f} | {r['symm_mem_ms']:.4f} | {r['equal']} |"
            for r in rows
        ]
        (args.out / "allgather_latency.md").write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
