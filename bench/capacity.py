"""Capacity on one GPU: the largest Llama (in layers) each configuration trains, and its speed.

    python -m bench.capacity --layers 4,20,28 --out out/capacity           # one GPU
    python -m bench.capacity --smoke --out out/capacity_smoke              # CPU, tiny
    python -m bench.capacity --merge out/a out/b --out out/both            # one table of two runs

World size 1 (``--nproc``), AdamW, the benchmark width (dim 4096, FFN 11008, vocab 32000)
scaled in layers, regime M's batch (1 x 1024). For each layer count, smallest first, one
``bench.run`` (under torchrun) times every configuration that has not failed yet: a few
warm-up and timed steps on the same tokens, with the same loss check as ``bench.run``. A
configuration that fails (out of memory, or any error) is not tried at larger sizes;
``--max-layers ARM=N`` keeps an arm from sizes above N (to fit a time budget; the table
says so). The configurations (``bench.arms``):

| arm | what is off the GPU |
| --- | --- |
| fsdp2-eager | nothing (params, grads, AdamW state on the GPU: 16 bytes a param) |
| fsdp2-cpuoffload | FSDP2 ``CPUOffloadPolicy``: params, grads, states in pinned host memory, step on CPU |
| fczero-memory-eager | fczero eager, AdamW state in pinned host memory, step in 512 MiB chunks |
| fczero-adaptive-eager | fczero eager, AdamW state off the GPU only where 90% of it has no room above forward and backward (``device_bytes="auto"``), 512 MiB chunks |
| fczero-adaptive | the same compiled, activation offload ``auto`` (within the same budget) |
| fczero-params-offload-eager | fczero eager, ``offload_params``, AdamW on the GPU in 512 MiB chunks |
| fczero-params-offload | the same compiled, with activation offload ``all`` |
| deepspeed-offload | DeepSpeed ZeRO-3, ``offload_param`` + ``offload_optimizer`` (pinned CPU), CPU Adam |

For each arm and size: ms/step, tokens/s, GPU peak (allocated), host peak (the process's
``VmHWM``, reset per arm, so it covers the build too), pinned peak (the CUDA host
allocator's), and the loss check. Per arm: host and GPU bytes per parameter (the slope of
peak against parameter count over the sizes that trained; with one size, its peak above the
arm's starting point over its params) and the largest model those imply under
``--host-memory-gib`` (128 on ``nvidia-h100-x1``) and the GPU's memory: the lower of the two
is the arm's bound. Writes ``capacity.jsonl`` (one line per arm and size), ``capacity.md``
and ``capacity.png`` (step time against model size, one line per arm, a cross where an arm
stopped fitting, a triangle at the size its bytes per param imply). Each size runs in its own
``OUT/layers_N`` folder with bench.run's full records. ``--deadline`` (seconds) stops
starting new sizes once it has passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import report
from bench.plotting import pyplot
from fczero.models.llama import LlamaConfig

logger = logging.getLogger("fczero.bench")

DEFAULT_ARMS = (
    "fsdp2-eager,fsdp2-cpuoffload,fczero-memory-eager,fczero-params-offload-eager,"
    "fczero-params-offload,deepspeed-offload"
)
SMOKE = ["--cpu", "--dim", "64", "--heads", "4", "--ffn", "172", "--vocab", "256",
         "--batch", "2", "--seq", "32", "--host-memory-gib", "16", "--gpu-memory-gib", "1"]  # fmt: skip
GIB = float(1 << 30)
CAPACITY_JSONL = "capacity.jsonl"
CAPACITY_MD = "capacity.md"
CAPACITY_PNG = "capacity.png"
FIELDS = ("step_ms", "tokens_per_s_per_gpu", "peak_mem_gib", "host_peak_gib", "host_base_gib",
          "pinned_peak_gib", "host_peak_is_arm", "loss_at_n", "losses", "loss_ref_arm",
          "loss_rel_diff", "loss_agrees", "first_step_s", "note")  # fmt: skip
"""What each capacity row keeps of bench.run's record."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--layers", default="4,20,28", help="layer counts to try, comma-separated")
    a("--arms", default=DEFAULT_ARMS, help=f"arms to compare (default {DEFAULT_ARMS})")
    a("--max-layers", default="", help="ARM=N,...: try ARM at no more than N layers (time)")
    a("--out", type=Path, default=Path("out/capacity"))
    a("--dim", type=int, default=4096)
    a("--heads", type=int, default=32)
    a("--ffn", type=int, default=11008)
    a("--vocab", type=int, default=32000)
    a("--batch", type=int, default=1, help="sequences per GPU per step (regime M: 1)")
    a("--seq", type=int, default=1024, help="sequence length (regime M: 1024)")
    a("--steps", type=int, default=3, help="timed steps")
    a("--warmup", type=int, default=2, help="warm-up steps (the first compiles)")
    a("--arm-timeout", type=float, default=300.0, help="seconds before an arm counts as hung")
    a("--deadline", type=float, default=None, help="start no new size after this many seconds")
    a("--budget", type=float, default=None,
      help="seconds for the whole run: a size still running then is stopped (its finished arms "
      "are kept) and the table is written")  # fmt: skip
    a("--phases-layers", type=int, default=0,
      help="at sizes up to this many layers, also time each arm's phases (bench.run --phases)")  # fmt: skip
    a("--nproc", type=int, default=1, help="ranks (default 1: one GPU)")
    a("--host-memory-gib", type=float, default=128.0,
      help="host memory that bounds the offload arms (default 128: nvidia-h100-x1)")  # fmt: skip
    a("--gpu-memory-gib", type=float, default=None,
      help="GPU memory for the bound (default: what bench.run read off the GPU)")  # fmt: skip
    a("--merge", type=Path, nargs="+", default=None,
      help="draw one table and plot from these earlier OUT folders (runs nothing)")  # fmt: skip
    a("--cpu", action="store_true", help="gloo on CPU (with --smoke)")
    a("--smoke", action="store_true", help="CPU smoke run of a tiny model (1,2 layers)")
    args = p.parse_args(argv)
    if args.smoke:
        args = p.parse_args([*SMOKE, "--layers", "1,2", "--steps", "1", "--warmup", "1",
                             "--arms", "fsdp2-eager,fczero-memory-eager,deepspeed-offload",
                             *argv])  # fmt: skip
    return args


