"""bench.scaling (weak-scaling tables from runs at several world sizes) and the pieces of the
scale run in bench.run: the floor scaled from two smaller depths (``--floor-layers``), the
Llama-3-8B preset and regime R8."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is a folder of the repo, not an installed package
    sys.path.insert(0, str(REPO))

from bench import report, scaling
from bench.arms import ARMS
from bench.run import REGIMES, floor_depths, parse_args, scale_floor
from fczero.models.llama import LlamaConfig


def _record(arm: str, world: int, tokens: float, **kw: object) -> dict:
    """A bench.run record of ``arm`` at ``world`` ranks, 1 x 1024 tokens per GPU per step."""
    step_ms = 1024 / tokens * 1e3
    base = {
        "arm": arm, "label": ARMS[arm].label, "regime": "M", "status": "ok", "batch": 1,
        "seq_len": 1024, "communicates": ARMS[arm].communicates, "world_size": world,
        "step_ms": step_ms, "tokens_per_s_per_gpu": tokens, "tflops_per_gpu": tokens * 1e-3,
        "peak_mem_gib": 10.0 / world, "loss_at_n": 1.0,
        "meta": {"gpu": f"{world} x NVIDIA H100 80GB HBM3", "model": {"params": 953e6}},
    }  # fmt: skip
    return {**base, **kw}


def _write(folder: Path, records: list[dict]) -> Path:
    for r in records:
        report.append_record(folder, r)
    return folder


def test_weak_scaling_table_divides_by_the_smallest_world(tmp_path: Path) -> None:
    n2 = _write(tmp_path / "n2", [
        _record("floor", 2, 40000.0),
        _record("fsdp2-compiled", 2, 20000.0),
        _record("fczero-compiled", 2, 30000.0),
    ])  # fmt: skip
    n4 = _write(tmp_path / "n4", [
        _record("floor", 4, 40000.0),
        _record("fsdp2-compiled", 4, 15000.0),
        _record("fczero-compiled", 4, 27000.0, tflops_per_gpu=494.7),
        _record("fczero-cudagraphs", 4, 28000.0),  # not run at 2: no efficiency
    ])  # fmt: skip
    out = tmp_path / "scaling"
    text = scaling.write([n4, n2], out)  # any order: the records say their world size

    rows = json.loads((out / scaling.ROWS).read_text())
    eff = {(r["arm"], r["world_size"]): r["efficiency"] for r in rows}
    assert eff == {
        ("floor", 2): 1.0, ("floor", 4): 1.0,
        ("fsdp2-compiled", 2): 1.0, ("fsdp2-compiled", 4): 0.75,
        ("fczero-compiled", 2): 1.0, ("fczero-compiled", 4): 0.9,
        ("fczero-cudagraphs", 4): None,
    }  # fmt: skip
    mfu = {(r["arm"], r["world_size"]): r["mfu"] for r in rows}
    assert mfu[("fczero-compiled", 4)] == pytest.approx(0.5)  # 494.7 of the H100's 989.4
    assert [r["arm"] for r in rows][:2] == ["floor", "floor"]  # bench.arms order, 2 then 4

    assert text == (out / scaling.TABLE).read_text()
    assert "## Regime M (1 x 1024 per GPU)" in text
    assert "| fsdp2-compiled |" not in text  # labels, not names
    assert "| FSDP2 compiled per block | 4 | 68.3 | 15,000 | 0.750 | 1.5% | 2.50 |" in text
    assert "| fczero compiled | 4 | 37.9 | 27,000 | 0.900 | 50.0% | 2.50 |" in text
    assert f"| {ARMS['fczero-cudagraphs'].label} | 4 | 36.6 | 28,000 | - |" in text
    assert "efficiency vs 2" in text and "4 x NVIDIA H100" in text


def test_scaling_cli_marks_failures_and_takes_a_peak(tmp_path: Path) -> None:
    n2 = _write(tmp_path / "n2", [_record("fczero-compiled", 2, 30000.0, tflops_per_gpu=100.0)])
    n8 = _write(tmp_path / "n8", [
        _record("fczero-compiled", 8, 1.0, status="error", error="OOM"),
    ])  # fmt: skip
    out = tmp_path / "out"
    scaling.main([str(n2), str(n8), "--out", str(out), "--peak-tflops", "400"])
    text = (out / scaling.TABLE).read_text()
    assert "| fczero compiled | 2 | 34.1 | 30,000 | 1.000 | 25.0% | 5.00 |" in text
    assert "| fczero compiled (failed) | 8 | - | - | - | - | - |" in text
    with pytest.raises(SystemExit, match="no records"):
        scaling.main([str(tmp_path / "empty"), "--out", str(out)])
    assert scaling.peak_tflops_of("none (CPU, 2 gloo ranks)") is None
    assert scaling.peak_tflops_of("2 x NVIDIA H100 PCIe") == 756.0


def _depth_record(layers: int, step_ms: float, **kw: object) -> dict:
    return {
        "arm": "floor", "label": "floor (compiled, no comm)", "regime": "R8", "status": "ok",
        "batch": 1, "seq_len": 8192, "layers": layers, "step_ms": step_ms,
        "step_ms_all": [step_ms], "host_ms": 1.0 * layers, "peak_mem_gib": 5.0 * layers,
        "first_step_s": 30.0, "error": None, "communicates": False, **kw,
    }  # fmt: skip


def test_scale_floor_counts_the_head_once() -> None:
    """8 layers: 500 ms, 4 layers: 300 ms: 50 ms a block and 100 ms for the rest, so 32 layers
    take 1700 ms (per-layer scaling, 500 x 32 / 8, would say 2000)."""
    cfg = LlamaConfig.llama3_8b()
    flops = cfg.flops_per_token(8192)
    r = scale_floor(_depth_record(4, 300.0), _depth_record(8, 500.0), full_layers=32,
                    flops_per_token=flops)  # fmt: skip
    assert floor_depths(8) == (4, 8)
    assert r["step_ms"] == pytest.approx(1700.0) and r["host_ms"] == pytest.approx(32.0)
    assert r["tokens_per_s_per_gpu"] == pytest.approx(8192 / 1.7)
    assert r["tflops_per_gpu"] == pytest.approx(flops * 8192 / 1.7 / 1e12)
    assert r["label"] == "floor (compiled, no comm), scaled from 4 and 8 layers"
    assert r["floor_scaled"]["layers"] == [4, 8] and r["floor_scaled"]["full_layers"] == 32
    assert r["floor_scaled"]["step_ms"] == [300.0, 500.0] and "layers" not in r
    assert r["peak_mem_gib"] == 40.0  # the 8-layer model's, as the table says
    report.annotate([r])
    assert "R8 / floor: floor scaled from 8 layers to 32" in report.markdown([r])

    failed = scale_floor(_depth_record(4, 300.0),
                         _depth_record(8, 0.0, status="error", error="OOM"),
                         full_layers=32, flops_per_token=flops)  # fmt: skip
    assert failed["status"] == "error" and failed["error"] == "at 8 layers: OOM"


def test_llama3_8b_preset_and_regime() -> None:
    args = parse_args(["--model", "llama3-8b", "--regimes", "R8", "--floor-layers", "8"])
    cfg = LlamaConfig.llama3_8b()
    assert (args.dim, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab) == (
        cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size
    )  # fmt: skip
    assert args.tie is False and args.checkpointing == "selective" and args.floor_layers == 8
    assert REGIMES["R8"] == (1, 8192)
    for bad in ("1", "32"):
        with pytest.raises(SystemExit):
            parse_args(["--model", "llama3-8b", "--floor-layers", bad])


def test_floor_layers_smoke_run(tmp_path: Path) -> None:
    """``--floor-layers 2`` on a 4-layer model: the eager floor at 1 and 2 layers, one rank."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "floor"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--nproc", "1", "--layers", "4",
         "--floor-layers", "2", "--arms", "floor-eager", "--out", str(out)],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (r,) = report.read_records(out)
    assert r["status"] == "ok", r.get("error")
    s = r["floor_scaled"]
    assert s["layers"] == [1, 2] and s["full_layers"] == 4 and r["meta"]["model"]["n_layers"] == 4
    (t1, t2) = s["step_ms"]
    assert r["step_ms"] == pytest.approx(t2 + 2 * (t2 - t1))
    assert "scaled from 1 and 2 layers" in r["label"]
    assert "floor scaled from 2 layers to 4" in (out / report.TABLE).read_text()
