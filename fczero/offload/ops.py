"""``fczero::offload``, ``offload_wait``, ``reload``, ``reload_wait``: copies the compiler sees.

Schemas (``torch.library.custom_op``, so they run eagerly, trace into graphs, and have
fake kernels for shape propagation)::

    offload(Tensor src) -> Tensor                 # a new host tensor; the copy may still run
    offload_wait(Tensor(a!) host, Tensor src) -> () # host's contents are final; src may go
    reload(Tensor host, Device device) -> Tensor  # a new device tensor; the copy may still run
    reload_wait(Tensor(a!) dest) -> ()            # dest's contents are final from here on

``offload`` and ``reload`` return fresh tensors (nothing aliases an input). Each wait is
declared as mutating the tensor its copy writes: that is what it means (the bytes land
there), it keeps every reader of the tensor after the wait in Inductor's schedule (reads
of a mutated buffer follow the mutation), it makes the wait depend on the copy's output
by data, and a mutating op is never dead code to FX or Inductor.

On CUDA the copies run on a side stream (``streams.py``); both waits make only the
current stream wait (the host keeps issuing work). ``offload_wait`` also takes the
source: Inductor reuses a buffer's memory for a later kernel as soon as the graph is
done with it, without the allocator (so ``record_stream`` cannot help), and the copy
may still be reading it; with the source as an input the buffer lives until the wait,
after which every later kernel is ordered behind the copy. To read ``host`` on the CPU,
synchronize the stream after ``offload_wait``. A reload from a host tensor whose
offload is still in flight waits for it on the side stream, so the pair offload ->
reload needs no ``offload_wait`` for the host data's sake. On the CPU both copies are plain synchronous copies and the
waits do nothing. Under CUDA graphs the pending-copy table is not replayed, so the
four ops are tagged ``cudagraph_unsafe`` (``streams.UNCAPTURABLE``): Inductor keeps them
out of what it captures ([Note: offload under CUDA graphs] in ``fczero.offload.partition``).
"""

from __future__ import annotations

import torch

from fczero.core import streams

__all__ = ["offload", "offload_wait", "reload", "reload_wait"]


@torch.library.custom_op("fczero::offload", mutates_args=(), tags=streams.UNCAPTURABLE)
def offload(src: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into a new host tensor (pinned when possible); on CUDA, asynchronously."""
    if src.device.type != "cuda":
        return src.detach().clone(memory_format=torch.contiguous_format)
    host = streams.host_buffer(src)
    side = streams.side_stream(src.device)
    side.wait_stream(torch.cuda.current_stream(src.device))
    with torch.cuda.stream(side):
        host.copy_(src, non_blocking=True)
    src.record_stream(side)  # the allocator keeps src's memory until the copy has read it
    streams.remember(host, side)
    return host


@offload.register_fake
def _(src: torch.Tensor) -> torch.Tensor:
    return src.new_empty(src.shape, device="cpu")


def _offload_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return grad.to(ctx.device)


def _offload_setup(ctx, inputs, output) -> None:
    ctx.device = inputs[0].device


offload.register_autograd(_offload_backward, setup_context=_offload_setup)


@torch.library.custom_op("fczero::offload_wait", mutates_args=("host",), tags=streams.UNCAPTURABLE)
def offload_wait(host: torch.Tensor, src: torch.Tensor) -> None:
    """Make the current stream wait for the offload of ``src`` into ``host`` (the host does
    not wait). ``src`` is an input so that a compiler keeps it alive, and does not reuse
    its memory, until here."""
    event = streams.take(host)
    if event is not None:
        torch.cuda.current_stream(src.device).wait_event(event)


@offload_wait.register_fake
def _(host: torch.Tensor, src: torch.Tensor) -> None:
    return None


@torch.library.custom_op("fczero::reload", mutates_args=(), tags=streams.UNCAPTURABLE)
def reload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy ``host`` into a new tensor on ``device``; on CUDA, asynchronously on the side stream."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.detach().to(device, copy=True, memory_format=torch.contiguous_format)
    current = torch.cuda.current_stream(device)
    side = streams.side_stream(device)
    # Allocated on the current stream, after the side stream has caught up with it: no
    # kernel issued earlier can still be using the block the copy writes into.
    side.wait_stream(current)
    dest = torch.empty(host.shape, dtype=host.dtype, device=device)
    earlier = streams.take(host)  # an offload into `host` still in flight
    with torch.cuda.stream(side):
        if earlier is not None:
            side.wait_event(earlier)
        dest.copy_(host, non_blocking=True)
    dest.record_stream(side)
    streams.remember(dest, side)
    return dest


@reload.register_fake
def _(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.new_empty(host.shape, device=device)


def _reload_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad.to(ctx.device), None


def _reload_setup(ctx, inputs, output) -> None:
    ctx.device = inputs[0].device


reload.register_autograd(_reload_backward, setup_context=_reload_setup)


@torch.library.custom_op("fczero::reload_wait", mutates_args=("dest",), tags=streams.UNCAPTURABLE)
def reload_wait(dest: torch.Tensor) -> None:
    """Make the current stream wait for the reload into ``dest`` (the host does not wait)."""
    event = streams.take(dest)
    if event is not None:
        torch.cuda.current_stream(dest.device).wait_event(event)


@reload_wait.register_fake
def _(dest: torch.Tensor) -> None:
    return None
