"""What the main job reports: the numbers of a run (``Summary``), how they are measured
(a loss window averaged over steps and ranks, a clock that leaves checkpoint writes out)
and the lines rank 0 prints. ``LEGEND`` (the end of ``--help``) says what each number is
averaged over."""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

LEGEND = (
    "What the numbers are. The first step has a line of its own: its loss, and its wall time, "
    "which includes compilation (--compile) and first-step warm-up; no tok/s counts it. Every "
    "--log-every steps a line gives the loss averaged over the steps named beside it (the "
    "window of --log-every steps ending there; fewer in a last or a resumed run's first "
    "window) and over all ranks, and tok/s: the tokens of all ranks per second over the steps "
    "named beside it. The summary's tok/s is over steps 2..N: their tokens over their wall "
    "time. Time spent writing checkpoints is left out of every time."
)
LEGEND_LINE = (  # the log's short form of LEGEND
    "numbers: loss = mean over the steps in brackets and all ranks; tok/s = tokens of all "
    "ranks per second over the steps in brackets; the first step's time includes "
    "compilation and warm-up, and no tok/s counts it"
)


@dataclass
class Summary:
    """What the run measured; rank 0 prints it as one line and writes it with ``--json``."""

    steps: int
    world_size: int
    backend: str
    compiled: bool
    params: int
    first_loss: float
    """The first step's loss, averaged over the ranks."""
    last_loss: float
    """The last window's loss, averaged over its steps and the ranks."""
    first_step_s: float
    """Wall time of the run's first step (step 1, or the first after ``--resume``):
    compilation with ``--compile``, and first-step warm-up."""
    tokens_per_s: float
    """Global tokens per second over steps 2..N: their tokens over their wall time."""
    peak_memory_mib: float
    peak_memory_kind: str
    wall_s: float
    compiled_blocks: list[str] = field(default_factory=list)
    """The blocks ``--compile-blocks`` compiled on their own (their paths)."""
    losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, loss) of every logged line: the first step's own, then each window's mean."""
    args: dict[str, object] = field(default_factory=dict)


def peak_memory(device: torch.device) -> tuple[float, str]:
    """(MiB, label): CUDA peak allocated on GPU, this process's max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "peak alloc"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10), "max RSS"


class LossMeter:
    """Sums the loss of each step; ``mean`` averages it over the window of steps and the ranks."""

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), device=device)
        self.steps = 0

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss.detach()
        self.steps += 1

    def mean(self, world_size: int, reset: bool = True) -> float:
        """Mean loss since the last reset over its steps and all ranks (a collective: every
        rank calls it); ``reset=False`` leaves the window open."""
        total = self.total.clone()
        dist.all_reduce(total)
        value = total.item() / (self.steps * world_size)
        if reset:
            self.total.zero_()
            self.steps = 0
        return value


class StepClock:
    """Wall time between laps, leaving out what runs inside ``paused()`` (checkpoint writes)."""

    _now = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        self.mark = self._now()
        self.left_out = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self.left_out += self._now() - start

    def lap(self) -> float:
        """Seconds since the last lap (or since creation), less the paused time."""
        now = self._now()
        elapsed = now - self.mark - self.left_out
        self.mark, self.left_out = now, 0.0
        return elapsed


def header_line(
    args: argparse.Namespace, n_params: int, world: int, backend: str, device: torch.device
) -> str:
    mode = "compiled" if args.compile else "each block compiled" if args.compile_blocks else "eager"
    dtypes = f"param {args.param_dtype or 'fp32'}, reduce {args.reduce_dtype or 'param'}"
    stage = "reshard after forward" if not args.no_reshard else "no reshard"
    if args.replicate > 1:
        stage += f", HSDP {args.replicate} replicas x {world // args.replicate} shards"
    return (
        f"fczero.train: Llama {n_params / 1e6:.2f}M params (dim {args.dim}, {args.layers} layers, "
        f"{args.heads} heads) | {world} ranks x batch {args.batch_size} x seq {args.seq_len} | "
        f"{backend} on {device.type} | {mode}, {dtypes}, {stage}"
    )


def steps_label(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def summary_line(s: Summary) -> str:
    first = s.losses[0][0]  # the run's first step (after --resume: not step 1)
    throughput = (
        f"{s.tokens_per_s:,.0f} tok/s ({steps_label(first + 1, s.steps)})"
        if s.steps > first
        else "no tok/s (one step only)"
    )
    return (
        f"done: {s.steps} steps | loss {s.first_loss:.4f} -> {s.last_loss:.4f} | "
        f"{throughput} | first step {s.first_step_s:.2f} s | "
        f"{s.peak_memory_kind} {s.peak_memory_mib:,.0f} MiB "
        f"(rank 0) | wall {s.wall_s:.1f} s"
    )
