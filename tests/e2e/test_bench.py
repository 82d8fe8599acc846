"""bench/: the CPU smoke run end to end (gloo, tiny model, two arms), and the pieces it is made of."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is a folder of the repo, not an installed package
    sys.path.insert(0, str(REPO))

from bench import report
from bench.arms import ARMS, MEMORY_ARMS, deepspeed_config, fix_cuda_arch_list, select_arms
from bench.profile import collective_counts, exposed_comm, matmul_times, merge, overlap


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


def test_the_ratio_divides_by_the_faster_plain_floor() -> None:
    records = [
        _record("floor", step_ms=25.0),
        _record("floor-per-block", step_ms=20.0),
        _record("fczero-compiled", step_ms=30.0),
    ]
    report.annotate(records)
    ratios = {r["arm"]: r["ratio_to_floor"] for r in records}
    assert ratios == {"floor": 1.25, "floor-per-block": 1.0, "fczero-compiled": 1.5}
    only_per_block = [
        _record("floor-per-block", step_ms=20.0),
        _record("fczero-compiled", step_ms=30.0),
    ]
    report.annotate(only_per_block)
    assert only_per_block[1]["ratio_to_floor"] == 1.5


def test_host_cost_smoke_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The host-cost bench on the fake process group: two sizes, every arm, ratios to plain;
    every plain arm runs before the others (which install fczero's step hooks), the table
    keeps the order asked for, and the arms are timed on one intra-op thread."""
    from bench import host_cost

    arms = ",".join(host_cost.ARMS)  # the default sweep and FSDP2 eager
    threads = torch.get_num_threads()
    seen_threads: list[int] = []
    real_phases = host_cost.time_phases

    def phases(*args, **kwargs):
        seen_threads.append(torch.get_num_threads())
        return real_phases(*args, **kwargs)

    with (
        caplog.at_level(logging.INFO, logger="fczero.bench"),
        mock.patch.object(host_cost, "time_phases", phases),
    ):
        argv = ["--layers", "1,2", "--backend", "aot_eager", "--steps", "3", "--arms", arms]
        records = host_cost.run(host_cost.parse_args(argv))
    # one intra-op thread while timing (``--threads`` default), the caller's count after
    assert set(seen_threads) == {1} and torch.get_num_threads() == threads
    ran = [m.split(",")[0] for m in caplog.messages if "host ms/step" in m]
    plain = [a for a in host_cost.ARMS if a.startswith("plain")]
    assert ran[: 2 * len(plain)] == plain * 2 and "plain" not in "".join(ran[2 * len(plain) :])
    assert [(r["layers"], r["arm"]) for r in records] == [
        (n, arm) for n in (1, 2) for arm in host_cost.ARMS
    ]
    assert [r["params"] for r in records if r["arm"] == "plain-eager"] == [10, 17]
    for r in records:
        assert r["host_ms"] == pytest.approx(r["forward"] + r["backward"] + r["update"])
        assert (r["x_plain"] is None) == r["arm"].startswith("plain")
    assert host_cost.per_param_ms(records, "fczero-compiled") is not None
    assert "| 2 | 17 | fczero-compiled |" in host_cost.markdown(records)


def test_host_cost_rounds_time_the_arms_in_turns(monkeypatch) -> None:
    """``--rounds``: every arm of a size is built first, then each round times every arm
    once, in the order plain arms first; each phase is the median of the rounds'."""
    from bench import host_cost

    calls: list[object] = []
    timings = iter(range(1, 100))

    def fake_phases(step, batches, *, steps, device):
        calls.append(step)
        t = float(next(timings))
        return {p: {"host_ms": t} for p in host_cost.PHASES}

    monkeypatch.setattr(host_cost, "time_phases", fake_phases)
    argv = ["--layers", "1", "--backend", "aot_eager", "--warmup", "1", "--rounds", "3"]
    records = host_cost.run(host_cost.parse_args(argv + ["--arms", "fczero-eager,plain-eager"]))
    first_round = calls[:2]
    assert len(set(map(id, first_round))) == 2 and calls == first_round * 3  # in turns
    assert [r["arm"] for r in records] == ["fczero-eager", "plain-eager"]  # the order asked
    plain, fczero = records[1], records[0]
    # plain ran first in each round (timings 1, 3, 5), fczero second (2, 4, 6): medians
    assert plain["forward"] == 3.0 and fczero["forward"] == 4.0
    assert fczero["x_plain"] == pytest.approx(4.0 / 3.0) and fczero["rounds"] == 3


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
        _record(
            "fczero-params-offload-eager", loss_at_n=0.0652, losses=[10.855, 1.205, 0.0652],
            host_init=True,
        ),
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


