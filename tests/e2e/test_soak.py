"""bench/soak.py: the CPU smoke run end to end, and the checks that make a soak fail."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is a folder of the repo, not an installed package
    sys.path.insert(0, str(REPO))

from bench import soak


def test_smoke_soak_writes_windows(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "soak"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--smoke", "--out", str(out)],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((out / "soak.json").read_text())
    assert result["status"] == "ok", result["problems"]
    assert result["recompiles_after_warmup"] == [0, 0]
    assert [w["end_step"] for w in result["windows"]] == [4, 6]
    assert all(w["steps"] == 2 and w["tokens_per_s_per_gpu"] > 0 for w in result["windows"])
    assert all(math.isfinite(x) for w in result["windows"] for x in w["loss"])
    assert all(math.isfinite(x) for w in result["windows"] for x in w["mean_loss"])
    assert result["peak_mem_gib_at_step_4"] is None  # CPU: no allocator statistics
    assert len(result["per_rank"]) == 2 and result["per_rank"][0]["graphs_at_warmup"] >= 1
    assert result["meta"]["model"]["dim"] == 64


def _rank(
    peaks: list[float], recompiles: int = 0, loss: float = 1.0, tps: list[float] | None = None
) -> dict:
    windows = [
        {"end_step": 100 * (i + 1), "steps": 100, "step_ms": 40.0,
         "tokens_per_s_per_gpu": 1e4 if tps is None else tps[i], "peak_mem_gib": p, "loss": loss}
        for i, p in enumerate(peaks)
    ]  # fmt: skip
    return {"first_step_s": 30.0, "recompiles_after_warmup": recompiles, "windows": windows}


def _args(**over: object) -> argparse.Namespace:
    fields = {"window": 100, "mem_tolerance": 0.02, "throughput_tolerance": 0.03, "loss_rtol": 2e-2}
    return argparse.Namespace(**{**fields, **over})


def test_summary_flags_memory_growth_recompiles_and_bad_losses() -> None:
    args = _args()
    ok = soak.summarize(args, [_rank([7.6, 7.6, 7.61]), _rank([7.5, 7.5, 7.5])])
    assert ok["status"] == "ok" and ok["problems"] == []
    assert ok["peak_mem_gib_at_step_100"] == 7.6 and ok["peak_mem_gib_at_step_300"] == 7.61

    grew = soak.summarize(args, [_rank([7.6, 7.7, 7.9]), _rank([7.5, 7.5, 7.5])])
    assert grew["status"] == "failed"
    assert grew["problems"] == ["peak memory grew by 0.300 GiB from step 100 to step 300"]

    recompiled = soak.summarize(args, [_rank([1.0, 1.0], recompiles=2), _rank([1.0, 1.0])])
    assert recompiled["problems"] == ["recompiles after warm-up on ranks: [2, 0]"]

    nan = soak.summarize(args, [_rank([1.0, 1.0], loss=float("nan")), _rank([1.0, 1.0])])
    assert nan["problems"] == ["a loss is not finite"]


def test_graph_counter_sees_a_recompile() -> None:
    torch._dynamo.reset()
    before = soak._graphs_compiled()
    fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    fn(torch.ones(2))
    fn(torch.ones(2))
    assert soak._graphs_compiled() == before + 1
    fn(torch.ones(3))  # a new shape: recompiled
    assert soak._graphs_compiled() == before + 2


def test_summary_flags_a_slow_window_on_the_slowest_rank() -> None:
    steady = _rank([1.0] * 5)
    slow = _rank([1.0] * 5, tps=[1e4, 1e4, 9.6e3, 1e4, 1.02e4])  # 4% under the median at 300
    result = soak.summarize(_args(), [steady, slow])
    assert result["problems"] == [
        "throughput more than 3% from the median in the windows ending at steps [300]"
    ]
    # each window counts its slowest rank: rank 0 holds step 500 to 1e4
    assert result["throughput_spread"] == pytest.approx([-0.04, 0.0])
    assert soak.summarize(_args(throughput_tolerance=0.05), [steady, slow])["status"] == "ok"


def test_losses_are_compared_window_by_window_with_the_reports_tolerance() -> None:
    mine = [_rank([1.0, 1.0, 1.0]), _rank([1.0, 1.0, 1.0])]
    for i, loss in enumerate([4.0, 2.0, 0.5]):
        mine[0]["windows"][i]["loss"] = loss
    ref = {"args": {"arm": "fsdp2-compiled"},
           "windows": [{"end_step": s, "loss": [x, x]} for s, x in [(100, 4.05), (200, 2.0), (300, 0.53)]]}  # fmt: skip
    result = soak.summarize(_args(), mine, ref)
    # 0.05 / 4.05 = 0.012 inside 2e-2; 0.03 / max(0.53, 1) = 0.03 outside
    assert result["losses_against"]["outside"] == [300]
    assert result["losses_against"]["max_scaled_diff"] == pytest.approx(0.03)
    assert result["problems"] == [
        "losses outside 0.02 x max(|ref|, 1) of fsdp2-compiled at steps [300]"
    ]
    assert soak.summarize(_args(loss_rtol=0.05), mine, ref)["status"] == "ok"


@pytest.mark.parametrize(
    ("steps", "warmup", "window", "ends"),
    [(2000, 10, 100, [100 * k for k in range(1, 21)]), (7, 2, 2, [4, 6, 7]), (250, 100, 100, [200, 250])],
)  # fmt: skip
def test_windows_end_on_multiples_of_the_window_after_warmup(steps, warmup, window, ends) -> None:
    args = argparse.Namespace(steps=steps, warmup=warmup, window=window)
    assert soak.window_ends(args) == ends


def test_a_reference_with_other_windows_is_refused_before_any_step(tmp_path: Path, capsys) -> None:
    ref = tmp_path / "soak.json"
    ref.write_text(json.dumps({"windows": [{"end_step": 4, "loss": [1.0]}]}))
    with pytest.raises(SystemExit):
        soak.parse_args(["--smoke", "--steps", "8", "--compare-losses", str(ref)])
    assert "its windows end at steps [4], this run's would at [4, 6, 8]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        soak.parse_args(["--smoke", "--compare-losses", str(tmp_path / "missing.json")])
    assert "no such file" in capsys.readouterr().err


def test_window_means_are_compared_where_both_runs_have_them() -> None:
    """A window's last loss can sit far from the other run's while the window's mean does
    not: the means decide where both runs recorded them."""
    mine = [_rank([1.0, 1.0]), _rank([1.0, 1.0])]
    for w, last, mean in zip(mine[0]["windows"], [0.03, 0.50], [0.20, 0.40]):
        w["loss"], w["mean_loss"] = last, mean
    for r in mine[1:]:
        for w in r["windows"]:
            w["mean_loss"] = 1.0
    ref = {"windows": [{"end_step": s, "loss": [x, x], "mean_loss": [m, m]}
                       for s, x, m in [(100, 0.10, 0.21), (200, 0.45, 0.41)]]}  # fmt: skip
    result = soak.summarize(_args(), mine, ref)
    assert result["losses_against"]["compared"] == "mean_loss"
    assert result["losses_against"]["outside"] == [] and result["status"] == "ok"
    del ref["windows"][0]["mean_loss"]  # an older reference: the last losses decide
    result = soak.summarize(_args(), mine, ref)
    assert result["losses_against"]["compared"] == "loss"
    assert result["losses_against"]["outside"] == [100, 200]
