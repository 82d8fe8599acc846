"""Capacity: the largest Llama (in layers) each configuration trains, and its speed.

    python -m bench.capacity --layers 24,48,72,96 --out out/capacity       # 2 GPUs
    python -m bench.capacity --smoke --out out/capacity_smoke              # CPU, tiny

For each layer count, smallest first, one ``bench.run`` (under torchrun) times every
configuration that has not failed yet: a few warm-up and timed steps of AdamW on a
(batch, seq) batch per GPU. A configuration that fails (out of memory, or any error,
agreed over a gloo group by ``bench.run``) is not tried at larger sizes. The
configurations (``bench.arms``, group ``memory`` plus FSDP2's plain arm):

| arm | memory features |
| --- | --- |
| fsdp2-eager | none (sharded params, grads, AdamW state on the GPU) |
| fsdp2-cpuoffload | FSDP2 ``CPUOffloadPolicy``: params, grads, state on the host, step on CPU |
| fczero-memory-eager | fczero eager, AdamW state in pinned host memory, step in 512 MiB chunks |
| fczero-memory | fczero compiled, activation offload ``all`` (>= 1 MiB) and AdamW state offload |
| fczero-params-offload | fczero compiled, activation offload ``all``, ``offload_params`` (step on CPU) |

Writes ``capacity.jsonl`` (one line per arm and size) and ``capacity.md`` (the table:
per size ms/step and peak GiB, or what failed; then the largest size that trained).
Each size runs in its own ``OUT/layers_N`` folder with bench.run's full records.
Time: every size costs one process start (~20 s) plus each arm's build and steps;
``--deadline`` (seconds) stops starting new sizes once it has passed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from fczero.models.llama import LlamaConfig

logger = logging.getLogger("fczero.bench")

DEFAULT_ARMS = (
    "fsdp2-eager,fsdp2-cpuoffload,fczero-memory-eager,fczero-memory,fczero-params-offload"
)
SMOKE = ["--cpu", "--dim", "64", "--heads", "4", "--ffn", "172", "--vocab", "256",
         "--batch", "2", "--seq", "32"]  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--layers", default="24,48,72,96", help="layer counts to try, comma-separated")
    a("--arms", default=DEFAULT_ARMS, help=f"arms to compare (default {DEFAULT_ARMS})")
    a("--out", type=Path, default=Path("out/capacity"))
    a("--dim", type=int, default=4096)
    a("--heads", type=int, default=32)
    a("--ffn", type=int, default=11008)
    a("--vocab", type=int, default=32000)
    a("--batch", type=int, default=1, help="sequences per GPU per step")
    a("--seq", type=int, default=2048)
    a("--steps", type=int, default=3, help="timed steps")
    a("--warmup", type=int, default=2, help="warm-up steps (the first compiles)")
    a("--arm-timeout", type=float, default=300.0, help="seconds before an arm counts as hung")
    a("--deadline", type=float, default=None, help="start no new size after this many seconds")
    a("--nproc", type=int, default=None, help="ranks (default: the GPUs, or 2 on CPU)")
    a("--cpu", action="store_true", help="gloo on CPU (with --smoke)")
    a("--smoke", action="store_true", help="CPU smoke run of a tiny model (1,2 layers)")
    args = p.parse_args(argv)
    if args.smoke:
        args = p.parse_args([*SMOKE, "--layers", "1,2", "--steps", "1", "--warmup", "1",
                             "--arms", "fsdp2-eager,fczero-memory-eager", *argv])  # fmt: skip
    return args


def layer_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--layers takes whole numbers separated by commas, got {text!r}")
    if not counts or counts[0] < 1:
        raise SystemExit(f"--layers needs layer counts of at least 1, got {text!r}")
    return counts


def run_size(args: argparse.Namespace, layers: int, arms: list[str]) -> dict[str, dict]:
    """One bench.run over ``arms`` at ``layers``; its records by arm (missing: it died)."""
    out = args.out / f"layers_{layers}"
    cmd = [sys.executable, "-m", "bench.run", "--arms", ",".join(arms), "--layers", str(layers),
           "--dim", str(args.dim), "--heads", str(args.heads), "--ffn", str(args.ffn),
           "--vocab", str(args.vocab), "--batch", str(args.batch), "--seq", str(args.seq),
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--arm-timeout", str(args.arm_timeout), "--out", str(out), "--fresh"]  # fmt: skip
    if args.cpu:
        cmd.append("--cpu")
    if args.nproc:
        cmd += ["--nproc", str(args.nproc)]
    limit = args.arm_timeout * len(arms) + 120
    logger.info("capacity: %d layers, arms %s", layers, arms)
    try:
        subprocess.run(cmd, timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        logger.error("capacity: %d layers did not finish within %.0f s", layers, limit)
    records: dict[str, dict] = {}
    results = out / "results.jsonl"
    if results.exists():
        for line in results.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                records[record["arm"]] = record
    return records


def cell(record: dict | None) -> str:
    if record is None:
        return "-"
    if record.get("status") == "missing":
        return "no result (the run died or timed out)"
    if record.get("status") != "ok":
        error = str(record.get("error") or "failed")
        return "OOM" if "out of memory" in error.lower() else "failed: " + error[:60]
    peak = record.get("peak_mem_gib")
    peak_text = f", {peak:.1f} GiB" if peak is not None else ""
    return f"{record['step_ms']:.0f} ms{peak_text}"


def table(args, sizes: list[int], arms: list[str], rows: list[dict]) -> str:
    by = {(r["arm"], r["layers"]): r for r in rows}
    head = ["arm", *(f"{n} layers" for n in sizes), "largest that trained", "tokens/s/GPU there"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for arm in arms:
        cells, best = [], None
        for n in sizes:
            record = by.get((arm, n))
            cells.append(cell(record))
            if record and record.get("status") == "ok":
                best = record
        if best is None:
            tail = ["none", "-"]
        else:
            params = best["params_b"]
            tail = [f"{best['layers']} ({params:.3g}B params)",
                    f"{best['tokens_per_s_per_gpu'] or 0:.0f}"]  # fmt: skip
        lines.append("| " + " | ".join([arm, *cells, *tail]) + " |")
    lines.append("")
    lines.append(f"dim {args.dim}, ffn {args.ffn}, heads {args.heads}, vocab {args.vocab}, "
                 f"batch {args.batch} x seq {args.seq} per GPU, {args.steps} timed steps after "
                 f"{args.warmup} warm-up; ms/step is the slowest rank's median.")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sizes = layer_counts(args.layers)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    start = time.monotonic()
    alive, rows = list(arms), []
    for n in sizes:
        if not alive:
            break
        if args.deadline is not None and time.monotonic() - start > args.deadline:
            logger.warning("capacity: deadline passed; %d layers and larger not tried", n)
            break
        records = run_size(args, n, alive)
        cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=n, n_heads=args.heads,
                          ffn_dim=args.ffn, max_seq_len=args.seq)  # fmt: skip
        for arm in list(alive):
            record = records.get(arm)
            row = {"arm": arm, "layers": n, "params_b": cfg.num_params() / 1e9,
                   "status": "missing" if record is None else record.get("status"),
                   "error": None if record is None else record.get("error"),
                   "step_ms": None if record is None else record.get("step_ms"),
                   "peak_mem_gib": None if record is None else record.get("peak_mem_gib"),
                   "tokens_per_s_per_gpu": None if record is None
                   else record.get("tokens_per_s_per_gpu")}  # fmt: skip
            rows.append(row)
            with open(args.out / "capacity.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if row["status"] != "ok":
                alive.remove(arm)
    text = table(args, sizes, arms, rows)
    (args.out / "capacity.md").write_text(text + "\n")
    print(text)  # the CLI's answer
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
