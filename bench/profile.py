"""Profile mode: a torch.profiler trace per arm, and how much communication is exposed.

Exposed communication is the time collective kernels run with no compute kernel
alongside, over the GPU kernels of the trace (all streams of this rank's device):

    comm     = union of NCCL kernel intervals                   |====|   |=====|
    compute  = union of every other kernel's intervals        |==|  |======|
    exposed  = |comm| - |comm ∩ compute|                          ^^       ^^

Memory copies and memsets count as neither. Values are per step: totals divided by
the number of profiled steps. On CPU (gloo) there are no kernels and every figure is 0.

What communication costs the matmuls beside it shows in two more figures: the summed
duration of the matmul kernels (``matmul_ms``; the same matmuls run in every arm of a
regime, so an arm's excess over the floor's is their slowdown) and how much of that time
a collective kernel ran alongside (``matmul_beside_comm_ms``).
"""

from __future__ import annotations

import gzip
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.metrics import StepFn, synchronize

logger = logging.getLogger("fczero.bench")

Interval = tuple[float, float]

COMM_MARKERS = ("nccl",)
"""A kernel whose lower-cased name holds one of these is a collective."""


@dataclass(frozen=True, kw_only=True)
class ProfileSummary:
    """Per-step figures from one rank's trace (times in ms)."""

    steps: int
    comm_ms: float
    """Time at least one collective kernel runs."""
    exposed_comm_ms: float
    """Time a collective kernel runs and no compute kernel does."""
    compute_ms: float
    """Time at least one non-collective kernel runs."""
    comm_kernel_ms: float = 0.0
    """Summed duration of the collective kernels (more than ``comm_ms`` where they overlap)."""
    matmul_ms: float = 0.0
    """Summed duration of the matmul kernels (``MATMUL_MARKERS``)."""
    matmul_beside_comm_ms: float = 0.0
    """Time a matmul kernel runs while a collective kernel does."""
    host_ms: float
    """CPU time inside the step call while profiling (profiler overhead included)."""
    kernels: int
    """Kernels per step."""
    collectives: dict[str, int]
    """Collective kernels per step by kind (``AllGather``, ``ReduceScatter``, ...)."""
    trace: str | None
    """File name of the trace, relative to the output folder; None where not written."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of ``[start, end)`` intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(merged: Sequence[Interval]) -> float:
    return sum(e - s for s, e in merged)


def overlap(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Measure of the intersection of two merged (sorted, disjoint) interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


MATMUL_MARKERS = ("gemm", "nvjet", "cutlass", "xmma")
"""A kernel whose lower-cased name holds one of these is a matmul (cuBLAS's and CUTLASS's
names on Hopper; Triton's own matmuls are named ``triton_tem_fused_mm...``)."""


def is_matmul_kernel(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in MATMUL_MARKERS) or "triton_tem" in lowered


def matmul_times(trace_events: Iterable[dict]) -> tuple[float, float, float]:
    """(summed collective kernel time, summed matmul kernel time, matmul time beside a
    collective) in µs from Chrome-trace events."""
    comm: list[Interval] = []
    matmul: list[Interval] = []
    for ev in _kernels(trace_events):
        start = float(ev["ts"])
        interval = (start, start + float(ev.get("dur", 0.0)))
        name = str(ev.get("name", ""))
        if is_comm_kernel(name):
            comm.append(interval)
        elif is_matmul_kernel(name):
            matmul.append(interval)
    summed = lambda intervals: sum(e - s for s, e in intervals)  # noqa: E731
    return summed(comm), summed(matmul), overlap(merge(matmul), merge(comm))


def _kernels(trace_events: Iterable[dict]) -> Iterable[dict]:
    return (ev for ev in trace_events if ev.get("ph") == "X" and ev.get("cat") == "kernel")


def is_comm_kernel(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in COMM_MARKERS)


COLLECTIVE_KINDS = ("AllGather", "ReduceScatter", "AllReduce", "Broadcast", "SendRecv")


def collective_counts(trace_events: Iterable[dict]) -> dict[str, int]:
    """How many collective kernels of each kind the trace holds (``other`` for the rest)."""
    counts: dict[str, int] = {}
    for ev in trace_events:
        name = str(ev.get("name", ""))
        if ev.get("ph") != "X" or ev.get("cat") != "kernel" or not is_comm_kernel(name):
            continue
        kind = next((k for k in COLLECTIVE_KINDS if k.lower() in name.lower()), "other")
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def kernel_times(trace_events: Iterable[dict]) -> tuple[list[Interval], list[Interval]]:
    """(collective, compute) kernel intervals in µs from Chrome-trace events."""
    comm: list[Interval] = []
    compute: list[Interval] = []
    for ev in _kernels(trace_events):
        start = float(ev["ts"])
        interval = (start, start + float(ev.get("dur", 0.0)))
        (comm if is_comm_kernel(str(ev.get("name", ""))) else compute).append(interval)
    return comm, compute


def exposed_comm(trace_events: Iterable[dict]) -> tuple[float, float, float, int]:
    """(comm, exposed comm, compute, kernel count) in µs over the whole trace."""
    comm, compute = kernel_times(trace_events)
    comm_u, compute_u = merge(comm), merge(compute)
    busy = length(comm_u)
    return busy, busy - overlap(comm_u, compute_u), length(compute_u), len(comm) + len(compute)


def load_trace(path: str | Path) -> list[dict]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def profile_steps(
    step: StepFn,
    batches: Sequence[torch.Tensor],
    *,
    steps: int,
    device: torch.device,
    trace_path: Path,
    keep_trace: bool,
) -> ProfileSummary:
    """Run ``steps`` more steps under torch.profiler; summarize this rank's kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    host: list[float] = []
    synchronize(device)
    with profile(activities=activities) as prof:
        for i in range(steps):
            h0 = time.perf_counter()
            step(batches[i % len(batches)])
            host.append(time.perf_counter() - h0)
        synchronize(device)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    events = load_trace(trace_path)
    comm, exposed, compute, kernels = exposed_comm(events)
    counts = collective_counts(events)
    comm_kernels, matmul, matmul_beside = matmul_times(events)
    if not keep_trace:
        trace_path.unlink()
    summary = ProfileSummary(
        steps=steps,
        comm_ms=comm / 1e3 / steps,
        exposed_comm_ms=exposed / 1e3 / steps,
        compute_ms=compute / 1e3 / steps,
        comm_kernel_ms=comm_kernels / 1e3 / steps,
        matmul_ms=matmul / 1e3 / steps,
        matmul_beside_comm_ms=matmul_beside / 1e3 / steps,
        host_ms=sum(host) * 1e3 / steps,
        kernels=kernels // steps,
        collectives={kind: n // steps for kind, n in sorted(counts.items())},
        trace=trace_path.relative_to(trace_path.parent.parent).as_posix() if keep_trace else None,
    )
    logger.info("profile: %s", summary)
    return summary