_PHASES = {p: {"host_ms": 1.0, "gpu_ms": 2.0} for p in report.PHASES}


def test_report_runs_as_a_module(tmp_path: Path) -> None:
    """``python -m bench.report`` (what gpu_run.sh calls) reaches every helper ``main`` uses:
    a helper defined below the ``__main__`` guard was once missing at that point."""
    report.append_record(tmp_path, {**_record("fczero-compiled"), "phases": _PHASES})
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "bench.report", "--out", str(tmp_path)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "forward: host / GPU ms" in done.stdout and "1.0 / 2.0" in done.stdout


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
    assert collective_counts(events) == {"AllGather": 1, "ReduceScatter": 1}
    # summed collective kernels 15; the gemm runs 6, all of it beside the all-gather
    assert matmul_times(events) == (15.0, 6.0, 6.0)
    assert matmul_times(events + [kernel("nvjet_tst_64x8", 40, 3)]) == (15.0, 9.0, 6.0)


def test_select_arms() -> None:
    assert "fczero-symm-mem" not in [a.name for a in select_arms("core")]
    assert [a.name for a in select_arms("all")] == [n for n in ARMS if n not in MEMORY_ARMS]
    assert [a.name for a in select_arms("memory")] == MEMORY_ARMS
    assert [a.name for a in select_arms("fczero-eager,floor")] == ["floor", "fczero-eager"]
    pair = "fczero-eager-per-read,fczero-eager"
    assert [a.name for a in select_arms(pair, as_given=True)] == pair.split(",")
    assert [a.name for a in select_arms("fczero-eager,cudagraphs,floor", as_given=True)] == [
        "fczero-eager", "floor-cudagraphs", "fczero-cudagraphs", "floor"
    ]  # fmt: skip
    skip = (
        "deepspeed,ddp,unshard,overlap,fczero-eager-per-read,fczero-compiled-per-read,"
        "fczero-cudagraphs-per-read,floor-per-block,fsdp2-compiled-whole,fczero-per-block,"
        "fczero-compiled-reuse"
    )
    core = [a.name for a in select_arms("all", skip=skip)]
    assert core == [
        "floor",
        "floor-cudagraphs",
        "floor-eager",
        "fsdp2-eager",
        "fsdp2-compiled",
        "fczero-eager",
        "fczero-nopasses",
        "fczero-compiled",
        "fczero-cudagraphs",
        "fczero-256mib",
    ]
    assert [a.name for a in select_arms("cudagraphs")] == ["floor-cudagraphs", "fczero-cudagraphs"]
    assert [a.name for a in select_arms("units")] == [
        "fczero-eager", "fczero-compiled", "fczero-eager-per-read", "fczero-compiled-per-read",
        "fczero-cudagraphs-per-read", "fczero-cudagraphs",
    ]  # fmt: skip  (in the order of ARMS)
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


