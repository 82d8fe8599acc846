"""Optimizer-state offload: an optimizer's tensor states live in host memory between steps.

``offload_optimizer_states(optimizer)`` hooks the optimizer's ``step``: after each step
every tensor state (AdamW's ``exp_avg``/``exp_avg_sq``, SGD's momentum buffer, ...) is
copied to a host buffer (pinned when possible) on a write-back stream and the state
tensor is pointed at that buffer, so its device memory is freed once the copy has read
it. Before the next step the states are copied back on the side stream (after the
write-back stream: the buffers must be complete) and the step's kernels wait for them.
``prefetch()`` starts that copy early (e.g. after forward) so it overlaps with backward;
otherwise the step starts it itself.

With ``chunk_bytes`` the step runs in chunks of parameters (about that many bytes of
parameters each, in parameter order): the states of one chunk are brought in while the
previous chunk steps, then sent back, so at most two chunks of states are on the device
at once, also at the step (without chunks the step needs all of them). Each parameter
is stepped exactly once per step, with its group's hyperparameters, so the result is
the same as one whole step for optimizers whose update is per parameter (all of
``torch.optim``'s, except with options that couple parameters, such as a global
gradient-norm in the optimizer itself). A ``closure`` disables chunking for that call
(with params in host memory, see below, it is evaluated first and the chunks step after).

With parameter offload (``OffloadPolicy(params=True)``) the params and grads
are in host memory too, and without this function the optimizer steps there, on the
CPU. With it, the step runs on the device instead: each chunk's param shards, grads and
states are copied in (the next chunk's while this one steps), the chunk steps on the
device, and the updated shards and states are copied back ([Note: the device step]).

States keep their identity: the state tensors (or, for DTensor states, their local
tensors) have their ``.data`` swapped, so ``optimizer.state`` and ``state_dict()`` stay
valid (between steps they hold host tensors, which is what a checkpoint wants).
``device_bytes`` lets the first states (in parameter order) up to that many bytes stay
on the device. ``device_bytes="auto"`` sizes that from ``memory_budget`` (default: the
``memory_budget`` of the model ``parallelize`` sharded these params for, else 90% of the
device) at the first step: right before it, the allocator's peak so far is what
forward and backward need without any state on the device, so what the budget leaves
above it, less what a chunked step holds in flight (``state_budget``), may hold states
(DeepCompile's adaptive offload: only what does not fit is offloaded; CUDA only: elsewhere
every state is offloaded, and the log says why). A peak above a ``memory_budget`` the user
gave is an error that names the minimum; above the default budget, every state is
offloaded and a warning says so. The decision is this rank's own: no
collective depends on it. On a machine without CUDA nothing needs moving; the states are still
copied to separate host buffers (so the mechanism runs everywhere) and a warning says
once that no memory is saved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fczero.core import offload_sizing, streams, unsharding
from fczero.core.state import (
    OptimizerState,
    StateOffload,
    compute_device_of,
    optimizer_state,
    options_of,
)
from fczero.offload import state_budget
from fczero.runtime.step_hooks import one_step_in_parts, roots_of

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


def _wait_for_current(devices: set[torch.device]) -> set[torch.device]:
    """Let each CUDA side stream wait for its current stream (new device memory may be a
    block that kernels queued there still use) and for the write-back stream (a host
    buffer about to be read may still be being written); returns ``devices``."""
    for device in devices:
        if device.type == "cuda":
            side = streams.side_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            side.wait_stream(streams.writeback_stream(device))
    return devices


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t



def _step_device(param: torch.Tensor) -> torch.device | None:
    """Where a param whose shard lives in host memory (param offload) steps; None for
    params that are where their compute is."""

    return compute_device_of(param)


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new copy of ``host`` on ``device``: on CUDA started on the side stream (the caller
    records an event there and waits for it before use); elsewhere a plain clone."""
    if device.type != "cuda":
        return host.clone()
    side = streams.side_stream(device)
    dest = torch.empty(host.shape, dtype=host.dtype, device=device)
    with torch.cuda.stream(side):
        dest.copy_(host, non_blocking=True)
    dest.record_stream(side)
    return dest


