"""``memory_report(model)``: what the memory planner decided for each compiled graph.

For every forward/backward pair compiled for the model it lists the
planned peak (device bytes, from the memory model, before and after activation
offload), which activations were offloaded and which were kept and why; the
optimizer-state offload's split when its handle is given; the params selective
unsharding keeps gathered from forward to backward, and why; and the measured peak
beside the plan (``torch.cuda.max_memory_allocated`` on CUDA; not measured on CPU).
``MemoryReport.plot(path)`` draws the planned bytes over one step (forward, then
backward) of each graph pair, before and after offload, to a PNG.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fczero.core.state import root_state, state_of
from fczero.core.unsharding import report_line
from fczero.offload.activations import ActivationPlan
from fczero.offload.optimizer import OptimizerOffload, OptimizerOffloadSummary

logger = logging.getLogger("fczero")

__all__ = ["MemoryReport", "memory_report"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclass
class MemoryReport:
    """The planner's decisions for one model; ``str()`` renders them, ``plot`` draws them."""

    plans: list[ActivationPlan]
    optimizer: OptimizerOffloadSummary | None
    measured_peak: int | None
    unsharding: str | None = None  # selective unsharding's plan, in words

    def __str__(self) -> str:
        lines = ["fczero memory report"]
        if not self.plans:
            lines.append(
                "  no compiled graph recorded yet (compile and run a step first; eager mode "
                "has no plan)"
            )
        for i, plan in enumerate(self.plans):
            budget = "none" if plan.budget is None else _mib(plan.budget)
            lines.append(
                f"graph pair {i}: activations={plan.mode!r}, budget {budget}, "
                f"planned peak {_mib(plan.peak_before)} -> {_mib(plan.peak_after)} "
                f"(forward {_mib(plan.forward_peak)}, backward {_mib(plan.backward_peak)}), "
                f"{plan.hoisted} reloads issued ahead, {plan.delayed} offload waits delayed"
            )
            for name, size in plan.offloaded:
                lines.append(f"  offloaded {name:<24} {_mib(size):>12}")
            for name, size, why in plan.kept:
                lines.append(f"  kept      {name:<24} {_mib(size):>12}  ({why})")
        if self.optimizer is not None:
            lines.append(
                f"optimizer states: {len(self.optimizer.offloaded)} tensors "
                f"({_mib(self.optimizer.offloaded_bytes)}) in host memory, "
                f"{len(self.optimizer.kept)} ({_mib(self.optimizer.kept_bytes)}) kept on "
                "the device (device_bytes)"
            )
            if self.optimizer.sizing:
                lines.append(f"  device_bytes: {self.optimizer.sizing}")
        if self.unsharding is not None:
            lines.append(f"selective unsharding: {self.unsharding}")
        planned = max((p.peak_after for p in self.plans), default=None)
        measured = "not measured (CPU)" if self.measured_peak is None else _mib(self.measured_peak)
        estimate = "n/a" if planned is None else _mib(planned)
        lines.append(
            f"planned graph peak {estimate} (activations and temporaries, params and "
            f"optimizer state excluded) vs measured peak {measured} (everything allocated)"
        )
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """Save a PNG of planned device bytes over one step, per graph pair; returns ``path``.
        Needs matplotlib (``pip install matplotlib``, or fczero's ``[bench]`` extra)."""
        try:
            import matplotlib
        except ImportError as err:
            raise ImportError(
                "fczero.memory_report(...).plot needs matplotlib: pip install matplotlib "
                "(the text report, str(report), needs nothing)."
            ) from err

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        for i, plan in enumerate(self.plans):
            for label, (fw, bw), style in (
                ("without offload", plan.curve_before, "--"),
                ("planned", plan.curve_after, "-"),
            ):
                curve = [b / 2**20 for b in fw + bw]
                ax.plot(range(len(curve)), curve, style, label=f"graph pair {i}: {label}")
            ax.axvline(len(plan.curve_after[0]), color="grey", linewidth=0.8)
        if self.plans and self.plans[0].budget is not None:
            ax.axhline(self.plans[0].budget / 2**20, color="red", linewidth=0.8, label="budget")
        ax.set_xlabel("graph node (forward | backward)")
        ax.set_ylabel("planned device MiB")
        ax.set_title("fczero: planned memory over one step")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def memory_report(
    model: nn.Module,
    *,
    optimizer_offload: OptimizerOffload | None = None,
    measured_peak: int | None = None,
) -> MemoryReport:
    """The memory plan of ``model`` (a parallelized model that has been compiled and run).

    Args:
        model: the model passed to ``fczero.parallelize``.
        optimizer_offload: the handle ``offload_optimizer_states`` returned, if any.
        measured_peak: bytes to show as measured; by default the CUDA allocator's peak on
            the model's device (``torch.cuda.max_memory_allocated``), none on CPU.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fczero.memory_report needs an nn.Module, got {type(model).__name__}.")
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not sharded:
        raise ValueError(
            "fczero.memory_report: this model has no sharded params; call "
            "fczero.parallelize(model, mesh) first."
        )
    device = sharded[0].device
    if measured_peak is None and device.type == "cuda":
        measured_peak = torch.cuda.max_memory_allocated(device)
    summary = optimizer_offload.summary if optimizer_offload is not None else None
    root = root_state(model)
    kept = None if root is None else report_line(root.kept, root.auto_unsharding)
    # its plans: of the graphs compiled since parallelize, kept with its root's pass
    # settings (found through a param: ``model`` may be the root's compiled wrapper)
    state = state_of(sharded[0])
    settings = state.root.passes if state is not None else None
    plans = list(settings.plans) if settings is not None else []
    return MemoryReport(plans, summary, measured_peak, kept)