def test_capacity_smoke_reports_memory_and_bounds(tmp_path: Path) -> None:
    """One CPU rank, two sizes: per row ms/step, tokens/s, host peak (of that arm) and the loss
    check; an arm held below a size is "not tried"; DeepSpeed is skipped with its reason."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "cap"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.capacity", "--smoke", "--max-layers",
         "fczero-memory-eager=1", "--out", str(out)],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "capacity.jsonl").read_text().splitlines()]
    by = {(r["arm"], r["layers"]): r for r in rows}
    assert set(by) == {
        ("fsdp2-eager", 1), ("fsdp2-eager", 2), ("fczero-memory-eager", 1),
        ("fczero-memory-eager", 2), ("deepspeed-offload", 1),
    }  # fmt: skip  (a skipped arm is not tried again)
    for key in [("fsdp2-eager", 1), ("fsdp2-eager", 2), ("fczero-memory-eager", 1)]:
        r = by[key]
        assert r["status"] == "ok", r["error"]
        assert r["step_ms"] > 0 and r["tokens_per_s_per_gpu"] > 0
        assert r["peak_mem_gib"] is None and r["pinned_peak_gib"] is None  # CPU
        assert r["host_peak_is_arm"] and r["host_peak_gib"] >= r["host_base_gib"] > 0
        assert r["meta"]["gpu"].startswith("none (CPU, 1 gloo ranks)")
    assert by[("fczero-memory-eager", 1)]["loss_ref_arm"] == "fsdp2-eager"
    assert by[("fczero-memory-eager", 1)]["loss_agrees"] is True
    assert by[("fczero-memory-eager", 2)]["status"] == "not tried"
    skipped = by[("deepspeed-offload", 1)]
    assert skipped["status"] == "error" and "skipped:" in skipped["error"]
    table = (out / "capacity.md").read_text()
    assert "| ms/step | tokens/s | GPU peak GiB | host peak GiB | pinned peak GiB |" in table
    assert "| host B/param | GPU B/param | host implies | GPU implies | bound |" in table
    assert "not tried (--max-layers fczero-memory-eager=1)" in table
    assert "| deepspeed-offload | 1 |" in table and "skipped: " in table
    assert "| fsdp2-eager | 2 layers" in table  # the largest it trained
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "capacity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(arm: str, layers: int, status: str = "ok", **kw: object) -> dict:
    from bench.capacity import config_params
    from fczero.models.llama import LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, dim=4096, n_layers=1, n_heads=32, ffn_dim=11008)
    return {"arm": arm, "layers": layers, "params": config_params(cfg, layers), "status": status,
            "host_peak_is_arm": True, **kw}  # fmt: skip


def test_capacity_bounds_from_bytes_per_param() -> None:
    """Slopes over the sizes that trained, the memory each bound implies, and a measured
    out-of-memory capping the extrapolation (numbers shaped like the one-H100 run)."""
    from bench.capacity import bounds, layers_for

    gib = 2**30
    p4, p20 = _row("a", 4)["params"], _row("a", 20)["params"]

    def host(p: int) -> float:  # 1 GiB + 20 B/param
        return (1.0 * gib + 20.0 * p) / gib

    def gpu(p: int) -> float:  # 0.5 GiB + 16 B/param
        return (0.5 * gib + 16.0 * p) / gib

    rows = [
        _row("a", 4, host_peak_gib=host(p4), peak_mem_gib=gpu(p4), host_base_gib=1.0),
        _row("a", 20, host_peak_gib=host(p20), peak_mem_gib=gpu(p20), host_base_gib=1.0),
        _row("a", 28, "error", error="OutOfMemoryError: CUDA out of memory"),
    ]
    b = bounds(rows, "a", host_gib=128.0, gpu_gib=79.0)
    assert b["host_bytes_per_param"] == pytest.approx(20.0)
    assert b["gpu_bytes_per_param"] == pytest.approx(16.0)
    assert b["host_implied_params"] == pytest.approx(127 * gib / 20.0)
    assert b["gpu_implied_params"] == pytest.approx(78.5 * gib / 16.0)
    assert b["bound"] == "GPU" and b["largest"]["layers"] == 20 and b["failed"]["layers"] == 28
    assert b["implied_params"] == pytest.approx(78.5 * gib / 16.0)  # under the failed size
    assert layers_for(b["implied_params"], _cfg()) == 24
    # one size: its peak above where the arm started; a host-bound arm
    one = [_row("b", 4, host_peak_gib=host(p4), peak_mem_gib=2.0, host_base_gib=1.0)]
    b = bounds(one, "b", host_gib=128.0, gpu_gib=79.0)
    assert b["host_bytes_per_param"] == pytest.approx(20.0) and b["bound"] == "host"
    # a host peak that covers earlier arms says nothing of this one's bytes
    stale = [{**rows[0], "host_peak_is_arm": False}, {**rows[1], "host_peak_is_arm": False}]
    assert bounds(stale, "a", host_gib=128.0, gpu_gib=79.0)["host_bytes_per_param"] is None


def _cfg():
    from fczero.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=32000, dim=4096, n_layers=1, n_heads=32, ffn_dim=11008)


def test_capacity_merge_rebuilds_rows_and_rechecks_losses(tmp_path: Path) -> None:
    """Two runs: the first stopped before the second arm finished (no capacity row), the
    second measured it; the loss check then compares it with FSDP2 eager of the first run."""
    from bench.capacity import CAPACITY_JSONL, merged_rows

    model = {"n_layers": 20, "params": 4_310_000_000}
    first, second = tmp_path / "one", tmp_path / "two"
    report.append_record(first / "layers_20", {
        **_record("fsdp2-eager", losses=[10.0, 1.0, 0.2]), "meta": {"model": model}})  # fmt: skip
    (first / CAPACITY_JSONL).write_text(json.dumps(
        {"arm": "deepspeed-offload", "layers": 20, "params": 4_310_000_000, "status": "missing",
         "error": "no result"}) + "\n")  # fmt: skip
    report.append_record(second / "layers_20", {
        **_record("deepspeed-offload", losses=[10.0, 1.0, 2.9], loss_ref_arm="deepspeed-offload"),
        "meta": {"model": model}})  # fmt: skip
    rows = {r["arm"]: r for r in merged_rows([first, second])}
    assert rows["deepspeed-offload"]["status"] == "ok"
    assert rows["deepspeed-offload"]["loss_ref_arm"] == "fsdp2-eager"
    assert rows["deepspeed-offload"]["loss_agrees"] is False
    assert rows["fsdp2-eager"]["loss_ref_arm"] == "fsdp2-eager"


def test_capacity_stop_ends_the_workers_torchrun_started(tmp_path: Path) -> None:
    """torchrun's workers live in sessions of their own: killing the launcher's group leaves
    them training (seen on one H100); ``stop`` ends them too."""
    from bench.capacity import _descendants, stop

    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.run", "--smoke", "--steps", "200", "--out", str(tmp_path)],
        cwd=REPO, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    workers: list[int] = []
    for _ in range(120):
        workers = [p for p in _descendants(proc.pid) if "bench.run" in _cmdline(p)]
        if len(workers) >= 2:
            break
        time.sleep(0.5)
    assert len(workers) >= 2, "no workers started"
    stop(proc, grace=20)
    time.sleep(0.5)
    assert [p for p in workers if _running(p)] == []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_host_memory_sees_an_arms_own_peak() -> None:
    from bench.metrics import HostMemory

    host = HostMemory()
    host.start()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    seen = host.read()
    del block
    assert seen["host_peak_is_arm"] is True
    assert seen["host_peak_gib"] - seen["host_base_gib"] >= 60 / 1024
    host.start()  # the next arm starts from what is resident now, not the old peak
    assert host.read()["host_peak_gib"] < seen["host_peak_gib"]


def test_realistic_regime_smoke_run(tmp_path: Path) -> None:
    """Regime R's pieces on the CPU: grouped-query attention, tied embeddings, every block
    checkpointed (selective), the per-block floor, FSDP2 compiled whole, fczero (units, the
    default; aot_eager: no code generation on a 2-core machine)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "realistic"
    arms = "floor-per-block,fsdp2-eager,fsdp2-compiled-whole,fczero-compiled"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--kv-heads", "2", "--tie",
         "--checkpointing", "selective", "--arms", arms, "--compile-backend", "aot_eager",
         "--out", str(out)],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = {r["arm"]: r for r in map(json.loads, (out / report.RESULTS).read_text().splitlines())}
    assert set(records) == set(arms.split(","))
    for r in records.values():
        assert r["status"] == "ok", r.get("error")
        assert r["loss_at_n"] < r["loss_first"]  # it trains
    for name in ("fsdp2-compiled-whole", "fczero-compiled"):
        assert records[name]["loss_agrees"] is True, records[name]["loss_rel_diff"]


