"""Optimizer-state offload: an optimizer's tensor states live in host memory between steps.

``offload_optimizer_states(optimizer)`` hooks the optimizer's ``step``: after each step
every tensor state (AdamW's ``exp_avg``/``exp_avg_sq``, SGD's momentum buffer, ...) is
copied to a host buffer (pinned when possible) on a side stream and the state tensor is
pointed at that buffer, so its device memory is freed once the copy has read it. Before
the next step the states are copied back on the side stream and the step's kernels wait
for them. ``prefetch()`` starts that copy early (e.g. after forward) so it overlaps with
backward; otherwise the step starts it itself.

With ``chunk_bytes`` the step runs in chunks of parameters (about that many bytes of
parameters each, in parameter order): the states of one chunk are brought in while the
previous chunk steps, then sent back, so at most two chunks of states are on the device
at once, also at the step (without chunks the step needs all of them). Each parameter
is stepped exactly once per step, with its group's hyperparameters, so the result is
the same as one whole step for optimizers whose update is per parameter (all of
``torch.optim``'s, except with options that couple parameters, such as a global
gradient-norm in the optimizer itself). A ``closure`` disables chunking for that call.

States keep their identity: the state tensors (or, for DTensor states, their local
tensors) have their ``.data`` swapped, so ``optimizer.state`` and ``state_dict()`` stay
valid (between steps they hold host tensors, which is what a checkpoint wants).
``device_bytes`` lets the first states (in parameter order) up to that many bytes stay
on the device. ``device_bytes="auto"`` sizes that from ``memory_budget`` (default: the
``memory_budget`` of the model ``parallelize`` sharded these params for, else 90% of the
device) at the first step: right before it, the allocator's peak so far is what
forward and backward need without any state on the device, so what the budget leaves
above it may hold states (DeepCompile's adaptive offload; CUDA only: elsewhere every
state is offloaded, and the log says why). The decision is this rank's own: no
collective depends on it. On a machine without CUDA nothing needs moving; the states are still
copied to separate host buffers (so the mechanism runs everywhere) and a warning says
once that no memory is saved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from fczero.memory import budget_and_peak
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
    on_device: bool = True


@dataclass
class OptimizerOffloadSummary:
    offloaded: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    offloaded_bytes: int = 0
    kept_bytes: int = 0
    chunks: int = 1
    sizing: str = ""  # how device_bytes was chosen ("auto": from which numbers)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class OptimizerOffload:
    """The hooks that keep one optimizer's states in host memory; see the module docstring."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device_bytes: int | str,
        pin: bool,
        chunk_bytes: int | None,
        memory_budget: int | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.auto = device_bytes == "auto"
        self.device_bytes = 0 if self.auto else device_bytes
        self.memory_budget = memory_budget
        self.pin = pin
        self.chunk_bytes = chunk_bytes
        self.summary = OptimizerOffloadSummary()
        self._planned: dict[torch.Tensor, list[_Slot]] = {}  # param -> its offloaded states
        self._inside_chunks = False
        self._prefetched: list[torch.cuda.Event] = []  # copies prefetch() started
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            optimizer.register_state_dict_pre_hook(lambda opt: self.wait()),
            optimizer.register_load_state_dict_post_hook(self._after_load),
        ]
        self._own_step = None
        self._earlier_step = optimizer.__dict__.get("step")  # e.g. a scheduler's wrapper
        if chunk_bytes is not None:
            self._whole_step = optimizer.step  # the bound step (maybe wrapped by a scheduler)
            self._own_step = self._chunked_step
            optimizer.step = self._own_step  # type: ignore[method-assign]

    @property
    def slots(self) -> list[_Slot] | None:
        """Every offloaded state, in parameter order (None before the first step)."""
        if not self._planned:
            return None
        return [s for slots in self._planned.values() for s in slots]

    # -- planning --------------------------------------------------------------------
    def _params(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (f"group{gi}.param{pi}", p)
            for gi, group in enumerate(self.optimizer.param_groups)
            for pi, p in enumerate(group["params"])
        ]

    def _plan(self, params: list[tuple[str, torch.Tensor]]) -> None:
        """Give every new tensor state of ``params`` a host buffer (or keep it, within
        ``device_bytes``). States already planned keep their plan."""
        summary = self.summary
        for name, p in params:
            if p in self._planned or not self.optimizer.state.get(p):
                continue
            slots = []
            for key, value in self.optimizer.state[p].items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue  # step counters and other scalars stay where they are
                target = _local(value)
                size = target.numel() * target.element_size()
                if summary.kept_bytes + size <= self.device_bytes:
                    summary.kept.append(f"{name}.{key}")
                    summary.kept_bytes += size
                    continue
                host = streams.host_buffer(target, pin=self.pin)
                slots.append(_Slot(f"{name}.{key}", target, target.device, host, size))
                summary.offloaded.append(f"{name}.{key}")
                summary.offloaded_bytes += size
            self._planned[p] = slots
            if any(s.device.type == "cpu" for s in slots):
                streams.warn_once(
                    "optimizer-cpu",
                    "fczero: optimizer states are already in CPU memory (no CUDA device); "
                    "offloading copies them between host buffers and saves no memory.",
                )

    # -- copies ----------------------------------------------------------------------
    def _reload(self, params) -> list[torch.cuda.Event]:
        """Start copying the states of ``params`` back; returns events to wait for (CUDA)."""
        events: dict[torch.device, torch.cuda.Event] = {}
        for _, p in params:
            for slot in self._planned.get(p, ()):
                if slot.on_device:
                    continue
                slot.on_device = True
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
                events[slot.device] = None  # recorded below, after the last copy
        out = []
        for device in events:
            event = torch.cuda.Event()
            event.record(streams.side_stream(device))
            out.append(event)
        return out

    def _offload(self, params) -> None:
        for _, p in params:
            for slot in self._planned.get(p, ()):
                if not slot.on_device:
                    continue
                slot.on_device = False
                current = slot.target.data
                if slot.device.type != "cuda":
                    slot.host.copy_(current)
                    slot.target.data = slot.host
                    continue
                side = streams.side_stream(slot.device)
                side.wait_stream(torch.cuda.current_stream(slot.device))
                with torch.cuda.stream(side):
                    slot.host.copy_(current, non_blocking=True)
                current.record_stream(side)  # freed for reuse only after the copy read it
                slot.target.data = slot.host

    @staticmethod
    def _wait_for(events: list[torch.cuda.Event]) -> None:
        for event in events:
            torch.cuda.current_stream().wait_event(event)

    def prefetch(self) -> None:
        """Start copying the offloaded states back (the first chunk's, with ``chunk_bytes``)."""
        params = self._params()
        if self.chunk_bytes is not None:
            params = self._chunks(params)[0] if params else []
        self._prefetched += self._reload(params)

    def _take_prefetched(self) -> list[torch.cuda.Event]:
        events, self._prefetched = self._prefetched, []
        return events

    def wait(self) -> None:
        """Block until every copy in flight is done (host buffers are then safe to read)."""
        for device in {s.device for s in self.slots or () if s.device.type == "cuda"}:
            streams.side_stream(device).synchronize()

    def _size_from_budget(self) -> None:
        """``device_bytes="auto"``, once, before the first step (see the module docstring)."""
        if not self.auto or self.summary.sizing:
            return
        from fczero.stages import options_of  # (stages imports fczero.offload)

        params = [p for _, p in self._params()]
        device = _local(params[0]).device if params else torch.device("cpu")
        budget = self.memory_budget
        if budget is None and params:  # the parallelized model's budget, if it has one
            options = options_of(params[0])
            budget = options.memory_budget if options is not None else None
        measured = budget_and_peak(device, budget)
        if isinstance(measured, str):
            self.device_bytes = 0
            self.summary.sizing = f"auto: {measured} on {device.type}, every state offloaded"
        else:
            budget, peak = measured
            self.device_bytes = max(0, budget - peak)
            self.summary.sizing = (
                f"auto: memory_budget {budget / 2**20:.1f} MiB - peak before the first step "
                f"{peak / 2**20:.1f} MiB = {self.device_bytes / 2**20:.1f} MiB of states kept"
            )
        logger.info("optimizer-state offload: %s", self.summary.sizing)

    # -- the step --------------------------------------------------------------------
    def _before_step(self, optimizer, args, kwargs) -> None:
        if self._inside_chunks:
            return
        self._size_from_budget()
        self._wait_for(self._reload(self._params()) + self._take_prefetched())

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self._inside_chunks:
            return
        params = self._params()
        self._plan(params)
        self._offload(params)

    def _chunks(self, params):
        chunks, current, size = [], [], 0
        for name, p in params:
            nbytes = _local(p).numel() * _local(p).element_size()
            if current and size + nbytes > self.chunk_bytes:
                chunks.append(current)
                current, size = [], 0
            current.append((name, p))
            size += nbytes
        if current:
            chunks.append(current)
        return chunks

    def _chunked_step(self, closure=None):
        if closure is not None:
            return self._whole_step(closure)
        self._size_from_budget()
        opt = self.optimizer
        groups = opt.param_groups
        all_params = [list(g["params"]) for g in groups]
        chunks = self._chunks(self._params())
        self.summary.chunks = len(chunks)
        pending = (self._reload(chunks[0]) if chunks else []) + self._take_prefetched()
        self._inside_chunks = True
        try:
            for i, chunk in enumerate(chunks):
                ready = pending
                if i + 1 < len(chunks):
                    pending = self._reload(chunks[i + 1])  # overlaps with this chunk's step
                self._wait_for(ready)
                members = {id(p) for _, p in chunk}
                for g, params in zip(groups, all_params):
                    g["params"] = [p for p in params if id(p) in members]
                opt.param_groups = [g for g in groups if g["params"]]
                try:
                    self._whole_step()
                finally:
                    for g, params in zip(groups, all_params):
                        g["params"] = params
                    opt.param_groups = groups
                self._plan(chunk)
                self._offload(chunk)
        finally:
            self._inside_chunks = False
        return None

    def _after_load(self, optimizer) -> None:
        """Loaded states are new tensors on the params' devices: plan again after the next step."""
        self.wait()
        self._planned = {}
        self.summary = OptimizerOffloadSummary(sizing=self.summary.sizing)

    def remove(self) -> None:
        """Bring every state back to its device for good and take the hooks off."""
        self._wait_for(self._reload(self._params()) + self._take_prefetched())
        for handle in self._handles:
            handle.remove()
        if self._own_step is not None and self.optimizer.__dict__.get("step") is self._own_step:
            if self._earlier_step is None:
                del self.optimizer.step
            else:
                self.optimizer.step = self._earlier_step  # type: ignore[method-assign]
        self._planned = {}
        handles = self.optimizer.__dict__.get("_fczero_offload", [])
        if self in handles:
            handles.remove(self)


