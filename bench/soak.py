"""Soak: thousands of steps of one arm; does memory creep, does anything recompile?

    torchrun --standalone --nproc-per-node 2 -m bench.soak --out out/soak   # 2 GPUs, regime M
    torchrun --standalone --nproc-per-node 4 -m bench.soak --arm fsdp2-compiled --out out/soak-fsdp2
    torchrun --standalone --nproc-per-node 4 -m bench.soak --arm fczero-cudagraphs \
        --compare-losses out/soak-fsdp2/soak.json --out out/soak-cg  # losses against FSDP2's run
    python -m bench.soak --smoke --out out/soak-smoke                       # CPU, gloo, tiny model

One process per GPU (NCCL), or per CPU rank with ``--smoke`` / ``--cpu`` (gloo). The
model is the benchmark's Llama; the arm is one of bench/arms.py's (``--arm``, default
``fczero-compiled``: bf16 params, fp32 reduce, AdamW, one ``torch.compile``). Steps
``1..warmup`` compile and settle; then, in windows of ``--window`` steps up to ``--steps``:

- throughput: wall time of the window (synchronized at both ends), tokens/s per GPU;
- peak memory: ``torch.cuda.max_memory_allocated``, reset at the start of each window, so
  the peak "at step 100" covers steps warmup+1..100 and "at step 2000" steps 1901..2000;
- recompiles: graphs Dynamo compiled after warm-up (``torch._dynamo.utils.counters``);
- the loss at the end of each window, and the mean of its steps' losses (summed on the
  device, read once the window ends).

Every rank's numbers are gathered on rank 0, which writes ``soak.json`` in ``--out``.
The run fails (exit code 1) if anything recompiled after warm-up, a loss is not finite,
the peak of the last window exceeds the first one's by more than ``--mem-tolerance``, a
window's throughput strays from the windows' median by more than ``--throughput-tolerance``,
or, with ``--compare-losses`` (another run's soak.json, same steps and data), a window's
mean loss differs from that run's by more than the benchmark's tolerance (``--loss-rtol`` x
max(|theirs|, 1), as bench.report compares arms).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.arms import ARMS, ArmContext
from bench.metrics import GIB, reset_memory, synchronize
from bench.report import DEFAULT_LOSS_RTOL
from bench.run import REGIMES, _meta, gather_json, make_batches, relaunch
from fczero.models.llama import LlamaConfig

logger = logging.getLogger("fczero.bench")

SMOKE: dict[str, object] = {
    "cpu": True, "dim": 64, "layers": 2, "heads": 4, "ffn": 172, "vocab": 256, "batch": 2,
    "seq": 32, "steps": 6, "warmup": 2, "window": 2, "compile_backend": "aot_eager",
    "throughput_tolerance": float("inf"),
}  # fmt: skip
"""What ``--smoke`` sets where the command line leaves it unset (a shared CPU's windows of two
steps vary by tens of percent: the smoke run checks everything but their throughput)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--out", type=Path, default=Path("out/soak"), help="output folder (default out/soak)")
    a("--regime", default="M", choices=sorted(REGIMES), help="per-GPU batch x sequence (default M)")
    a("--batch", type=int, help="per-GPU batch (overrides the regime's, with --seq)")
    a("--seq", type=int, help="sequence length (overrides the regime's, with --batch)")
    a("--dim", type=int, help="model width (default 2048: the 953M benchmark model)")
    a("--layers", type=int, help="decoder blocks (default 16)")
    a("--heads", type=int, help="attention heads (default 16)")
    a("--ffn", type=int, help="SwiGLU hidden width (default 5632)")
    a("--vocab", type=int, help="vocabulary (default 32000)")
    a("--steps", type=int, help="total steps, warm-up included (default 2000)")
    a("--warmup", type=int, help="steps before the first window: compile and settle (default 10)")
    a("--window", type=int, help="steps per window (default 100)")
    a("--lr", type=float, default=3e-4)
    a("--seed", type=int, default=0)
    a("--data-batches", type=int, default=8, help="distinct token batches cycled (default 8)")
    a("--arm", default="fczero-compiled", choices=sorted(ARMS),
      help="what trains (bench/arms.py; default fczero-compiled)")  # fmt: skip
    a("--compile-backend", help="torch.compile backend (default inductor; smoke: aot_eager)")
    a("--mem-tolerance", type=float, default=0.02, help="allowed peak growth, fraction (0.02)")
    a("--throughput-tolerance", type=float,
      help="allowed distance of a window's tokens/s from the windows' median, fraction (0.03)")  # fmt: skip
    a("--compare-losses", type=Path,
      help="another run's soak.json (same steps, windows and data): its losses, window by window, "
      "are the reference")  # fmt: skip
    a("--loss-rtol", type=float, default=DEFAULT_LOSS_RTOL,
      help=f"loss tolerance against --compare-losses, x max(|theirs|, 1) (default {DEFAULT_LOSS_RTOL:g})")  # fmt: skip
    a("--cpu", action="store_true", default=None, help="run on CPU with gloo")
    a("--nproc", type=int, help="processes when not started by torchrun (default: GPUs, or 2)")
    a("--commit", help="commit to record (default: git rev-parse, if it works)")
    a("--smoke", action="store_true",
      help="CPU smoke run: " + ", ".join(f"{k}={v}" for k, v in SMOKE.items()))  # fmt: skip
    args = p.parse_args(argv)
    defaults: dict[str, object] = {
        "cpu": False, "dim": 2048, "layers": 16, "heads": 16, "ffn": 5632, "vocab": 32000,
        "steps": 2000, "warmup": 10, "window": 100, "compile_backend": "inductor",
        "throughput_tolerance": 0.03,
    }  # fmt: skip
    for key, value in {**defaults, **(SMOKE if args.smoke else {})}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.batch is None or args.seq is None:
        batch, seq = REGIMES[args.regime]
        args.batch = args.batch if args.batch is not None else batch
        args.seq = args.seq if args.seq is not None else seq
    if args.window < 1 or args.warmup < 1 or args.steps < args.warmup + args.window:
        p.error("need --warmup >= 1, --window >= 1 and --steps >= --warmup + --window")
    if args.compare_losses is not None:
        if not args.compare_losses.is_file():
            p.error(f"--compare-losses {args.compare_losses}: no such file; give a soak.json "
                    "that an earlier run wrote")  # fmt: skip
        theirs = [w["end_step"] for w in json.loads(args.compare_losses.read_text())["windows"]]
        if theirs != window_ends(args):
            p.error(f"--compare-losses: its windows end at steps {theirs}, this run's would at "
                    f"{window_ends(args)}; give both runs the same --steps, --warmup and --window")  # fmt: skip
    return args