def test_hf_realistic_smoke_run(tmp_path: Path) -> None:
    """The realistic group on Hugging Face's LlamaForCausalLM (``--model hf-tiny``: grouped-query
    attention, tied embeddings, HF's own checkpointing of every layer), every arm the CPU can
    run (aot_eager), losses in agreement."""
    pytest.importorskip("transformers", reason="transformers is a test extra")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "hf"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--model", "hf-tiny", "--arms", "realistic",
         "--compile-backend", "aot_eager", "--out", str(out)],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=360,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = {r["arm"]: r for r in map(json.loads, (out / report.RESULTS).read_text().splitlines())}
    on_cpu = [a.name for a in select_arms("realistic") if not a.needs_cuda]
    assert list(records) == on_cpu and "fczero-compiled" in on_cpu
    first = records["floor"]["loss_first"]
    for r in records.values():
        assert r["status"] == "ok", r.get("error")
        assert r["meta"]["model"]["hf"] is True and r["meta"]["model"]["checkpointing"] == "full"
        assert r["loss_at_n"] < r["loss_first"]  # it trains
        assert r["loss_first"] == pytest.approx(first, rel=1e-2)  # same weights in every arm
        if r["communicates"]:
            assert r["loss_agrees"] is True, (r["arm"], r["loss_rel_diff"])
    assert "Hugging Face LlamaForCausalLM" in (out / report.TABLE).read_text()


