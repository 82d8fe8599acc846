"""Parameter offload: sharded params (and their grads) live in host memory between uses.

[Note: parameter offload]
With ``parallelize(..., offload_policy=OffloadPolicy(params=True))`` each rank's shard of every param is a
DTensor whose local tensor sits in pinned host memory, on the same device mesh as
before (the mesh's device type says where the collectives run, the local tensor says
where the shard lives). Nothing else changes in how a param is used:

- the gather copies the shard to the device first (``ShardSpec.compute_device``; an
  asynchronous copy from pinned memory, on the stream that then all-gathers it), so
  the device holds a shard only while its gather is being built;
- the gradient flows back through that copy (``to_device``): the reduce-scattered
  shard of the grad is copied into a fresh pinned host buffer, so ``param.grad`` is a
  host DTensor too. Pinned, because a copy into pageable memory that was just
  allocated spends most of its time faulting the pages in: on one H100 (953M-param
  Llama, torch 2.11) backward took 3.2 s that way against 0.11 s for FSDP2's;
  the copy waits for the device, so autograd may read the grad right away;
- the optimizer steps where the params are, on the host (any ``torch.optim``
  optimizer; ``foreach`` kernels run on the CPU). Its states are created there.

So the device holds no persistent param, grad or optimizer state: only the gathered
params of the blocks in use, activations and temporaries. This is what FSDP2's
``CPUOffloadPolicy`` does too; the price is the host-side step and one device copy
of every shard per gather. Before the optimizer writes the host shards, fczero waits
for the device (``fczero.core.streams.wait_for_device``): a copy from pinned memory
still in flight must not read a half-updated shard.

On a CPU mesh the shards are in host memory already: the option changes nothing and
says so once in the log.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fczero.core import streams

if TYPE_CHECKING:
    from fczero.core.spec import ShardSpec

logger = logging.getLogger("fczero")


def to_host(
    param: nn.Parameter, spec: ShardSpec, device: torch.device
) -> tuple[nn.Parameter, ShardSpec]:
    """The sharded ``param`` moved to (pinned) host memory, and its spec, which now tells
    the gather to copy the shard to ``device`` first."""
    local = param.to_local()
    host = streams.host_buffer(local, pin=True)
    host.copy_(local)
    moved = DTensor(host.detach(), param._spec, requires_grad=False)
    return (
        nn.Parameter(moved, requires_grad=param.requires_grad),
        dataclasses.replace(spec, compute_device=device),
    )


def full_tensor(value: DTensor) -> torch.Tensor:
    """``value.full_tensor()``, also for a shard in host memory on a GPU mesh (whose
    collectives need it on the device first)."""
    local = value.to_local()
    mesh = value.device_mesh
    if local.device.type != mesh.device_type:
        device = torch.device(mesh.device_type, torch.accelerator.current_device_index())
        value = DTensor(local.to(device), value._spec, requires_grad=False)
    return value.full_tensor()
