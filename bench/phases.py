"""Per-phase timing of one arm: where a step's time goes, host versus GPU.

A step is three phases: forward (the loss), backward, and the optimizer update (step and
zero_grad). For each timed step and phase this records

    host ms  perf_counter time inside the phase's Python call (what the CPU spends issuing it)
    GPU ms   time between CUDA events recorded on the current stream before and after it

without synchronizing between phases, so the phases overlap as they do in a plain step.
A phase whose GPU ms is close to its host ms is host-bound (the GPU waited for launches);
one whose GPU ms is much larger is GPU-bound. On CPU only host ms is recorded. On CUDA one
more step, synchronized between phases, records each phase's peak memory (``memory``).

With ``cprofile=True`` the same steps also run under ``cProfile`` and the functions with
the most own time, per phase, come back as text (the profiler slows the host: use it to
see *where*, and the timings without it for *how much*).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from bench.report import PHASES

if TYPE_CHECKING:
    from bench.arms import TrainStep


def _event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def time_phases(
    step: TrainStep,
    batches: Sequence[torch.Tensor],
    *,
    steps: int,
    device: torch.device,
    cprofile: bool = False,
    top: int = 25,
) -> dict[str, object]:
    """Median host ms and GPU ms of each phase over ``steps`` steps (run after warm-up);
    with ``cprofile``, also ``"profile"``: the top own-time functions of each phase."""
    profilers = {name: cProfile.Profile() for name in PHASES} if cprofile else {}
    host: dict[str, list[float]] = {name: [] for name in PHASES}
    marks: list[list[torch.cuda.Event | None]] = []

    def run(name: str, fn, *args):
        profiler = profilers.get(name)
        t0 = time.perf_counter()
        with profiler if profiler is not None else nullcontext():
            out = fn(*args)
        host[name].append((time.perf_counter() - t0) * 1e3)
        return out

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for i in range(steps):
        events = [_event(device)]
        loss = run("forward", step.forward, batches[i % len(batches)])
        events.append(_event(device))
        run("backward", step.backward, loss)
        events.append(_event(device))
        run("update", step.update)
        events.append(_event(device))
        marks.append(events)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result: dict[str, object] = {}
    for k, name in enumerate(PHASES):
        entry = {"host_ms": statistics.median(host[name])}
        if device.type == "cuda":
            entry["gpu_ms"] = statistics.median(e[k].elapsed_time(e[k + 1]) for e in marks)
        result[name] = entry
    if device.type == "cuda":
        result["memory"] = phase_memory(step, batches[0], device)
    if cprofile:
        result["profile"] = {name: _top(profilers[name], top) for name in PHASES}
    return result


def phase_memory(step: TrainStep, tokens: torch.Tensor, device: torch.device) -> dict:
    """One more step, synchronized between phases: each phase's peak and what stays
    allocated after it (GiB), so a peak can be placed in forward, backward or the update."""
    gib = 2**30
    out: dict[str, dict[str, float]] = {}
    loss = None
    for name in PHASES:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        if name == "forward":
            loss = step.forward(tokens)
        elif name == "backward":
            step.backward(loss)
            loss = None
        else:
            step.update()
        torch.cuda.synchronize(device)
        out[name] = {
            "peak_gib": torch.cuda.max_memory_allocated(device) / gib,
            "after_gib": torch.cuda.memory_allocated(device) / gib,
        }
    return out


def _top(profiler: cProfile.Profile, top: int) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()