def _download(current: torch.Tensor, host: torch.Tensor) -> None:
    """Copy device tensor ``current`` into ``host``; on CUDA on the write-back stream, after
    the work already queued on the current stream (``current`` is kept until it is read).
    Whoever reads ``host`` next waits for that stream (``_reload``, ``_synchronize``)."""
    if current.device.type != "cuda":
        host.copy_(current)
        return
    back = streams.writeback_stream(current.device)
    back.wait_stream(torch.cuda.current_stream(current.device))
    with torch.cuda.stream(back):
        host.copy_(current, non_blocking=True)
    current.record_stream(back)


def _synchronize(devices) -> None:
    """Block until every copy in or out on these devices has finished."""
    for device in devices:
        if device.type == "cuda":
            streams.side_stream(device).synchronize()
            streams.writeback_stream(device).synchronize()


def _side_events(devices) -> list[torch.cuda.Event]:
    """An event on each CUDA device's side stream, marking the copies issued so far."""
    out = []
    for device in devices:
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(streams.side_stream(device))
            out.append(event)
    return out


def _on_device(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` (a tensor or a DTensor) as a new tensor on ``device``; see ``_upload``."""
    if isinstance(value, DTensor):
        return DTensor(_upload(value._local_tensor, device), value._spec, requires_grad=False)
    return _upload(value, device)


def _on_host(value):
    """``value`` as a host tensor (a DTensor whose outer device says so too); non-tensors
    as they are."""
    if not isinstance(value, torch.Tensor) or value.device.type == "cpu":
        return value
    if isinstance(value, DTensor):
        return DTensor(value._local_tensor.cpu(), value._spec, requires_grad=False)
    return value.cpu()


def _states_to(states: dict, device: torch.device, group: dict) -> dict:
    """``states`` with every tensor that is in host memory but not planned (fresh from
    ``load_state_dict``, which puts them beside the host param) moved to ``device``.
    Scalars stay unless the group's kernels want them there (fused, capturable)."""
    scalars_too = bool(group.get("fused") or group.get("capturable"))
    for key, value in states.items():
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            continue  # (planned states were reloaded just before)
        if value.device == device or (value.dim() == 0 and not scalars_too):
            continue
        states[key] = _on_device(value, device)
    return states


@dataclass
class _StandIn:
    """A device copy of one host-resident param (and its grad) that the device step updates
    in its place; afterwards the new values are copied back into the host shard."""

    param: torch.Tensor
    proxy: nn.Parameter


class OptimizerOffload(StateOffload):
    """The hooks that keep one optimizer's states in host memory; see the module docstring."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device_bytes: int | str,
        pin: bool,
        chunk_bytes: int | None,
        memory_budget: int | None = None,
    ) -> None:
        super().__init__(optimizer)
        self.auto = device_bytes == "auto"
        self.device_bytes = 0 if self.auto else device_bytes
        self.memory_budget = memory_budget
        self.pin = pin
        self.chunk_bytes = chunk_bytes
        self.summary = OptimizerOffloadSummary()
        self._planned: dict[torch.Tensor, list[_Slot]] = {}  # param -> its offloaded states
        self._inside_chunks = False
        self._said_cpu = False  # "states already in CPU memory" warned (once per handle)
        self._prefetched: list[torch.cuda.Event] = []  # copies prefetch() started
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            optimizer.register_state_dict_pre_hook(lambda opt: self.wait()),
            optimizer.register_load_state_dict_post_hook(self._after_load),
        ]
        self._own_step = None
        self._earlier_step = optimizer.__dict__.get("step")  # e.g. a scheduler's wrapper
        self._step_devices = {id(p): _step_device(p) for _, p in self._params()}
        self.device_step = any(d is not None for d in self._step_devices.values())
        if chunk_bytes is not None or self.device_step:
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
            if any(s.device.type == "cpu" for s in slots) and not self._said_cpu:
                self._said_cpu = True
                streams.warn(
                    "fczero: optimizer states are already in CPU memory (no CUDA device); "
                    "offloading copies them between host buffers and saves no memory."
                )

    # -- copies ----------------------------------------------------------------------
    def _reload(self, params) -> list[torch.cuda.Event]:
        """Start copying the states of ``params`` back; returns events to wait for (CUDA)."""
        return _side_events(self._upload_states(params))

    def _upload_states(self, params, devices: set[torch.device] = frozenset()) -> set:
        """Issue the copies of ``params``' offloaded states back to their devices, once the
        side streams of those (and of ``devices``) may go on; returns all those devices."""
        slots = [s for _, p in params for s in self._planned.get(p, ()) if not s.on_device]
        devices = _wait_for_current({s.device for s in slots} | devices)
        for slot in slots:
            slot.on_device = True
            slot.target.data = _upload(slot.host, slot.device)
        return devices

    def _offload(self, params) -> None:
        for _, p in params:
            for slot in self._planned.get(p, ()):
                if slot.on_device:
                    slot.on_device = False
                    _download(slot.target.data, slot.host)
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
        _synchronize({s.device for s in self.slots or ()})

    def _size_from_budget(self) -> None:
        """``device_bytes="auto"``, once, before the first step (``state_budget``)."""
        if not self.auto or self.summary.sizing:
            return
        params = [p for _, p in self._params()]
        device = _local(params[0]).device if params else torch.device("cpu")
        budget = self.memory_budget
        if budget is None and params:  # the parallelized model's budget, if it has one
            options = options_of(params[0])
            budget = options.memory_budget if options is not None else None
        chunks = self._chunks(self._params()) if self.chunk_bytes is not None else []
        reserve = state_budget.in_flight_bytes(
            [sum(offload_sizing.local_nbytes(p) for _, p in c) for c in chunks],
            self.device_step,
        )
        self.device_bytes, self.summary.sizing = state_budget.plan_device_bytes(
            device, budget, reserve
        )

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
            nbytes = offload_sizing.local_nbytes(p)
            if current and self.chunk_bytes is not None and size + nbytes > self.chunk_bytes:
                chunks.append(current)
                current, size = [], 0
            current.append((name, p))
            size += nbytes
        if current:
            chunks.append(current)
        return chunks

    # [Note: the device step]
    # Under param offload (``OffloadPolicy(params=True)``) a param's shard, its grad and its
    # states all live in pinned host memory. Stepping there is what FSDP2's
    # CPUOffloadPolicy does; the step then runs at the host's speed. Here each chunk is
    # instead copied to the device on the side stream while the chunk before it steps:
    # states through their slots, as without param offload; params and grads as
    # *stand-ins*, new device Parameters (DTensors with the same spec) that take the
    # param's place in its group, and its entry in ``optimizer.state``, for that chunk's
    # ``step()``. After it, the states go back to the param's entry (then to their
    # host buffers) and the stand-in's values are copied into the host shard, so the
    # param keeps its identity, its storage and its state. The optimizer sees ordinary
    # device tensors, so it picks its device kernels (foreach, fused) by itself. The
    # step begins with fczero's pre-step work over all params (which, under param
    # offload, waits for the device: forward's copies may still read the host shards)
    # and ends by waiting for the last copies back (the next forward reads the shards).
    def _chunked_step(self, closure=None):
        loss = None
        if closure is not None:
            if not self.device_step:
                return self._whole_step(closure)
            with torch.enable_grad():  # params on the host: the grads first, then the chunks
                loss = closure()

        self._size_from_budget()
        opt = self.optimizer
        groups = opt.param_groups
        all_params = [list(g["params"]) for g in groups]
        group_of = {id(p): g for g, params in zip(groups, all_params) for p in params}
        chunks = self._chunks(self._params())
        self.summary.chunks = len(chunks)
        with one_step_in_parts(opt):
            pending = self._bring_in(chunks[0], group_of) if chunks else ({}, [])
            pending[1].extend(self._take_prefetched())
            self._inside_chunks = True
            try:
                for i, chunk in enumerate(chunks):
                    stand_ins, ready = pending
                    if i + 1 < len(chunks):
                        pending = self._bring_in(chunks[i + 1], group_of)  # overlaps with this step
                    self._wait_for(ready)
                    members = {id(p) for _, p in chunk}
                    for g, params in zip(groups, all_params):
                        g["params"] = [
                            stand_ins[id(p)].proxy if id(p) in stand_ins else p
                            for p in params
                            if id(p) in members
                        ]
                    opt.param_groups = [g for g in groups if g["params"]]
                    try:
                        self._whole_step()
                    finally:
                        for g, params in zip(groups, all_params):
                            g["params"] = params
                        opt.param_groups = groups
                        self._send_back(stand_ins.values())
                    self._plan(chunk)
                    self._offload(chunk)
            finally:
                self._inside_chunks = False
            if self.device_step:  # the next forward (or a checkpoint) reads the host shards
                _synchronize(set(self._step_devices.values()) - {None})
        return loss

    def _bring_in(
        self, chunk, group_of: dict[int, dict]
    ) -> tuple[dict[int, _StandIn], list[torch.cuda.Event]]:
        """Start copying ``chunk``'s offloaded states back, and its host-resident params and
        grads to their devices as stand-ins ([Note: the device step]); returns the
        stand-ins by param id and the events to wait for. ``group_of``: param id -> group."""
        moving = [(p, self._step_devices.get(id(p))) for _, p in chunk if p.grad is not None]
        moving = [(p, d) for p, d in moving if d is not None]  # (others step where they are)
        devices = self._upload_states(chunk, {d for _, d in moving})
        stand_ins: dict[int, _StandIn] = {}
        state = self.optimizer.state
        for p, device in moving:
            proxy = nn.Parameter(_on_device(p.detach(), device), requires_grad=p.requires_grad)
            proxy.grad = _on_device(p.grad, device)
            if p in state:
                state[proxy] = _states_to(state.pop(p), device, group_of[id(p)])
            stand_ins[id(p)] = _StandIn(p, proxy)
        return stand_ins, _side_events(devices)


    def _send_back(self, stand_ins) -> None:
        """After a chunk's step: the stand-ins' states return to their params, and the
        updated values are copied into the host shards."""
        state = self.optimizer.state
        for s in stand_ins:
            if s.proxy in state:
                state[s.param] = state.pop(s.proxy)
            _download(_local(s.proxy.detach()), _local(s.param.detach()))

    def _after_load(self, optimizer) -> None:
        """Loaded states are new tensors on the params' devices: plan again after the next step."""
        self.wait()
        self._planned = {}
        self.summary = OptimizerOffloadSummary(sizing=self.summary.sizing)

    def remove(self) -> None:
        """Bring every state back to its device for good and take the hooks off (states of
        params in host memory stay there, where the host step wants them)."""
        params = self._params()
        at_home = [(n, p) for n, p in params if self._step_devices.get(id(p)) is None]
        self._wait_for(self._reload(at_home) + self._take_prefetched())
        self.wait()
        state = self.optimizer.state
        for _, p in params:
            if self._step_devices.get(id(p)) is not None and p in state:
                state[p] = {k: _on_host(v) for k, v in state[p].items()}
        for handle in self._handles:
            handle.remove()
        if self._own_step is not None and self.optimizer.__dict__.get("step") is self._own_step:
            if self._earlier_step is None:
                del self.optimizer.step
            else:
                self.optimizer.step = self._earlier_step  # type: ignore[method-assign]
        self._planned = {}
        handles = OptimizerState.of(self.optimizer).offload
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
            leaves above the peak before the first step, less three chunks in flight with
            ``chunk_bytes`` (CUDA; elsewhere 0).
        chunk_bytes: step in chunks of about this many bytes of parameters, streaming each
            chunk's states in and out (the step then never holds all states on the
            device). None: one whole step, with all offloaded states brought in for it.
        pin_memory: use pinned host buffers (needed for copies that overlap with compute);
            if pinning fails the buffers are pageable and a warning says so.
        memory_budget: with ``device_bytes="auto"``: device bytes to plan within
            (default: the parallelized model's ``memory_budget``, else 90% of the device).

    Offloading states asks for the least device memory, so the params that
    ``CommPolicy(keep_unsharded="shard")`` (the default) kept gathered from forward to
    backward are freed after forward again; a ``keep_unsharded`` given in bytes stays.

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
    if any(isinstance(h, OptimizerOffload) for h in OptimizerState.of(optimizer).offload):
        raise ValueError(
            "fczero: this optimizer's states are already offloaded; call "
            "offload_optimizer_states once per optimizer (or .remove() the first handle)."
        )
    for root in roots_of(optimizer):  # the least device memory is asked for
        unsharding.drop_default_plan(root, "offload_optimizer_states")
    kept = 0 if device_bytes == "auto" else device_bytes  # (auto: decided at the first step)
    offload_sizing.check_optimizer_states(optimizer, kept, pin_memory, _step_device)
    handle = OptimizerOffload(optimizer, device_bytes, pin_memory, chunk_bytes, memory_budget)
    optimizer_state(optimizer).offload.append(handle)
    return handle
