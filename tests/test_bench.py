"""bench/: the CPU smoke run end to end (gloo, tiny model, two arms), and the pieces it is made of."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ is a folder of the repo, not an installed package
    sys.path.insert(0, str(REPO))

from bench import report
from bench.arms import ARMS, MEMORY_ARMS, deepspeed_config, fix_cuda_arch_list, select_arms
from bench.profile import exposed_comm, merge, overlap


def test_smoke_run_writes_agreeing_results(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "smoke"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--phases", "--out", str(out)],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    lines = (out / report.RESULTS).read_text().splitlines()
    records = {r["arm"]: r for r in map(json.loads, lines)}
    assert set(records) == {"fsdp2-eager", "fczero-eager"}
    for r in records.values():
        assert r["status"] == "ok", r.get("error")
        assert r["world_size"] == 2 and r["regime"] == "2x32"
        assert len(r["losses"]) == r["n_check"] == 4
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["loss_at_n"] < r["loss_first"]  # it trains
        assert r["step_ms"] > 0 and r["tokens_per_s_per_gpu"] > 0 and r["first_step_s"] > 0
        assert r["peak_mem_gib"] is None  # CPU
        phases = r["phases"]  # host ms only on the CPU, each a share of the step
        assert set(phases) == {"forward", "backward", "update"}
        assert all(0 < p["host_ms"] and "gpu_ms" not in p for p in phases.values())
    fc = records["fczero-eager"]
    assert fc["loss_ref_arm"] == "fsdp2-eager" and fc["loss_agrees"] is True, fc["loss_rel_diff"]
    # Same seed, same data: the first losses differ by bf16 rounding only.
    assert fc["loss_first"] == pytest.approx(records["fsdp2-eager"]["loss_first"], rel=1e-2)

    table = (out / report.TABLE).read_text()
    assert "| FSDP2 eager | ok |" in table and "| fczero eager | ok |" in table
    assert "(reference)" in table and "(ok, " in table and "MISMATCH" not in table
    assert "FSDP2 eager" in proc.stdout  # the CLI prints the table
    assert "## Phases" in table and "| 2x32 | fczero-eager |" in table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / report.CHART).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_relaunch_argv_is_unambiguous_for_torchrun() -> None:
    from torch.distributed.run import get_args_parser

    from bench.run import relaunch_argv

    for argv in (["--nproc", "1", "--regimes", "M"], ["--nproc=1", "--regimes", "M"]):
        args = get_args_parser().parse_args(relaunch_argv(1, argv, "bench.run"))
        assert args.nproc_per_node == "1" and args.module and args.standalone
        assert args.training_script == "bench.run"
        assert args.training_script_args == ["--regimes", "M"]  # --nproc is not passed on


def test_cuda_graph_arms_compare_with_the_cuda_graph_floor() -> None:
    records = [
        _record("floor", step_ms=20.0),
        _record("floor-cudagraphs", step_ms=10.0),
        _record("fczero-compiled", step_ms=30.0),
        _record("fczero-cudagraphs", step_ms=12.0),
    ]
    report.annotate(records)
    ratios = {r["arm"]: r["ratio_to_floor"] for r in records}
    assert ratios == {
        "floor": 1.0, "floor-cudagraphs": 1.0, "fczero-compiled": 1.5, "fczero-cudagraphs": 1.2
    }  # fmt: skip


def test_host_cost_smoke_run(tmp_path: Path) -> None:
    """The host-cost bench on the fake process group: two sizes, every arm, ratios to plain."""
    from bench import host_cost

    records = host_cost.run(
        host_cost.parse_args(["--layers", "1,2", "--backend", "aot_eager", "--steps", "3"])
    )
    assert [(r["layers"], r["arm"]) for r in records] == [
        (n, arm) for n in (1, 2) for arm in host_cost.ARMS
    ]
    assert [r["params"] for r in records if r["arm"] == "plain-eager"] == [10, 17]
    for r in records:
        assert r["host_ms"] == pytest.approx(r["forward"] + r["backward"] + r["update"])
        assert (r["x_plain"] is None) == r["arm"].startswith("plain")
    assert host_cost.per_param_ms(records, "fczero-compiled") is not None
    assert "| 2 | 17 | fczero-compiled |" in host_cost.markdown(records)


def _record(arm: str, **kw: object) -> dict:
    base = {
        "arm": arm, "label": ARMS[arm].label, "regime": "M", "status": "ok", "batch": 1,
        "seq_len": 1024, "communicates": ARMS[arm].communicates, "order": list(ARMS).index(arm),
        "host_init": ARMS[arm].host_init,
        "step_ms": 10.0, "loss_at_n": 10.0, "loss_rtol": 2e-2, "n_check": 15,
    }  # fmt: skip
    return {**base, **kw}


def test_annotate_ratios_and_loss_mismatch_is_marked() -> None:
    records = [
        _record("floor", step_ms=5.0, loss_at_n=9.0),
        _record("fsdp2-eager", step_ms=10.0, loss_at_n=10.0),
        _record("fczero-eager", step_ms=6.0, loss_at_n=10.1),
        _record("fczero-compiled", step_ms=5.5, loss_at_n=11.0),
        _record("ddp", loss_at_n=float("nan")),
        _record(
            "deepspeed-zero3", status="error", error="ImportError: No module named 'deepspeed'"
        ),
    ]
    report.annotate(records)
    by = {r["arm"]: r for r in records}
    assert by["fsdp2-eager"]["ratio_to_floor"] == 2.0
    assert by["floor"]["loss_agrees"] is None  # local grads: not compared
    assert by["fczero-eager"]["loss_agrees"] is True
    assert by["fczero-compiled"]["loss_agrees"] is False
    assert by["ddp"]["loss_agrees"] is False  # NaN never agrees
    assert by["deepspeed-zero3"]["ratio_to_floor"] is None
    table = report.markdown(records)
    assert "MISMATCH (10.00% vs fsdp2-eager)" in table
    assert "FAILED: ImportError: No module named 'deepspeed'" in table
    assert "| DeepSpeed ZeRO-3 (bf16, overlap_comm) | failed | - | - |" in table


def test_loss_reference_falls_back_to_first_communicating_arm() -> None:
    records = [_record("floor"), _record("ddp", loss_at_n=10.0), _record("fczero-eager")]
    report.annotate(records)
    assert {r["loss_ref_arm"] for r in records[1:]} == {"ddp"}


def test_arms_built_in_host_memory_are_compared_among_themselves() -> None:
    """Arms marked ``host_init`` start from other weights: FSDP2 CPUOffloadPolicy is their
    reference (losses from the one-H100 run of 2026-11-23, when these two arms built the model
    in host memory: fsdp2-eager's reference was 21.57% away from fczero's host-built arm and
    0.51% from FSDP2's). The offload arms now build on the GPU, so none is marked by default."""
    assert not any(spec.host_init for spec in ARMS.values())
    records = [
        _record("fsdp2-eager", loss_at_n=0.0479, losses=[10.869, 1.0, 0.0479]),
        _record("fsdp2-cpuoffload", loss_at_n=0.0601, losses=[10.854, 1.2, 0.0601], host_init=True),
        _record("fczero-params-offload-eager", loss_at_n=0.0652, losses=[10.855, 1.205, 0.0652],
                host_init=True),  # fmt: skip
        _record("fczero-eager", loss_at_n=0.0479, losses=[10.869, 1.001, 0.0479]),
    ]
    report.annotate(records)
    by = {r["arm"]: r for r in records}
    assert by["fczero-params-offload-eager"]["loss_ref_arm"] == "fsdp2-cpuoffload"
    assert by["fczero-params-offload-eager"]["loss_agrees"] is True
    assert by["fsdp2-cpuoffload"]["loss_ref_arm"] == "fsdp2-cpuoffload"
    assert by["fczero-eager"]["loss_ref_arm"] == "fsdp2-eager"
    assert by["fczero-eager"]["loss_agrees"] is True
    assert "(reference)" in report._loss_cell(by["fsdp2-cpuoffload"])


def test_read_records_keeps_latest_and_merges_aborted_ranks(tmp_path: Path) -> None:
    report.append_record(tmp_path, _record("ddp", step_ms=1.0))
    report.append_record(tmp_path, _record("ddp", step_ms=2.0))
    for rank in (1, 0):
        aborted = _record("fczero-eager", status="error", aborted=True, run_id="x")
        report.append_record(tmp_path, {**aborted, "error": f"rank {rank}: boom"})
    by = {r["arm"]: r for r in report.read_records(tmp_path)}
    assert by["ddp"]["step_ms"] == 2.0
    assert by["fczero-eager"]["error"] == "rank 1: boom; rank 0: boom"
    text = report.write_reports(tmp_path)
    assert (tmp_path / report.TABLE).read_text() == text


def test_write_docs_reads_results_only(tmp_path: Path) -> None:
    out = tmp_path / "out"
    report.append_record(out, _record("fsdp2-eager"))
    docs = tmp_path / "benchmarks.md"
    report.write_docs(out, docs)
    text = docs.read_text()
    assert text.startswith("# Benchmarks") and "## Latest results" in text
    assert "### Summary" in text and "| FSDP2 eager |" in text
    assert sorted(p.name for p in out.iterdir()) == [report.RESULTS]


def test_interval_math() -> None:
    assert merge([(5, 6), (0, 2), (1, 3), (4, 4)]) == [(0, 3), (5, 6)]
    assert overlap([(0, 3), (5, 6)], [(2, 5.5)]) == 1.5


def test_exposed_comm_from_trace_events() -> None:
    def kernel(name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [
        kernel("ncclDevKernel_AllGather_RING_LL", 0, 10),  # 0-10: 4 exposed (0-2, 8-10)
        kernel("sm90_xmma_gemm_bf16", 2, 6),  # compute 2-8
        kernel("ncclDevKernel_ReduceScatter_Sum_f32", 20, 5),  # fully exposed
        kernel("triton_poi_fused_add", 30, 2),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 20, "dur": 5},  # ignored
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # ignored
    ]
    comm, exposed, compute, kernels = exposed_comm(events)
    assert (comm, exposed, compute, kernels) == (15.0, 9.0, 8.0, 4)


def test_select_arms() -> None:
    assert "fczero-symm-mem" not in [a.name for a in select_arms("core")]
    assert [a.name for a in select_arms("all")] == [n for n in ARMS if n not in MEMORY_ARMS]
    assert [a.name for a in select_arms("memory")] == MEMORY_ARMS
    assert [a.name for a in select_arms("fczero-eager,floor")] == ["floor", "fczero-eager"]
    core = [a.name for a in select_arms("all", skip="deepspeed,ddp,unshard,overlap")]
    assert core == [
        "floor",
        "floor-cudagraphs",
        "fsdp2-eager",
        "fsdp2-compiled",
        "fczero-eager",
        "fczero-nopasses",
        "fczero-compiled",
        "fczero-cudagraphs",
        "fczero-256mib",
    ]
    assert [a.name for a in select_arms("cudagraphs")] == ["floor-cudagraphs", "fczero-cudagraphs"]
    with pytest.raises(ValueError, match="unknown arm 'fsdp3'"):
        select_arms("fsdp3")


def test_deepspeed_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    config = deepspeed_config(4, deepcompile=True)
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["overlap_comm"] is True
    assert config["bf16"] == {"enabled": True} and config["compile"] == {"deepcompile": True}
    assert "compile" not in deepspeed_config(4, deepcompile=False)
    assert ARMS["deepspeed-deepcompile"].min_warmup == 8
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a+PTX")
    fix_cuda_arch_list(None)  # type: ignore[arg-type]  # set: the device is not consulted
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"


def test_fczero_does_not_depend_on_deepspeed() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    deps = pyproject.split("dependencies = ", 1)[1].split("\n", 1)[0]
    assert "deepspeed" not in deps.lower()
    # Importing the arms never imports deepspeed: only its builders do.
    code = "import sys, bench.arms, bench.run; assert 'deepspeed' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