def layer_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--layers takes whole numbers separated by commas, got {text!r}")
    if not counts or counts[0] < 1:
        raise SystemExit(f"--layers needs layer counts of at least 1, got {text!r}")
    return counts


def max_layers(text: str) -> dict[str, int]:
    """``"a=4,b=20"`` -> ``{"a": 4, "b": 20}``."""
    limits: dict[str, int] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        arm, _, n = item.partition("=")
        if not n.strip().isdigit():
            raise SystemExit(f"--max-layers takes ARM=N items separated by commas, got {item!r}")
        limits[arm.strip()] = int(n)
    return limits


def config(args: argparse.Namespace, layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=layers, n_heads=args.heads,
                       ffn_dim=args.ffn, max_seq_len=args.seq)  # fmt: skip


def run_size(args: argparse.Namespace, layers: int, arms: list[str]) -> dict[str, dict]:
    """One bench.run over ``arms`` at ``layers``; its records by arm (missing: it died)."""
    out = args.out / f"layers_{layers}"
    cmd = [sys.executable, "-m", "bench.run", "--arms", ",".join(arms), "--layers", str(layers),
           "--dim", str(args.dim), "--heads", str(args.heads), "--ffn", str(args.ffn),
           "--vocab", str(args.vocab), "--batch", str(args.batch), "--seq", str(args.seq),
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--arm-timeout", str(args.arm_timeout), "--out", str(out), "--fresh",
           "--nproc", str(args.nproc)]  # fmt: skip
    if args.cpu:
        cmd.append("--cpu")
    if layers <= args.phases_layers:
        cmd.append("--phases")
    limit = args.arm_timeout * len(arms) + 120
    if args.budget is not None:
        limit = max(1.0, min(limit, args.budget - (time.monotonic() - args.started) - 10))
    logger.info("capacity: %d layers, arms %s", layers, arms)
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        logger.error("capacity: %d layers did not finish within %.0f s; stopping it", layers, limit)
        stop(proc)
    records = report.read_records(out)
    report.annotate(records)  # the loss check over this size's arms
    return {r["arm"]: r for r in records}


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """End a bench.run started in its own session, and the workers it started.

    torchrun starts each worker in a session of its own, so a signal to the launcher's
    process group does not reach them, and a SIGKILLed launcher leaves them running (on one
    H100 such a worker went on training into the next call). So: SIGTERM first, which
    torchrun passes on to its workers, then SIGKILL to whatever of them is left."""
    workers = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in workers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def row_of(arm: str, layers: int, cfg: LlamaConfig, record: dict | None) -> dict:
    row: dict[str, object] = {"arm": arm, "layers": layers, "params": cfg.num_params()}
    if record is None:
        return {**row, "status": "missing", "error": "no result (the run died or timed out)"}
    row.update(status=record.get("status"), error=record.get("error"), meta=record.get("meta"))
    row.update({key: record.get(key) for key in FIELDS})
    return row


