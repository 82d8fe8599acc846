"""bench/compile_time.py: the CPU smoke run (1 and 2 layers, each measurement a process of
its own) and how a first step's compile time is split into parts.

The smoke run compiles with ``aot_eager_with_passes`` (AOT autograd's graphs, fczero's
passes, no code generation): stock Inductor's C++ compiles take about 50 s for even one
layer on 2 cores, so the Inductor split is checked on torch's numbers (the unit test
below) and measured by hand (``python -m bench.compile_time --layers 1``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is a folder of the repo, not an installed package
    sys.path.insert(0, str(REPO))

from bench import compile_time
from fczero.passes import timing


@pytest.mark.slow  # four processes, each importing torch and compiling: half a minute
def test_smoke_run_splits_each_first_step(tmp_path: Path, capsys) -> None:
    """fczero's two arms (the floors are plain ``torch.compile``) at two depths."""
    out = tmp_path / "ct"
    arms = ["fczero-compiled", "fczero-per-block"]
    argv = ["--layers", "1", "2", "--arms", ",".join(arms), "--backend", "aot_eager_with_passes"]
    assert compile_time.main([*argv, "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / compile_time.RESULTS).read_text().splitlines()]
    assert [(r["layers"], r["arm"]) for r in records] == [(n, a) for n in (1, 2) for a in arms]
    for n in (1, 2):  # each process leaves its log, which says how far it got
        for a in arms:
            log = (out / f"child_{a}_{n}_cold_rank0.log").read_text()
            assert "first step (compiling) starts" in log and "first step done" in log, log
    for r in records:
        total = r["first_step_s"]
        parts = {p: r[f"{p}_s"] for p in compile_time.PARTS}
        assert total > 0 and r["later_step_s"] > 0, r
        assert parts["dynamo"] > 0 and parts["aot"] > 0, r  # every arm compiles
        assert parts["inductor"] == 0, r  # not the Inductor backend
        assert all(0 <= v <= total for v in parts.values()), r
        assert sum(parts.values()) <= total, r
        assert r["graphs"] >= 1, r
        kinds = {f"{c}_{w}" for c in ("aot", "fx") for w in ("hit", "miss", "bypass")}
        assert set(r["cache"]) == kinds, r
        if r["arm"] == "fczero-compiled":
            assert parts["passes"] > 0 and r["pass_graphs"] == 2, r  # forward and backward
    one, two = (
        next(r for r in records if r["layers"] == n and r["arm"] == "fczero-compiled") for n in (1, 2)
    )
    assert two["params"] > one["params"]
    table = (out / compile_time.TABLE).read_text()
    assert table in capsys.readouterr().out  # printed too
    assert table.count("\n| 2 | ") == len(arms) and "| passes s |" in table


def test_parts_put_fczero_passes_where_they_ran(monkeypatch) -> None:
    spent = {
        "entire_frame_compile": 10.0,  # Dynamo's frame, the backend's compile inside it
        "backend_compile": 9.0,
        "entire_backward_compile": 3.0,  # the backward, compiled at the first backward
        "inductor_compile": 8.0,  # compile_fx_inner, forward and backward
        "_recursive_pre_grad_passes": 0.25,
        "_recursive_joint_graph_passes": 0.75,
    }
    monkeypatch.setattr(torch._dynamo.utils, "calculate_time_spent", lambda: spent)
    parts = compile_time.compile_parts(timing.PassTime(seconds=2.0, graphs=2))
    assert parts == {"dynamo": 1.0, "aot": 3.0, "inductor": 7.0, "passes": 2.0}
    assert sum(parts.values()) == spent["entire_frame_compile"] + spent["entire_backward_compile"]
    # a backend without Inductor (aot_eager_with_passes): the passes run inside AOT's compile
    spent = {"entire_frame_compile": 4.0, "backend_compile": 3.0}
    parts = compile_time.compile_parts(timing.PassTime(seconds=0.5, graphs=2))
    assert parts == {"dynamo": 1.0, "aot": 2.5, "inductor": 0.0, "passes": 0.5}


def test_run_passes_adds_to_the_pass_time() -> None:
    from fczero.passes import run_passes

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    before = timing.total()
    run_passes(gm)  # no fczero collectives: returned as it is, but timed
    spent = timing.total() - before
    assert spent.graphs == 1 and spent.seconds > 0


def test_table_has_a_row_per_depth_and_arm() -> None:
    row = {"first_step_s": 3.0, "dynamo_s": 1.0, "aot_s": 1.0, "inductor_s": 0.5, "passes_s": 0.25,
           "rest_s": 0.25, "later_step_s": 0.01, "graphs": 1, "caches": "cold"}  # fmt: skip
    records = [
        {**row, "layers": n, "arm": a} for n in (8, 16) for a in ("floor", "fczero-compiled")
    ]
    lines = compile_time.table(records).splitlines()
    assert (
        "| 16 | fczero-compiled | cold | 3.00 | 1.00 | 1.00 | 0.50 | 0.25 | 0.25 | 0.010 | 1 |"
        in lines
    )
    assert sum(line.startswith("| 8 |") for line in lines) == 2


def test_the_cache_log_keeps_bypass_reasons_and_key_parts() -> None:
    import logging

    log = logging.getLogger("torch._inductor.codecache")
    level = log.level
    with compile_time._CacheLog(details=True) as cache_log:
        log.info("Bypassing FX Graph Cache because '%s'", "Can't cache HigherOrderOperator: x")
        log.debug("FX graph cache hash details for key %s:\n%s", "k1", "[abc] gm: ...")
        log.info("fx graph cache miss for key %s", "k1")  # neither: not kept
    assert cache_log.reasons == [
        "Bypassing FX Graph Cache because 'Can't cache HigherOrderOperator: x'"
    ]
    assert cache_log.details == ["FX graph cache hash details for key k1:\n[abc] gm: ..."]
    assert log.level == level  # (put back)


def test_key_differences_name_the_parts_a_warm_run_changed(tmp_path: Path, caplog) -> None:
    import logging

    cold = tmp_path / "child_a_1_cold_rank0.log"
    warm = tmp_path / "child_a_1_warm_rank0.log"
    cold.with_suffix(".keys.txt").write_text(
        "[h1] inductor_config[x]: 1\n[h2] fn: <object at 0x1>\n[h3] graph: ...\n"
    )
    warm.with_suffix(".keys.txt").write_text(
        "[h1] inductor_config[x]: 1\n[h2] fn: <object at 0x2>\n[h9] graph: ...\n"
    )
    with caplog.at_level(logging.INFO, logger="fczero.bench"):
        compile_time._say_key_differences(cold, warm)
    assert "1 cache-key lines of the warm run are not in the cold run's" in caplog.text
    assert "new key part: [h9] graph" in caplog.text
    assert "0x2" not in caplog.text  # the same hash: only the printed address differs