def test_hf_model_matches_the_preset_shape() -> None:
    """``bench.hf_model``: the 3B preset's shape and param count (tied embedding counted once),
    the decoder layers as ``.layers``, HF's checkpointing, and no selective checkpointing."""
    pytest.importorskip("transformers", reason="transformers is a test extra")
    from bench.hf_model import ROPE_THETA, HFLlama
    from bench.run import parse_args
    from fczero.models.llama import LlamaConfig

    args = parse_args(["--model", "hf-llama3-3b"])
    assert args.hf is True and args.checkpointing == "full" and parse_args([]).hf is False
    cfg = LlamaConfig.llama3_3b()
    with torch.device("meta"):
        model = HFLlama(cfg)
    hf = model.lm.config
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads) == (3072, 28, 24)
    assert (hf.num_key_value_heads, hf.intermediate_size, hf.vocab_size) == (8, 8192, 128256)
    assert hf.tie_word_embeddings and hf.rope_parameters["rope_theta"] == ROPE_THETA
    assert model.lm.lm_head.weight is model.lm.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params() == 3_212_749_824
    assert model.layers is model.lm.model.layers and len(model.layers) == 28
    assert all(layer.gradient_checkpointing for layer in model.layers)
    with pytest.raises(ValueError, match="not offered for the Hugging Face model"):
        HFLlama(LlamaConfig(checkpointing="selective"))
    with pytest.raises(SystemExit):
        parse_args(["--model", "hf-llama3-3b", "--checkpointing", "selective"])


def test_hf_model_runs_causal_sdpa_when_compiled_whole() -> None:
    """[Note: causal SDPA for the HF model]: compiled whole, HF would build a (B, 1, T, T) mask;
    the bench's model passes ``is_causal=True`` and no mask, as in eager, same logits."""
    pytest.importorskip("transformers", reason="transformers is a test extra")
    from bench.hf_model import HFLlama
    from fczero.models.llama import LlamaConfig

    torch.manual_seed(0)
    model = HFLlama(LlamaConfig(vocab_size=64, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=40))
    calls: list[dict] = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> torch.fx.GraphModule:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        calls.extend(n.kwargs for n in gm.graph.nodes if n.target is sdpa)
        return gm

    tokens = torch.randint(0, 64, (2, 16))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)(tokens)
    torch.testing.assert_close(compiled, model(tokens))
    assert len(calls) == 2  # one per layer
    assert all(c["is_causal"] is True and c["attn_mask"] is None for c in calls), calls
