"""Optimizer-state offload: an optimizer's tensor states live in host memory between steps.

``offload_optimizer_states(optimizer)`` hooks the optimizer's ``step``: after each step
every tensor state (AdamW's ``exp_avg``/``exp_avg_sq``, SGD's momentum buffer, ...) is
copied to a host buffer (pinned when possible) on a side stream and the state tensor is
pointed at that buffer, so its device memory is freed once the copy has read it. Before
the next step the states are copied back on the side stream and the step's kernels wait
for them. ``prefetch()`` starts that copy early (e.g. after forward) so it overlaps with
backward; otherwise the step starts it itself.

States keep their identity: the state tensors (or, for DTensor states, their local
tensors) have their ``.data`` swapped, so ``optimizer.state`` and ``state_dict()`` stay
valid (between steps they hold host tensors, which is what a checkpoint wants).
``device_bytes`` lets the first states (in parameter order) up to that many bytes stay
on the device. On a machine without CUDA nothing needs moving; the states are still
copied to separate host buffers (so the mechanism runs everywhere) and a log line says
once that no memory is saved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from fczero.offload import streams

logger = logging.getLogger("fczero")

__all__ = ["OptimizerOffload", "offload_optimizer_states"]


@dataclass
class _Slot:
    """One offloaded state tensor: where its data lives between steps and during them."""

    name: str
    target: torch.Tensor  # the tensor whose .data is swapped (a DTensor's local tensor)
    device: torch.device
    host: torch.Tensor
    nbytes: int


@dataclass
class OptimizerOffloadSummary:
    offloaded: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    offloaded_bytes: int = 0
    kept_bytes: int = 0


class OptimizerOffload:
    """The hooks that keep one optimizer's states in host memory; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, device_bytes: int, pin: bool) -> None:
        self.optimizer = optimizer
        self.device_bytes = device_bytes
        self.pin = pin
        self.slots: list[_Slot] | None = None  # planned at the first step's end
        self.summary = OptimizerOffloadSummary()
        self._on_device = False
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            optimizer.register_state_dict_pre_hook(lambda opt: self.wait()),
            optimizer.register_load_state_dict_post_hook(self._after_load),
        ]

    # -- planning --------------------------------------------------------------------
    def _plan(self) -> list[_Slot]:
        slots: list[_Slot] = []
        summary = OptimizerOffloadSummary()
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                for key, value in self.optimizer.state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor) or value.dim() == 0:
                        continue  # step counters and other scalars stay where they are
                    target = value._local_tensor if isinstance(value, DTensor) else value
                    name = f"group{gi}.param{pi}.{key}"
                    size = target.numel() * target.element_size()
                    if summary.kept_bytes + size <= self.device_bytes:
                        summary.kept.append(name)
                        summary.kept_bytes += size
                        continue
                    host = streams.host_buffer(target, pin=self.pin)
                    slots.append(_Slot(name, target, target.device, host, size))
                    summary.offloaded.append(name)
                    summary.offloaded_bytes += size
        if slots and all(s.device.type == "cpu" for s in slots):
            streams.warn_once(
                "optimizer-cpu",
                "fczero: optimizer states are already in CPU memory (no CUDA device); "
                "offloading copies them between host buffers and saves no memory.",
            )
        logger.info(
            "optimizer-state offload: %d tensors (%.1f MiB) to host memory, %d (%.1f MiB) kept "
            "on the device (device_bytes=%d)",
            len(summary.offloaded),
            summary.offloaded_bytes / 2**20,
            len(summary.kept),
            summary.kept_bytes / 2**20,
            self.device_bytes,
        )
        self.summary = summary
        return slots

    # -- copies ----------------------------------------------------------------------
    def prefetch(self) -> None:
        """Start copying the offloaded states back to their devices (no-op if they are there)."""
        if self._on_device or not self.slots:
            return
        self._on_device = True
        for slot in self.slots:
            if slot.device.type != "cuda":
                slot.target.data = slot.host.clone()
                continue
            side = streams.side_stream(slot.device)
            side.wait_stream(torch.cuda.current_stream(slot.device))
            dest = torch.empty(slot.host.shape, dtype=slot.host.dtype, device=slot.device)
            with torch.cuda.stream(side):
                dest.copy_(slot.host, non_blocking=True)
            dest.record_stream(side)
            slot.target.data = dest

    def _offload(self) -> None:
        for slot in self.slots or ():
            current = slot.target.data
            if slot.device.type != "cuda":
                slot.host.copy_(current)
                slot.target.data = slot.host
                continue
            side = streams.side_stream(slot.device)
            side.wait_stream(torch.cuda.current_stream(slot.device))
            with torch.cuda.stream(side):
                slot.host.copy_(current, non_blocking=True)
            current.record_stream(side)  # freed for reuse only after the copy has read it
            slot.target.data = slot.host
        self._on_device = False

    def wait(self) -> None:
        """Block until every copy in flight is done (host buffers are then safe to read)."""
        for device in {s.device for s in self.slots or () if s.device.type == "cuda"}:
            streams.side_stream(device).synchronize()

    # -- hooks -----------------------------------------------------------------------
    def _before_step(self, optimizer, args, kwargs) -> None:
        if not self.slots:
            return
        self.prefetch()
        for device in {s.device for s in self.slots if s.device.type == "cuda"}:
            torch.cuda.current_stream(device).wait_stream(streams.side_stream(device))

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self.slots is None:
            self.slots = self._plan()
        self._offload()

    def _after_load(self, optimizer) -> None:
        """Loaded states are new tensors on the params' devices: plan again after the next step."""
        self.wait()
        self.slots = None
        self._on_device = False

    def remove(self) -> None:
        """Bring every state back to its device for good and take the hooks off."""
        self.prefetch()
        for device in {s.device for s in self.slots or () if s.device.type == "cuda"}:
            torch.cuda.current_stream(device).wait_stream(streams.side_stream(device))
        for handle in self._handles:
            handle.remove()
        self.slots = []
        handles = self.optimizer.__dict__.get("_fczero_offload", [])
        if self in handles:
            handles.remove(self)


