"""What the main job reports (fczero/train_report.py): the step clock, the loss meter's
mean over steps and ranks, the step labels and the summary line."""

from __future__ import annotations

import torch

from fczero import train_report
from fczero.testing.distributed import run_on_ranks


def test_step_clock_leaves_out_paused_time(monkeypatch):
    now = iter([0.0, 1.0, 3.0, 5.0, 6.0])  # creation, pause start, pause end, lap, lap
    monkeypatch.setattr(train_report.StepClock, "_now", staticmethod(lambda: next(now)))
    clock = train_report.StepClock()
    with clock.paused():
        pass
    assert clock.lap() == 3.0  # 5 s less the 2 s paused
    assert clock.lap() == 1.0


def _window_means(rank: int, world_size: int) -> tuple[float, float]:
    meter = train_report.LossMeter(torch.device("cpu"))
    for loss in ([1.0, 3.0] if rank == 0 else [5.0, 7.0]):
        meter.add(torch.tensor(loss))
    kept = meter.mean(world_size, reset=False)
    closed = meter.mean(world_size)
    meter.add(torch.tensor(10.0 * (rank + 1)))
    return kept, closed, meter.mean(world_size)


def test_loss_meter_averages_its_window_over_steps_and_ranks():
    for kept, closed, after_reset in run_on_ranks(_window_means, 2):
        assert kept == closed == 4.0  # (1 + 3 + 5 + 7) / (2 steps x 2 ranks)
        assert after_reset == 15.0  # a reset window holds only the step after it


def test_summary_line_names_the_steps_its_numbers_cover():
    summary = train_report.Summary(
        steps=30, world_size=2, backend="gloo", compiled=False, params=1000,
        first_loss=5.5, last_loss=2.25, first_step_s=1.5, tokens_per_s=12345.0,
        peak_memory_mib=2048.0, peak_memory_kind="max RSS", wall_s=9.0,
        losses=[(1, 5.5), (10, 4.0), (30, 2.25)],
    )  # fmt: skip
    line = train_report.summary_line(summary)
    assert line.startswith("done: 30 steps | loss 5.5000 -> 2.2500 | 12,345 tok/s (steps 2-30)")
    assert "max RSS 2,048 MiB (rank 0)" in line and line.endswith("wall 9.0 s")
    one_step = train_report.Summary(**{**summary.__dict__, "steps": 1, "losses": [(1, 5.5)]})
    assert "no tok/s (one step only)" in train_report.summary_line(one_step)
    assert train_report.steps_label(4, 4) == "step 4"
    assert train_report.steps_label(2, 9) == "steps 2-9"


def test_peak_memory_on_the_cpu_is_this_process_rss():
    mib, kind = train_report.peak_memory(torch.device("cpu"))
    assert kind == "max RSS" and mib > 10  # a process that imported torch holds more than 10 MiB