# --- what the rows say ------------------------------------------------------------------


def fit(points: list[tuple[float, float]], base: float | None) -> tuple[float, float] | None:
    """(bytes per param, bytes at zero params) of ``peak = a + b * params``: least squares
    over two or more sizes; with one size, ``b = (peak - base) / params`` and ``a = base``."""
    points = sorted(set(points))
    if len(points) >= 2:
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        if sxx > 0:
            b = sum((x - mx) * (y - my) for x, y in points) / sxx
            return b, my - b * mx
    if points and base is not None:
        x, y = points[-1]
        return (y - base) / x, base
    return None


def layers_for(params: float, cfg: LlamaConfig) -> int:
    """The most layers of ``cfg``'s width within ``params`` parameters (0 if none)."""
    per_layer = config_params(cfg, 2) - config_params(cfg, 1)
    fixed = config_params(cfg, 1) - per_layer
    return max(0, math.floor((params - fixed) / per_layer))


def config_params(cfg: LlamaConfig, layers: int) -> int:
    return LlamaConfig(vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=layers,
                       n_heads=cfg.n_heads, ffn_dim=cfg.ffn_dim).num_params()  # fmt: skip


def bounds(rows: list[dict], arm: str, *, host_gib: float, gpu_gib: float | None) -> dict:
    """Per arm: largest size trained, first size that failed, bytes per param on the host and
    the GPU, and the largest model each memory implies (the lower one bounds the arm)."""
    mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["params"])
    ok = [r for r in mine if r["status"] == "ok"]
    failed = next((r for r in mine if r["status"] not in ("ok", "not tried")), None)
    out: dict[str, object] = {"arm": arm, "largest": ok[-1] if ok else None, "failed": failed}
    for side, key, limit in (("host", "host_peak_gib", host_gib), ("gpu", "peak_mem_gib", gpu_gib)):
        points = [(r["params"], r[key] * GIB) for r in ok if r.get(key) is not None
                  and (side == "gpu" or r.get("host_peak_is_arm", True))]  # fmt: skip
        base = ok[-1].get("host_base_gib") if side == "host" and ok else 0.0
        line = fit(points, None if base is None else base * GIB)
        out[f"{side}_bytes_per_param"] = line[0] if line else None
        implied = None
        if line and limit is not None and line[0] > 0:
            implied = max(0.0, (limit * GIB - line[1]) / line[0])
        out[f"{side}_implied_params"] = implied
    implied = [v for v in (out["host_implied_params"], out["gpu_implied_params"]) if v is not None]
    out["implied_params"] = min(implied) if implied else None
    out["bound"] = None
    if implied:
        host, gpu = out["host_implied_params"], out["gpu_implied_params"]
        out["bound"] = "host" if gpu is None or (host is not None and host <= gpu) else "GPU"
    if failed is not None and out["implied_params"] is not None and _status_cell(failed) == "OOM":
        # a measured failure to fit beats an extrapolation
        out["implied_params"] = min(out["implied_params"], failed["params"])
    return out