def offload_optimizer_states(
    optimizer: torch.optim.Optimizer, *, device_bytes: int = 0, pin_memory: bool = True
) -> OptimizerOffload:
    """Keep ``optimizer``'s tensor states in host memory between steps (see the module doc).

    Args:
        optimizer: any ``torch.optim.Optimizer`` (its states may be plain tensors or
            DTensors, as under ``fczero.parallelize``). Call this once, before training.
        device_bytes: bytes of state (the first, in parameter order) that stay on the
            device; 0 offloads every tensor state.
        pin_memory: use pinned host buffers (needed for copies that overlap with compute);
            if pinning fails the buffers are pageable and a warning says so.

    Returns:
        the :class:`OptimizerOffload` handle: ``prefetch()`` starts the copy back early,
        ``wait()`` finishes copies in flight, ``remove()`` undoes everything.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "fczero.offload_optimizer_states needs a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}."
        )
    if isinstance(device_bytes, bool) or not isinstance(device_bytes, int) or device_bytes < 0:
        raise ValueError(
            f"fczero: device_bytes must be an int >= 0 (bytes of state kept on the device), "
            f"got {device_bytes!r}."
        )
    if not isinstance(pin_memory, bool):
        raise TypeError(f"fczero: pin_memory must be True or False, got {pin_memory!r}.")
    if any(isinstance(h, OptimizerOffload) for h in getattr(optimizer, "_fczero_offload", ())):
        raise ValueError(
            "fczero: this optimizer's states are already offloaded; call "
            "offload_optimizer_states once per optimizer (or .remove() the first handle)."
        )
    handle = OptimizerOffload(optimizer, device_bytes, pin_memory)
    optimizer.__dict__.setdefault("_fczero_offload", []).append(handle)
    return handle
