"""Timing and memory of one arm: first step, warm-up, then timed steps.

``measure(step, batches, ...)`` runs ``step`` (one optimizer step on a (B, T+1)
token batch, returning the detached loss) ``warmup + steps`` times at least and
returns a :class:`Measurement`:

- step time: median over the timed steps, from CUDA events on a GPU
  (``perf_counter`` on CPU, where every step is synchronous anyway);
- host time: median ``perf_counter`` time spent inside the ``step`` call (no sync),
  i.e. the CPU's launch cost, or the step time where the CPU blocks;
- first-step time: wall clock with a sync, compilation included;
- peak memory: ``torch.cuda.max_memory_allocated`` since the caller's reset;
- every step's loss, kept as tensors until the end so timing never syncs.

``derived(...)`` turns a step time into tokens/s and model TFLOP/s per GPU.

Host memory (``HostMemory``): the process's resident set and its high-water mark from
``/proc/self/status`` (``VmRSS``, ``VmHWM``; ``getrusage``'s ``ru_maxrss`` where there is
no ``/proc``), reset per arm by writing ``5`` to ``/proc/self/clear_refs`` (Linux 4.0+), and
the CUDA caching host allocator's pinned bytes (``torch.cuda.host_memory_stats``), whose
cache is emptied between arms so one arm's pinned blocks are not counted in the next.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

StepFn = Callable[[torch.Tensor], torch.Tensor]

GIB = float(1 << 30)


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What ``measure`` saw on this rank."""

    step_ms: float
    """Median step time over the timed steps."""
    step_ms_all: list[float]
    """Every timed step's time, in order."""
    host_ms: float
    """Median time the CPU spent inside the step call."""
    first_step_s: float
    """Wall time of the first step, synchronized (compilation included)."""
    losses: list[float]
    """This rank's loss at every step, first to last."""
    peak_mem_gib: float | None
    """Peak allocated GPU memory since the caller's reset; None on CPU."""
    peak_reserved_gib: float | None
    """Peak reserved (cached) GPU memory; None on CPU."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    """Forget the peak: call after freeing the previous arm and again after setup."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def measure(
    step: StepFn,
    batches: Sequence[torch.Tensor],
    *,
    warmup: int,
    steps: int,
    device: torch.device,
) -> Measurement:
    """Run ``warmup`` untimed steps (the first one timed on its own), then ``steps`` timed ones."""
    if warmup < 1 or steps < 1:
        raise ValueError(f"need warmup >= 1 and steps >= 1, got {warmup} and {steps}.")
    losses: list[torch.Tensor] = []

    def batch(i: int) -> torch.Tensor:
        return batches[i % len(batches)]

    synchronize(device)
    t0 = time.perf_counter()
    losses.append(step(batch(0)))
    synchronize(device)
    first_step_s = time.perf_counter() - t0
    for i in range(1, warmup):
        losses.append(step(batch(i)))
    synchronize(device)

    host: list[float] = []
    wall: list[float] = []
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    for i in range(warmup, warmup + steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        h0 = time.perf_counter()
        losses.append(step(batch(i)))
        host.append(time.perf_counter() - h0)
        if device.type == "cuda":
            end.record()
            events.append((start, end))
        else:
            wall.append(host[-1])
    synchronize(device)
    if device.type == "cuda":
        step_ms_all = [start.elapsed_time(end) for start, end in events]
    else:
        step_ms_all = [w * 1e3 for w in wall]

    peak = reserved = None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / GIB
        reserved = torch.cuda.max_memory_reserved(device) / GIB
    return Measurement(
        step_ms=statistics.median(step_ms_all),
        step_ms_all=step_ms_all,
        host_ms=statistics.median(host) * 1e3,
        first_step_s=first_step_s,
        losses=torch.stack([loss.detach().float().reshape(()) for loss in losses]).cpu().tolist(),
        peak_mem_gib=peak,
        peak_reserved_gib=reserved,
    )


def derived(step_ms: float, *, batch: int, seq_len: int, flops_per_token: int) -> dict[str, float]:
    """Tokens/s and model TFLOP/s per GPU for one step of ``batch x seq_len`` tokens per GPU."""
    tokens = batch * seq_len
    seconds = step_ms / 1e3
    return {
        "tokens_per_s_per_gpu": tokens / seconds,
        "tflops_per_gpu": flops_per_token * tokens / seconds / 1e12,
    }


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def host_rss_bytes() -> int | None:
    """This process's resident set now (``VmRSS``)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def host_peak_bytes() -> int:
    """This process's resident high-water mark since start or the last :func:`reset_host_peak`."""
    kib = _status_kib("VmHWM")
    if kib is None:  # no /proc: the lifetime peak (kilobytes on Linux)
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def reset_host_peak() -> bool:
    """Start ``VmHWM`` again from the current resident set; False where the kernel does not allow it."""
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def empty_host_cache() -> None:
    """Give the CUDA caching host allocator's free pinned blocks back to the OS."""
    for fn in (
        getattr(getattr(torch, "accelerator", None), "empty_host_cache", None),
        getattr(torch._C, "_host_emptyCache", None),
    ):
        if fn is not None and torch.cuda.is_available():
            fn()
            return


def _pinned_stats() -> dict | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        return stats()
    except RuntimeError:
        return None


class HostMemory:
    """Host memory of one arm: ``start()`` before it is built, ``read()`` after its steps."""

    def __init__(self) -> None:
        self.base_bytes: int | None = None
        self.reset_ok = False

    def start(self) -> None:
        empty_host_cache()
        self.reset_ok = reset_host_peak()
        reset = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
        if reset is not None and torch.cuda.is_available():
            try:
                reset()
            except RuntimeError:
                pass
        self.base_bytes = host_rss_bytes()

    def read(self) -> dict[str, float | bool | None]:
        """``host_peak_gib`` (VmHWM, the whole process), ``host_base_gib`` (resident when the
        arm started), ``pinned_peak_gib`` (pinned blocks the allocator held at most), and
        ``host_peak_is_arm``: False where the peak could not be reset (it then covers every
        arm so far in this process)."""
        stats = _pinned_stats() or {}
        pinned = stats.get("allocated_bytes.peak", stats.get("allocated_bytes.all.peak"))
        return {
            "host_peak_gib": host_peak_bytes() / GIB,
            "host_base_gib": None if self.base_bytes is None else self.base_bytes / GIB,
            "pinned_peak_gib": None if pinned is None else pinned / GIB,
            "host_peak_is_arm": self.reset_ok,
        }