def _status_cell(row: dict) -> str:
    status = row["status"]
    if status == "ok":
        return "ok"
    error = " ".join(str(row.get("error") or "").split()).replace("|", "/")
    if status == "not tried":
        return f"not tried ({error})"
    if "skipped:" in error:
        return "skipped: " + error.split("skipped:", 1)[1].strip()[:160]
    if "out of memory" in error.lower() or "OutOfMemoryError" in error:
        return "OOM"
    return "failed: " + error[:160]


def _f(value: object, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _loss(row: dict) -> str:
    if row["status"] != "ok" or row.get("loss_at_n") is None:
        return "-"
    return report._loss_cell({**row, "communicates": True})


def table(args: argparse.Namespace, rows: list[dict], arms: list[str]) -> str:
    """Markdown: every arm at every size, then each arm's bytes per param and bound."""
    sizes = sorted({r["layers"] for r in rows})
    head = ["arm", "layers", "params (B)", "status", "ms/step", "tokens/s", "GPU peak GiB",
            "host peak GiB", "pinned peak GiB", "loss (check)"]  # fmt: skip
    rule = "| --- | ---: | ---: | --- |" + " ---: |" * 5 + " --- |"
    lines = ["| " + " | ".join(head) + " |", rule]
    by = {(r["arm"], r["layers"]): r for r in rows}
    for arm in arms:
        for n in sizes:
            r = by.get((arm, n))
            if r is None:
                continue
            lines.append("| " + " | ".join([
                arm, str(n), f"{r['params'] / 1e9:.3g}", _status_cell(r),
                _f(r.get("step_ms"), ".0f"), _f(r.get("tokens_per_s_per_gpu"), ".0f"),
                _f(r.get("peak_mem_gib"), ".2f"), _f(r.get("host_peak_gib"), ".1f"),
                _f(r.get("pinned_peak_gib"), ".1f"), _loss(r),
            ]) + " |")  # fmt: skip
    gpu_gib = args.gpu_memory_gib or _gpu_gib(rows)
    cfg = config(args, 1)
    lines += ["", (f"Bounds: host memory {args.host_memory_gib:g} GiB, GPU "
              f"{_f(gpu_gib, '.1f')} GiB (bytes per param: the slope of peak against params over "
              "the sizes that trained; one size: its peak above the arm's start)"), ""]  # fmt: skip
    head = ["arm", "largest trained", "stopped fitting at", "host B/param", "GPU B/param",
            "host implies", "GPU implies", "bound"]  # fmt: skip
    lines += ["| " + " | ".join(head) + " |", "| --- | --- | --- |" + " ---: |" * 4 + " --- |"]
    for arm in arms:
        b = bounds(rows, arm, host_gib=args.host_memory_gib, gpu_gib=gpu_gib)
        largest, failed = b["largest"], b["failed"]
        cells = [
            arm,
            "none" if largest is None else f"{largest['layers']} layers ({largest['params'] / 1e9:.2f}B)",
            "-" if failed is None else f"{failed['layers']} layers ({_status_cell(failed)[:40]})",
            _f(b["host_bytes_per_param"], ".1f"),
            _f(b["gpu_bytes_per_param"], ".1f"),
            _implied(b["host_implied_params"], cfg),
            _implied(b["gpu_implied_params"], cfg),
            "-" if b["bound"] is None else f"{b['bound']}: {_implied(b['implied_params'], cfg)}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    notes = sorted({f"- {r['arm']}: {r['note']}" for r in rows if r.get("note")})
    runs = sorted({_run_label(r["meta"]) for r in rows if r.get("meta")})
    lines += ["", (f"dim {args.dim}, FFN {args.ffn}, heads {args.heads}, vocab {args.vocab}, "
              f"{args.nproc} GPU(s), batch {args.batch} x {args.seq}, {args.steps} timed steps "
              f"after {args.warmup} warm-up; ms/step is the median."), "", "Runs:",
              *[f"- {run}" for run in runs]]  # fmt: skip
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines)


def _implied(params: float | None, cfg: LlamaConfig) -> str:
    if params is None:
        return "-"
    return f"{params / 1e9:.1f}B ({layers_for(params, cfg)} layers)"


def _run_label(meta: dict) -> str:
    return (f"{meta.get('date', '?')}, {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, "
            f"commit {meta.get('commit', '?')}")  # fmt: skip


def _gpu_gib(rows: list[dict]) -> float | None:
    values = [r["meta"].get("gpu_memory_gib") for r in rows if r.get("meta")]
    values = [v for v in values if v]
    return min(values) if values else None


def plot(args: argparse.Namespace, rows: list[dict], arms: list[str], path: Path) -> bool:
    """Step time against model size, one line per arm; a cross where the arm stopped fitting
    (its first failed size), a triangle at the size its bytes per param imply."""
    plt = pyplot()
    if plt is None:
        return False
    gpu_gib = args.gpu_memory_gib or _gpu_gib(rows)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ok_times = [r["step_ms"] for r in rows if r["status"] == "ok" and r.get("step_ms")]
    top = max(ok_times or [1.0]) * 1.6
    for i, arm in enumerate(arms):
        color = f"C{i}"
        mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["params"])
        ok = [r for r in mine if r["status"] == "ok"]
        if ok:
            ax.plot([r["params"] / 1e9 for r in ok], [r["step_ms"] for r in ok], "o-",
                    color=color, label=arm)  # fmt: skip
        else:
            ax.plot([], [], "o-", color=color, label=f"{arm} (none trained)")
        b = bounds(rows, arm, host_gib=args.host_memory_gib, gpu_gib=gpu_gib)
        failed = b["failed"]
        stopped = failed is not None and failed["status"] == "error"
        if stopped and not _status_cell(failed).startswith("skipped"):
            ax.plot([failed["params"] / 1e9], [top], "x", color=color, markersize=11, mew=2.5)
        implied = b["implied_params"]
        if ok and implied is not None and (failed is None or implied < failed["params"]):
            ax.plot([b["implied_params"] / 1e9], [ok[-1]["step_ms"]], ">", color=color,
                    markersize=9, fillstyle="none", mew=1.5)  # fmt: skip
    ax.plot([], [], "kx", markersize=9, mew=2, linestyle="none", label="stopped fitting (measured)")
    ax.plot([], [], ">", color="k", fillstyle="none", linestyle="none",
            label=f"limit its bytes/param imply ({args.host_memory_gib:g} GiB host, "
            f"{_f(gpu_gib, '.0f')} GiB GPU)")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("model size (billions of parameters)")
    ax.set_ylabel("ms per step (log)")
    metas = [r["meta"] for r in rows if r.get("meta")]
    kinds = sorted({
        f"{m.get('date', '?')[:10]}, {m.get('gpu', '?')}, torch {m.get('torch', '?')}, "
        f"commit {m.get('commit', '?')}" for m in metas
    })  # fmt: skip
    runs = len({m.get("date") for m in metas})
    ax.set_title(f"One GPU, batch {args.batch} x {args.seq}, AdamW ({runs} bench.run calls)\n"
                 + "; ".join(kinds), fontsize=9)  # fmt: skip
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(args: argparse.Namespace, rows: list[dict], arms: list[str]) -> str:
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(args, rows, arms)
    (args.out / CAPACITY_MD).write_text(text + "\n")
    plot(args, rows, arms, args.out / CAPACITY_PNG)
    return text