def window_ends(args: argparse.Namespace) -> list[int]:
    """The step each window ends at: multiples of ``--window`` after the warm-up, and the last."""
    ends = list(range((args.warmup // args.window + 1) * args.window, args.steps, args.window))
    return [*ends, args.steps] if args.steps not in ends else ends


def _graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process so far (each recompile adds one)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def soak(args: argparse.Namespace, ctx: ArmContext) -> dict:
    """Run the steps; return this rank's numbers."""
    arm = ARMS[args.arm].build(ctx)
    step = arm.step
    batches = make_batches(args, ctx.cfg, args.batch, args.seq, ctx.device)
    device = ctx.device

    reset_memory(device)
    start = time.perf_counter()
    for i in range(1, args.warmup + 1):
        loss = step(batches[(i - 1) % len(batches)])
        if i == 1:
            synchronize(device)
            first_step_s = time.perf_counter() - start
    synchronize(device)
    warmup_s = time.perf_counter() - start
    graphs_at_warmup = _graphs_compiled()
    warmup_peak = _peak_gib(device)

    windows = []
    done = args.warmup
    for end in window_ends(args):
        n = end - done
        reset_memory(device)
        t0 = time.perf_counter()
        total = torch.zeros((), dtype=torch.float32, device=device)
        for i in range(done + 1, done + n + 1):
            loss = step(batches[(i - 1) % len(batches)])
            total += loss.float()  # on the device: no sync inside the window
        synchronize(device)
        seconds = time.perf_counter() - t0
        done += n
        windows.append({
            "end_step": done, "steps": n, "seconds": seconds, "step_ms": 1e3 * seconds / n,
            "tokens_per_s_per_gpu": n * args.batch * args.seq / seconds,
            "peak_mem_gib": _peak_gib(device),
            "allocated_gib": torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None,
            "loss": float(loss),
            "mean_loss": float(total) / n,
            "graphs_compiled": _graphs_compiled(),
        })  # fmt: skip
    if arm.close is not None:
        arm.close()
    return {
        "first_step_s": first_step_s,
        "warmup_s": warmup_s,
        "warmup_peak_mem_gib": warmup_peak,
        "graphs_at_warmup": graphs_at_warmup,
        "recompiles_after_warmup": _graphs_compiled() - graphs_at_warmup,
        "windows": windows,
    }


def summarize(
    args: argparse.Namespace, per_rank: list[dict], reference: dict | None = None
) -> dict:
    """Every rank's windows merged: the slowest rank's time, the highest rank's peak.
    ``reference``: another run's soak.json, whose window losses this run's must match."""
    windows = []
    for k, first in enumerate(per_rank[0]["windows"]):
        ranks = [r["windows"][k] for r in per_rank]
        peaks = [w["peak_mem_gib"] for w in ranks if w["peak_mem_gib"] is not None]
        windows.append({
            "end_step": first["end_step"], "steps": first["steps"],
            "step_ms": max(w["step_ms"] for w in ranks),
            "tokens_per_s_per_gpu": min(w["tokens_per_s_per_gpu"] for w in ranks),
            "peak_mem_gib": max(peaks) if peaks else None,
            "loss": [w["loss"] for w in ranks],
            "mean_loss": [w.get("mean_loss") for w in ranks],
        })  # fmt: skip
    first_full = next((w for w in windows if w["end_step"] >= args.window), windows[0])
    last = windows[-1]
    recompiles = [r["recompiles_after_warmup"] for r in per_rank]
    problems = []
    if any(recompiles):
        problems.append(f"recompiles after warm-up on ranks: {recompiles}")
    values = [x for w in windows for x in (*w["loss"], *w["mean_loss"]) if x is not None]
    if not all(math.isfinite(x) for x in values):
        problems.append("a loss is not finite")
    growth = None
    if first_full["peak_mem_gib"] is not None:
        growth = last["peak_mem_gib"] - first_full["peak_mem_gib"]
        if growth > args.mem_tolerance * first_full["peak_mem_gib"]:
            problems.append(
                f"peak memory grew by {growth:.3f} GiB from step {first_full['end_step']} "
                f"to step {last['end_step']}"
            )
    median_tps = sorted(w["tokens_per_s_per_gpu"] for w in windows)[len(windows) // 2]
    spread = [w["tokens_per_s_per_gpu"] / median_tps - 1 for w in windows]
    strays = [w["end_step"] for w, d in zip(windows, spread) if abs(d) > args.throughput_tolerance]
    if strays:
        problems.append(
            f"throughput more than {args.throughput_tolerance:.0%} from the median in the "
            f"windows ending at steps {strays}"
        )
    losses = compare_losses(args, windows, reference) if reference is not None else None
    if losses is not None and losses["outside"]:
        problems.append(
            f"losses outside {args.loss_rtol:g} x max(|ref|, 1) of {losses['against']} "
            f"at steps {losses['outside']}"
        )
    return {
        "status": "ok" if not problems else "failed",
        "problems": problems,
        f"peak_mem_gib_at_step_{first_full['end_step']}": first_full["peak_mem_gib"],
        f"peak_mem_gib_at_step_{last['end_step']}": last["peak_mem_gib"],
        "peak_growth_gib": growth,
        "recompiles_after_warmup": recompiles,
        "step_ms_median_window": sorted(w["step_ms"] for w in windows)[len(windows) // 2],
        "first_step_s": max(r["first_step_s"] for r in per_rank),
        "throughput_spread": [min(spread), max(spread)],
        "losses_against": losses,
        "windows": windows,
    }


def compare_losses(args: argparse.Namespace, windows: list[dict], reference: dict) -> dict:
    """This run's rank-0 window losses against ``reference``'s, window by window: the largest
    difference in units of the tolerance's scale, and the windows outside it.

    Each window's mean loss over its steps where both runs recorded it (a window's last
    loss alone is one step on one batch: near a memorized batch's zero it is noise), else
    its last loss (a reference written before the means were)."""
    has_means = all(w.get("mean_loss", [None])[0] is not None for w in reference["windows"])
    key = "mean_loss" if has_means else "loss"
    theirs = {w["end_step"]: w[key][0] for w in reference["windows"]}
    scaled = {
        w["end_step"]: abs(w[key][0] - theirs[w["end_step"]]) / max(abs(theirs[w["end_step"]]), 1.0)
        for w in windows
    }  # fmt: skip
    return {
        "compared": key,
        "against": reference.get("args", {}).get("arm", "the reference run"),
        "max_scaled_diff": max(scaled.values()),
        "outside": [step for step, d in scaled.items() if not d <= args.loss_rtol],
    }


def worker(args: argparse.Namespace) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank} %(asctime)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    use_cuda = not args.cpu and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    ctrl = dist.new_group(backend="gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    cfg = LlamaConfig(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
        ffn_dim=args.ffn, max_seq_len=args.seq,
    )  # fmt: skip
    ctx = ArmContext(cfg=cfg, mesh=mesh, device=device, batch=args.batch, seq_len=args.seq,
                     seed=args.seed, lr=args.lr, compile_backend=args.compile_backend)  # fmt: skip
    if rank == 0:
        logger.info("soak %s: %d steps (%d warm-up, windows of %d), %d x %d per rank, %d ranks on %s",
                    args.arm, args.steps, args.warmup, args.window, args.batch, args.seq, world,
                    device)  # fmt: skip
    started = time.perf_counter()
    mine = soak(args, ctx)
    per_rank = gather_json(mine, ctrl)
    if rank == 0:
        reference = None
        if args.compare_losses is not None:
            reference = json.loads(args.compare_losses.read_text())
        result = {
            "meta": _meta(args, cfg, device, world),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            **summarize(args, per_rank, reference),
            "total_s": time.perf_counter() - started,
            "per_rank": per_rank,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
        for w in result["windows"]:
            logger.info("steps to %5d: %7.2f ms/step, %9.0f tokens/s/GPU, peak %s, mean loss %.4f",
                        w["end_step"], w["step_ms"], w["tokens_per_s_per_gpu"],
                        "n/a" if w["peak_mem_gib"] is None else f"{w['peak_mem_gib']:.3f} GiB",
                        w["mean_loss"][0])  # fmt: skip
        logger.info("soak %s in %.0f s; %s", result["status"], result["total_s"],
                    "; ".join(result["problems"]) or "no recompiles, no memory growth, "
                    "throughput within the tolerance")  # fmt: skip
        if (losses := result["losses_against"]) is not None:
            logger.info("losses against %s: largest difference %.4f x max(|ref|, 1)",
                        losses["against"], losses["max_scaled_diff"])  # fmt: skip
        status = result["status"]
    else:
        status = None
    status = gather_json(status, ctrl)[0]
    dist.destroy_process_group()
    return 0 if status == "ok" else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return relaunch(args, argv, "bench.soak")
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
