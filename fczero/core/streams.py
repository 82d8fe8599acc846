"""Host<->device copies: the streams they run on, and how their completion is found again.

On CUDA every copy runs on one side stream per device. Before it is issued the side
stream waits for the current stream (so the copy reads finished data and writes into
memory no earlier kernel still uses); after it, an event is recorded and kept here
under the destination's data pointer until the matching wait consumes it. Memory
that a copy reads or writes is marked with ``record_stream`` so that the caching
allocator does not hand it out again before the side stream is done with it.

Host buffers are pinned when possible; when pinning fails (host memory that cannot back it,
no driver) the buffer is pageable, which still works but copies synchronously, and a
warning says so once.

``to_device`` is the one differentiable copy: a host shard to the device, its grad back
to a pinned host buffer (parameter offload's gather starts with it).
"""

from __future__ import annotations

import logging
import threading
import warnings

import torch

logger = logging.getLogger("fczero")

# [Note: what offload keeps per process]
# CUDA streams belong to a device, not to a model, and the copies of every model run on
# the same two per device; a copy's completion is found again from the tensor it wrote
# (the wait is a separate op, in eager and in compiled graphs alike, and only the tensor
# travels between them). So these tables are the process's, guarded by one lock (copies
# may be issued from autograd's threads). Whether pinned host memory was refused is a
# fact of the process too: it is said once.
_lock = threading.Lock()
_side_streams: dict[int, torch.cuda.Stream] = {}  # device index -> offload/reload stream
_writeback_streams: dict[int, torch.cuda.Stream] = {}  # device index -> optimizer write-back
_pending: dict[int, torch.cuda.Event] = {}  # destination data_ptr -> its copy's event
_warned: set[str] = set()  # the process-wide facts already warned about ("pinned")


def warn(message: str, stacklevel: int = 3) -> None:
    """Log and warn ``message`` (callers decide how often: per settings, per handle...)."""
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def _warn_once(key: str, message: str) -> None:
    """Log and warn ``message`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warn(message, stacklevel=4)


def _stream_in(table: dict[int, torch.cuda.Stream], device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = table.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            table[index] = stream
    return stream


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream offload and reload copies run on, one per CUDA device."""
    return _stream_in(_side_streams, device)


def writeback_stream(device: torch.device) -> torch.cuda.Stream:
    """A second copy stream per CUDA device, for the optimizer step's copies back to host
    memory, so that they run beside the copies in (each direction has its own copy
    engine) instead of queuing behind them."""
    return _stream_in(_writeback_streams, device)


def host_buffer(like: torch.Tensor, pin: bool = True) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor shaped like ``like``; pinned if it can be."""
    if pin and torch.cuda.is_available():
        try:
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        except RuntimeError as err:  # pinning refused: pageable memory still works
            _warn_once(
                "pinned",
                "fczero: pinned host memory could not be allocated "
                f"({str(err).splitlines()[0]}); offloaded tensors use pageable memory, "
                "whose copies do not overlap with compute. Free host memory (pinned pages "
                "must fit in physical memory) to get overlap back.",
            )
    return torch.empty(like.shape, dtype=like.dtype)


def remember(dest: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Record an event on ``stream`` that marks ``dest``'s copy done."""
    event = torch.cuda.Event()
    event.record(stream)
    with _lock:
        _pending[dest.data_ptr()] = event


def take(dest: torch.Tensor) -> torch.cuda.Event | None:
    """The event of ``dest``'s copy, if one is still pending (removed from the table)."""
    with _lock:
        return _pending.pop(dest.data_ptr(), None)


def pending_count() -> int:
    """How many copies have not been waited for (tests and the report read it)."""
    with _lock:
        return len(_pending)


#: Tags of fczero's ops that copy on a side stream or into host memory: CUDA graphs cannot
#: capture them, and Inductor keeps ops tagged so out of what it captures ([Note: offload
#: under CUDA graphs] in ``fczero.offload.partition``). (A torch without the tag: none.)
UNCAPTURABLE: tuple = (
    (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
)


@torch.library.custom_op("fczero::grad_to_host", mutates_args=(), tags=UNCAPTURABLE)
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
    out = host_buffer(grad)
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
    """Block until each device has finished its queued copies (the optimizer step waits
    so, under param offload, before it writes host shards a copy may still read)."""
    for device in devices:
        torch.cuda.synchronize(device)