def merged_rows(folders: list[Path]) -> list[dict]:
    """The rows of earlier runs, the loss check redone per size over all of them.

    A folder's ``capacity.jsonl`` gives its rows; bench.run's records under ``layers_N``
    replace its rows that have no result and give rows where the capacity table itself
    was never written (a run stopped at its time limit). For an arm and size measured in
    two folders, the later folder's row counts unless it has no result."""
    rows: dict[tuple[str, int], dict] = {}

    def put(row: dict) -> None:
        key = (row["arm"], row["layers"])
        if row["status"] != "missing" or key not in rows:
            rows[key] = row

    for folder in folders:
        mine: dict[tuple[str, int], dict] = {}
        path = folder / CAPACITY_JSONL
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    mine[(row["arm"], row["layers"])] = row
        for results in sorted(folder.glob("layers_*/" + report.RESULTS)):
            for record in report.read_records(results.parent):
                model = record["meta"]["model"]
                key = (record["arm"], model["n_layers"])
                if key not in mine or mine[key]["status"] == "missing":
                    row = {"arm": record["arm"], "layers": model["n_layers"],
                           "params": model["params"]}  # fmt: skip
                    row.update(status=record.get("status"), error=record.get("error"),
                               meta=record.get("meta"))  # fmt: skip
                    row.update({k: record.get(k) for k in FIELDS})
                    mine[key] = row
        for row in mine.values():
            put(row)
    merged = list(rows.values())
    recheck_losses(merged)
    return merged


