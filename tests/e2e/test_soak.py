"""bench/soak.py: the CPU smoke run end to end, and the checks that make a soak fail."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

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
    assert result["peak_mem_gib_at_step_4"] is None  # CPU: no allocator statistics
    assert len(result["per_rank"]) == 2 and result["per_rank"][0]["graphs_at_warmup"] >= 1
    assert result["meta"]["model"]["dim"] == 64


def _rank(peaks: list[float], recompiles: int = 0, loss: float = 1.0) -> dict:
    windows = [
        {"end_step": 100 * (i + 1), "steps": 100, "step_ms": 40.0, "tokens_per_s_per_gpu": 1e4,
         "peak_mem_gib": p, "loss": loss}
        for i, p in enumerate(peaks)
    ]  # fmt: skip
    return {"first_step_s": 30.0, "recompiles_after_warmup": recompiles, "windows": windows}


def test_summary_flags_memory_growth_recompiles_and_bad_losses() -> None:
    args = argparse.Namespace(window=100, mem_tolerance=0.02)
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
