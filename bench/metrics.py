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
"""

from __future__ import annotations

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