def recheck_losses(rows: list[dict]) -> None:
    """bench.run's loss check over the arms of each size, whichever run they came from
    (same model, seed and tokens): FSDP2 eager is the reference where it trained."""
    from bench.arms import ARMS

    order = list(ARMS)
    records = [
        {**row, "regime": str(row["layers"]), "communicates": True, "host_init": False,
         "order": order.index(row["arm"]) if row["arm"] in order else len(order)}
        for row in rows if row["status"] == "ok" and row.get("losses")
    ]  # fmt: skip
    report.annotate(records)
    by = {(r["arm"], r["layers"]): r for r in records}
    for row in rows:
        checked = by.get((row["arm"], row["layers"]))
        if checked is not None:
            for key in ("loss_ref_arm", "loss_rel_diff", "loss_agrees"):
                row[key] = checked[key]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if args.merge:
        rows = merged_rows(args.merge)
        seen = [a for a in arms if any(r["arm"] == a for r in rows)]
        arms = seen + sorted({r["arm"] for r in rows} - set(seen))
        print(write(args, rows, arms))  # the CLI's answer
        return 0
    sizes = layer_counts(args.layers)
    limits = max_layers(args.max_layers)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    start = args.started = time.monotonic()
    alive, rows = list(arms), []

    def keep(row: dict) -> None:
        rows.append(row)
        with open(args.out / CAPACITY_JSONL, "a") as f:
            f.write(json.dumps(row) + "\n")

    for n in sizes:
        if not alive:
            break
        spent = time.monotonic() - start
        if (args.deadline is not None and spent > args.deadline) or (
            args.budget is not None and spent > args.budget - 30
        ):
            logger.warning("capacity: deadline passed; %d layers and larger not tried", n)
            break
        cfg = config(args, n)
        now = [a for a in alive if limits.get(a, n) >= n]
        for arm in alive:
            if arm not in now:
                keep({"arm": arm, "layers": n, "params": cfg.num_params(), "status": "not tried",
                      "error": f"--max-layers {arm}={limits[arm]}"})  # fmt: skip
        if not now:
            continue
        records = run_size(args, n, now)
        for arm in now:
            row = row_of(arm, n, cfg, records.get(arm))
            keep(row)
            if row["status"] != "ok":
                alive.remove(arm)
    text = write(args, rows, arms)
    print(text)  # the CLI's answer
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
