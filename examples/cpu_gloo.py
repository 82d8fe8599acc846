"""A complete fczero training script on the CPU: gloo, a "cpu" mesh, a small MLP.

Copy it and launch it with torchrun, one process per rank:

    torchrun --nproc-per-node 2 examples/cpu_gloo.py
    torchrun --nproc-per-node 2 examples/cpu_gloo.py --steps 5 --compile

Every rank builds the same model, ``fczero.parallelize`` shards its params over the
mesh, and each rank trains on its own random batches; gradients arrive averaged over
the ranks. On GPUs the same script takes ``"nccl"``, ``torch.cuda.set_device(local
rank)`` and ``init_device_mesh("cuda", ...)``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fczero


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE and the rendezvous
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    fczero.parallelize(model, mesh)  # each param becomes a DTensor sharded over the ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # after parallelize
    forward = torch.compile(model) if args.compile else model

    data = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    target = torch.randn(32, 32, generator=torch.Generator().manual_seed(0)) / 32**0.5
    for step in range(1, args.steps + 1):
        x = torch.randn(16, 32, generator=data)  # (batch, features)
        loss = F.mse_loss(forward(x), x @ target)  # learn a fixed linear map
        loss.backward()  # grads arrive sharded and averaged over the ranks
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the mean over ranks, for the log
        if rank == 0:
            print(f"step {step}/{args.steps}: loss {mean.item() / world_size:.4f}", flush=True)

    # Leave together, and give gloo's worker threads a moment to let go of the last
    # collective's tensors: a process that exits while they still hold one can abort
    # ("terminate called without an active exception", docs/troubleshooting.md).
    dist.barrier()
    time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
