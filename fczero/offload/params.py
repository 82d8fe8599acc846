"""Parameter offload: sharded params (and their grads) live in host memory between uses.

[Note: parameter offload]
With ``parallelize(..., offload_params=True)`` each rank's shard of every param is a
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
for the device (``wait_for_device``): a copy from pinned memory still in flight must
not read a half-updated shard.

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

from fczero.offload import streams

if TYPE_CHECKING:
    from fczero.sharding import ShardSpec

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


@torch.library.custom_op("fczero::grad_to_host", mutates_args=())
def grad_to_host(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` copied into a new host buffer, pinned when possible (pageable after one
    warning otherwise, never an error mid-step). The copy is synchronous: autograd
    accumulates the result on the CPU right after.

    [Note: the grad's host buffer is an op]
    In a compiled backward this has to stay one opaque op. Written as
    ``empty(pin_memory=True)`` followed by ``copy_``, functionalization turns it into
    ``copy(empty, grad)``, and Inductor in torch 2.11 lowers that as a device-to-host
    copy into a buffer of its own, allocated pageable, followed by a CPU kernel that
    copies it once more: the pinned buffer is dead code and dropped. Every step then
    faults in fresh pageable pages for every grad (on one H100, 8 layers of the 2048-wide
    benchmark model: backward 1.53-1.63 s compiled against 0.14-0.22 s eager). As a
    custom op it runs as written (Inductor calls it as an extern kernel), through the
    caching host allocator, which hands back pinned blocks it already holds.
    """
    out = streams.host_buffer(grad)
    out.copy_(grad)
    return out


@grad_to_host.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty(grad.shape, dtype=grad.dtype, device="cpu")


class _HostToDevice(torch.autograd.Function):
    """Forward: the host shard to the device (asynchronous, from pinned memory). Backward:
    the grad to a new host buffer through :func:`grad_to_host`, eager and compiled alike
    ([Note: the grad's host buffer is an op])."""

    @staticmethod
    def forward(ctx, host: torch.Tensor, device: torch.device) -> torch.Tensor:  # type: ignore[override]
        return host.to(device, non_blocking=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad_to_host(grad), None


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a shard in host memory) on ``device``; its grad comes back pinned."""
    return _HostToDevice.apply(host, device)


def wait_for_device(devices: set[torch.device]) -> None:
    """Block until the device has finished the copies that read host shards."""
    for device in devices:
        torch.cuda.synchronize(device)


def full_tensor(value: DTensor) -> torch.Tensor:
    """``value.full_tensor()``, also for a shard in host memory on a GPU mesh (whose
    collectives need it on the device first)."""
    local = value.to_local()
    mesh = value.device_mesh
    if local.device.type != mesh.device_type:
        device = torch.device(mesh.device_type, torch.accelerator.current_device_index())
        value = DTensor(local.to(device), value._spec, requires_grad=False)
    return value.full_tensor()