def offload_optimizer_states(
    optimizer: torch.optim.Optimizer,
    *,
    device_bytes: int | str = 0,
    chunk_bytes: int | None = None,
    pin_memory: bool = True,
    memory_budget: int | None = None,
) -> OptimizerOffload:
    """Keep ``optimizer``'s tensor states in host memory between steps (see the module doc).

    Args:
        optimizer: any ``torch.optim.Optimizer`` (its states may be plain tensors or
            DTensors, as under ``fczero.parallelize``). Call this once, before training.
        device_bytes: bytes of state (the first, in parameter order) that stay on the
            device; 0 offloads every tensor state; ``"auto"``: what ``memory_budget``
            leaves above the peak before the first step (CUDA; elsewhere 0).
        chunk_bytes: step in chunks of about this many bytes of parameters, streaming each
            chunk's states in and out (the step then never holds all states on the
            device). None: one whole step, with all offloaded states brought in for it.
        pin_memory: use pinned host buffers (needed for copies that overlap with compute);
            if pinning fails the buffers are pageable and a warning says so.
        memory_budget: with ``device_bytes="auto"``: device bytes to plan within
            (default: the parallelized model's ``memory_budget``, else 90% of the device).

    Returns:
        the :class:`OptimizerOffload` handle: ``prefetch()`` starts the copy back early,
        ``wait()`` finishes copies in flight, ``summary`` says what moved, ``remove()``
        undoes everything.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "fczero.offload_optimizer_states needs a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}."
        )
    if device_bytes != "auto" and (
        isinstance(device_bytes, bool) or not isinstance(device_bytes, int) or device_bytes < 0
    ):
        raise ValueError(
            f"fczero: device_bytes must be an int >= 0 (bytes of state kept on the device) "
            f"or 'auto' (sized from memory_budget), got {device_bytes!r}."
        )
    if memory_budget is not None and (
        device_bytes != "auto"
        or isinstance(memory_budget, bool)
        or not isinstance(memory_budget, int)
        or memory_budget < 0
    ):
        raise ValueError(
            "fczero: memory_budget (an int >= 0, in bytes) sizes device_bytes='auto' and "
            f"nothing else; got memory_budget={memory_budget!r} with device_bytes="
            f"{device_bytes!r}."
        )
    if chunk_bytes is not None and (
        isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0
    ):
        raise ValueError(
            "fczero: chunk_bytes must be None (one whole step) or an int > 0 (bytes of "
            f"parameters per chunk), got {chunk_bytes!r}."
        )
    if not isinstance(pin_memory, bool):
        raise TypeError(f"fczero: pin_memory must be True or False, got {pin_memory!r}.")
    if any(isinstance(h, OptimizerOffload) for h in getattr(optimizer, "_fczero_offload", ())):
        raise ValueError(
            "fczero: this optimizer's states are already offloaded; call "
            "offload_optimizer_states once per optimizer (or .remove() the first handle)."
        )
    handle = OptimizerOffload(optimizer, device_bytes, pin_memory, chunk_bytes, memory_budget)
    optimizer.__dict__.setdefault("_fczero_offload", []).append(handle)
    return handle
