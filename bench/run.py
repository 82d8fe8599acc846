"""CLI: run the arms of shared/BENCHMARK.md one after another in the same processes.

    torchrun --nproc-per-node 2 -m bench.run --out out/bench            # every arm, C and M
    python -m bench.run --arms core --regimes M --steps 10 --out out/m  # relaunches under torchrun
    python -m bench.run --smoke --out out/smoke                          # CPU, gloo, tiny model
    python -m bench.run --smoke --model hf-tiny --arms realistic  # HF's LlamaForCausalLM, CPU
    torchrun --nproc-per-node 8 -m bench.run --model llama3-8b --regimes R8 --floor-layers 8

One process per GPU (NCCL), or per CPU rank with ``--cpu`` / ``--smoke`` (gloo).
For each arm and regime: build the arm, time it (bench.metrics), optionally profile
it (bench.profile), then free everything before the next. Every rank catches its
arm's exception; the ranks then agree on the outcome over a separate gloo group, so
an arm that fails on one rank is recorded as failed on all and the run goes on. An
arm still running after ``--arm-timeout`` seconds (a hang in a collective, say) is
recorded as timed out and the run exits; what was recorded so far stays in OUT.

A model that does not fit one GPU has no floor at full depth: ``--floor-layers N`` builds
the floor arms (those that do not communicate) with N/2 and N blocks instead and fits
step time as a line in the depth, ``t(L) = t(N) + (L - N) (t(N) - t(N/2)) / (N - N/2)``:
the slope is one block's cost, the intercept the embedding, the output and their optimizer
step, which a per-layer ratio ``t(N) L / N`` would count L / N times over
(``scale_floor``). The record keeps both measurements under ``floor_scaled``; its label
says "scaled from N/2 and N layers"; its peak memory and first step are the N-block model's.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from bench import report
from bench.arms import ArmContext, ArmSpec, ArmUnavailable, select_arms
from bench.hf_model import CHECKPOINTING as HF_CHECKPOINTING
from bench.metrics import HostMemory, derived, empty_host_cache, measure, reset_memory
from bench.phases import time_phases
from bench.profile import profile_steps
from fczero.models.llama import LlamaConfig

logger = logging.getLogger("fczero.bench")

REGIMES: dict[str, tuple[int, int]] = {
    "C": (4, 2048), "M": (1, 1024), "R": (1, 4096), "R8": (1, 8192),
}  # fmt: skip
"""Regime name -> (per-GPU batch, sequence length). R, the realistic regime, is meant for
``--model llama3-3b`` or ``hf-llama3-3b`` (Llama-3.2-3B's shape, each block checkpointed);
R8 for ``--model llama3-8b`` (Llama-3-8B's shape, selective checkpointing), which takes
``--floor-layers`` (its floor does not fit one GPU)."""

_LLAMA3_3B: dict[str, object] = {
    "dim": 3072, "layers": 28, "heads": 24, "kv_heads": 8, "ffn": 8192, "vocab": 128256,
    "tie": True, "checkpointing": "full",
}  # fmt: skip

MODELS: dict[str, dict[str, object]] = {
    "bench": {"dim": 2048, "layers": 16, "heads": 16, "kv_heads": None, "ffn": 5632,
              "vocab": 32000, "tie": False, "checkpointing": "none"},
    "llama3-3b": _LLAMA3_3B,
    "hf-llama3-3b": {**_LLAMA3_3B, "hf": True},
    "llama3-8b": {"dim": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336,
                  "vocab": 128256, "tie": False, "checkpointing": "selective"},
    "hf-tiny": {"dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 172, "vocab": 256,
                "tie": True, "checkpointing": "full", "hf": True},
}  # fmt: skip
"""``--model`` presets: the sizes any of ``--dim`` ... ``--checkpointing`` leaves unset.
``hf: True``: Hugging Face's ``LlamaForCausalLM`` of that shape (bench.hf_model) instead of
fczero's Llama; ``hf-tiny`` is the CPU smoke run's shape (``--smoke --model hf-tiny``)."""

SMOKE: dict[str, object] = {
    "cpu": True, "dim": 64, "layers": 2, "heads": 4, "ffn": 172, "vocab": 256, "batch": 2,
    "seq": 32, "arms": "fczero-eager,fsdp2-eager", "steps": 3, "warmup": 1, "nproc": 2, "lr": 1e-3,
}  # fmt: skip
"""What ``--smoke`` sets where the command line leaves it unset."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--out", type=Path, default=Path("out/bench"), help="output folder (default out/bench)")
    a("--arms", help="comma-separated arms or groups: all (default), core, deepspeed, fczero, "
      "fsdp2, floor, fsdp2-eager, fsdp2-compiled, ddp, fczero-eager, fczero-compiled, "
      "deepspeed-zero3, deepspeed-deepcompile")  # fmt: skip
    a("--skip", default="", help="arms or groups to leave out")
    a("--arms-as-given", action="store_true",
      help="run the arms in the order --arms names them (default: the order of bench.arms.ARMS)")  # fmt: skip
    a("--regimes", default="C,M",
      help="C (4 x 2048), M (1 x 1024), R (1 x 4096), R8 (1 x 8192); default C,M")  # fmt: skip
    a("--batch", type=int, help="per-GPU batch: with --seq, one custom regime instead of --regimes")
    a("--seq", type=int, help="sequence length of the custom regime")
    a("--dim", type=int, help="model width (default: the 953M benchmark model's 2048)")
    a("--layers", type=int, help="decoder blocks (default 16)")
    a("--heads", type=int, help="attention heads (default 16)")
    a("--ffn", type=int, help="SwiGLU hidden width (default 5632)")
    a("--vocab", type=int, help="vocabulary (default 32000)")
    a("--model", choices=sorted(MODELS), default="bench",
      help="size preset: bench (the 953M model, default), llama3-3b (regime R's model), "
      "hf-llama3-3b (that shape as Hugging Face's LlamaForCausalLM, random weights, HF's "
      "own checkpointing), hf-tiny (a tiny LlamaForCausalLM: --smoke --model hf-tiny), "
      "llama3-8b (Llama-3-8B's shape, regime R8's model)")  # fmt: skip
    a("--kv-heads", type=int, help="key/value heads, grouped-query attention (default: --heads)")
    a("--tie", action="store_true", default=None, help="tie the embedding and the output")
    a("--checkpointing", choices=["none", "full", "selective"],
      help="activation checkpointing of each block (bench: none; llama3-3b: full; "
      "llama3-8b: selective); "
      "the hf-* models take none or full")  # fmt: skip
    a("--floor-layers", type=int,
      help="build the floor arms with N/2 and N blocks and scale their step time to the "
      "model's depth (a line through the two): for a model whose floor does not fit one GPU")  # fmt: skip
    a("--steps", type=int, help="timed steps after warm-up (default 10)")
    a("--warmup", type=int, help="warm-up steps, the first (compiling) one included (default 5)")
    a("--lr", type=float, help="AdamW learning rate (default 3e-4)")
    a("--seed", type=int, default=0)
    a("--data-batches", type=int, default=1,
      help="distinct token batches cycled through (default 1: the model memorizes one batch, "
      "so the losses move and their agreement means something)")  # fmt: skip
    a("--loss-rtol", type=float, default=report.DEFAULT_LOSS_RTOL,
      help="relative loss tolerance against FSDP2 eager (default 2e-2)")  # fmt: skip
    a("--profile", action="store_true", help="also profile each arm: trace + exposed comm")
    a("--profile-steps", type=int, default=3)
    a("--phases", nargs="?", const="time", choices=["time", "cprofile"],
      help="also time forward, backward and update apart, host and GPU (bench.phases); "
      "'cprofile' adds each phase's top host functions to the record")  # fmt: skip
    a("--arm-timeout", type=float, default=600.0, help="seconds before an arm counts as hung")
    a("--compile-backend", default="inductor", help="torch.compile backend of the compiled arms")
    a("--cpu", action="store_true", default=None, help="run on CPU with gloo")
    a("--nproc", type=int, help="processes when not started by torchrun (default: GPUs, or 2)")
    a("--fresh", action="store_true", help="drop OUT's earlier results first")
    a("--commit", help="commit to print in the table (default: git rev-parse, if it works)")
    a(
        "--smoke",
        action="store_true",
        help="CPU smoke run: " + ", ".join(f"{k}={v}" for k, v in SMOKE.items()),
    )
    args = p.parse_args(argv)
    defaults: dict[str, object] = {
        "hf": False, **MODELS[args.model], "cpu": False, "arms": "all", "steps": 10, "warmup": 5,
        "lr": 3e-4,
    }  # fmt: skip
    for key, value in {**defaults, **(SMOKE if args.smoke else {})}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if (args.batch is None) != (args.seq is None):
        p.error("--batch and --seq go together (one custom regime)")
    if args.floor_layers is not None and not 2 <= args.floor_layers < args.layers:
        p.error(
            f"--floor-layers {args.floor_layers}: the floor is measured at N/2 and N blocks, so "
            f"N must be at least 2 and below the model's {args.layers} layers"
        )
    if args.hf and args.checkpointing not in HF_CHECKPOINTING:
        p.error(
            f"--checkpointing {args.checkpointing} is not offered for the Hugging Face model "
            f"(--model {args.model}): HF checkpoints whole layers only; pick one of "
            f"{', '.join(HF_CHECKPOINTING)}"
        )
    return args


def regimes(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    if args.batch is not None:
        return {f"{args.batch}x{args.seq}": (args.batch, args.seq)}
    names = [n.strip() for n in args.regimes.split(",") if n.strip()]
    unknown = [n for n in names if n not in REGIMES]
    if unknown:
        raise SystemExit(f"unknown regime(s) {unknown}; pick from {list(REGIMES)}")
    return {n: REGIMES[n] for n in names}


def relaunch(args: argparse.Namespace, argv: list[str], module: str = "bench.run") -> int:
    """Not under torchrun: start ``--nproc`` copies of ``module`` through torch.distributed.run."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    nproc = args.nproc
    if nproc is None:
        nproc = 2 if args.cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    try:
        torchrun(relaunch_argv(nproc, argv, module))
    except ChildFailedError as e:
        logger.error("a rank failed: %s", e)
        return 1
    return 0


def relaunch_argv(nproc: int, argv: list[str], module: str) -> list[str]:
    """torchrun's arguments to run ``module`` on ``nproc`` local processes with ``argv``.

    ``--nproc`` is dropped from what the children get: they run under torchrun and do not
    read it, and torchrun's own parser takes ``--nproc`` for an abbreviation of
    ``--nproc-per-node`` / ``--nproc_per_node`` and stops as ambiguous (torch 2.11).
    """
    kept: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg == "--nproc":
            skip_value = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return ["--standalone", f"--nproc-per-node={nproc}", "-m", module, *kept]


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _meta(args: argparse.Namespace, cfg: LlamaConfig, device: torch.device, world: int) -> dict:
    gpu_memory_gib = None
    if device.type == "cuda":
        gpu = f"{world} x {torch.cuda.get_device_name(device)}"
        gpu_memory_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    else:
        gpu = f"none (CPU, {world} gloo ranks)"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": gpu,
        "gpu_memory_gib": gpu_memory_gib,
        "torch": torch.__version__,
        "commit": args.commit or os.environ.get("FCZERO_COMMIT") or _git_commit(),
        "model": {**asdict(cfg), "params": cfg.num_params(), "hf": getattr(args, "hf", False)},
    }


def make_batches(args, cfg: LlamaConfig, batch: int, seq: int, device: torch.device) -> list:
    """This rank's slice of the same synthetic tokens every arm sees: (B, T+1) per step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(
        0, cfg.vocab_size, (args.data_batches, world * batch, seq + 1), generator=gen
    )
    return [t[rank * batch : (rank + 1) * batch].to(device) for t in tokens]


def gather_json(obj: object, group: dist.ProcessGroup) -> list:
    """Every rank's JSON-able ``obj``, in rank order, through tensor collectives.

    ``all_gather_object`` would do, but it needs numpy, which torch does not require.
    """
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([data.numel()]), group=group)
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    chunks = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(chunks, padded, group=group)
    return [json.loads(bytes(c[: int(n)].tolist())) for c, n in zip(chunks, sizes)]


_ABORTING = threading.Lock()


def abort(out: Path, record: dict, error: str, code: int) -> None:
    """This rank cannot go on (its arm hung, or the ranks lost each other): record why and exit.

    Every rank appends its own line; rank 0 waits a moment for the others' lines, redraws
    the table and exits first (torchrun then stops the rest, which wait to be stopped).
    ``report.read_records`` merges the aborted lines of one arm and run.
    """
    if not _ABORTING.acquire(blocking=False):  # the watchdog and the main thread both got here
        time.sleep(3600)  # the first caller ends the process
    rank = dist.get_rank()
    try:
        line = {**record, "status": "error", "aborted": True, "error": f"rank {rank}: {error}"}
        if rank == 0:
            time.sleep(3.0)
            report.append_record(out, line)
            report.write_reports(out)
        else:
            report.append_record(out, line)
            time.sleep(10.0)
    finally:
        logging.shutdown()
        os._exit(code)


class Watchdog:
    """Calls ``abort`` if the arm is still running after ``seconds`` (a hang in a collective)."""

    def __init__(self, seconds: float, out: Path, record: dict, state: dict) -> None:
        self._timer = threading.Timer(seconds, self._fire, args=(seconds, out, record, state))
        self._timer.daemon = True

    @staticmethod
    def _fire(seconds: float, out: Path, record: dict, state: dict) -> None:
        logger.error("arm still running after %.0f s: recording it as timed out, exiting", seconds)
        error = f"TimeoutError: still running after {seconds:.0f} s (hung or too slow)"
        if state.get("error"):
            error = f"{state['error']}; then {error}"
        abort(out, record, error, 124)

    def __enter__(self) -> Watchdog:  # noqa: PYI034
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def run_arm(spec: ArmSpec, ctx: ArmContext, regime: str, args, batches, ctrl, base: dict) -> dict:
    """Build, time and free one arm on this rank; every rank returns the same record."""
    rank, world = dist.get_rank(), dist.get_world_size()
    record = {**base, "arm": spec.name, "label": spec.label, "regime": regime,
              "batch": ctx.batch, "seq_len": ctx.seq_len, "communicates": spec.communicates,
              "host_init": spec.host_init}  # fmt: skip
    warmup = max(args.warmup, spec.min_warmup)
    state: dict[str, str | None] = {"error": None}  # this rank's own failure, for the watchdog
    result: dict | None = None
    arm = None
    with Watchdog(args.arm_timeout, args.out, record, state):
        try:
            torch._dynamo.reset()
            host = HostMemory()
            host.start()  # the build counts: offload arms fill host memory there
            arm = spec.build(ctx)
            reset_memory(ctx.device)
            m = measure(arm.step, batches, warmup=warmup, steps=args.steps, device=ctx.device)
            result = {**asdict(m), **host.read(), "note": arm.note}
            if args.profile:
                trace = args.out / "traces" / f"{regime}_{spec.name}_rank{rank}.json.gz"
                summary = profile_steps(arm.step, batches, steps=args.profile_steps,
                                        device=ctx.device, trace_path=trace, keep_trace=rank == 0)  # fmt: skip
                result["profile"] = summary.to_dict()
            if args.phases and hasattr(arm.step, "forward"):  # a TrainStep (DeepSpeed's is not)
                result["phases"] = time_phases(arm.step, batches, steps=args.steps,
                                               device=ctx.device, cprofile=args.phases == "cprofile")  # fmt: skip
        except ArmUnavailable as e:  # recorded as skipped, with the reason
            logger.warning("arm %s skipped: %s", spec.name, e)
            state["error"] = f"skipped: {e}"
        except Exception as e:  # recorded in the table; the run goes on
            logger.exception("arm %s (%s) failed on rank %d", spec.name, regime, rank)
            state["error"] = f"{type(e).__name__}: {e}"
        # One gloo collective that every rank reaches, whatever happened in its arm; a rank
        # stuck in the arm's collectives never does, and the watchdog ends the run.
        outcomes: list = [None] * world
        try:
            outcomes = gather_json([state["error"], result], ctrl)
        except Exception as e:  # noqa: BLE001 - another rank died: nothing to agree with
            own = f"{state['error']}; then " if state["error"] else ""
            abort(args.out, record, f"{own}lost the other ranks: {type(e).__name__}: {e}", 1)
    close_arm(arm)
    arm = None
    free_memory(ctx.device)

    failed: dict[str, list[int]] = {}
    for r, (err, _) in enumerate(outcomes):
        if err is not None:
            failed.setdefault(report.clip(err, 1000, 1000), []).append(r)
    if failed:
        errors = [f"rank {','.join(map(str, ranks))}: {err}" for err, ranks in failed.items()]
        return {**record, "status": "error", "error": "; ".join(errors)}
    results = [res for _, res in outcomes]
    main = results[0]
    losses = [sum(r["losses"][i] for r in results) / world for i in range(len(main["losses"]))]
    n_check = args.warmup + args.steps
    step_ms = max(r["step_ms"] for r in results)
    peaks = [r["peak_mem_gib"] for r in results if r["peak_mem_gib"] is not None]
    reserved = [r["peak_reserved_gib"] for r in results if r["peak_reserved_gib"] is not None]

    def most(key: str) -> float | None:  # host memory: the rank that used the most
        values = [r[key] for r in results if r.get(key) is not None]
        return max(values) if values else None

    return {
        **record,
        "status": "ok",
        "error": None,
        "warmup_arm": warmup,
        # The ranks wait for each other: take the slowest.
        "step_ms": step_ms,
        "step_ms_all": main["step_ms_all"],
        "host_ms": main["host_ms"],
        "first_step_s": max(r["first_step_s"] for r in results),
        "peak_mem_gib": max(peaks) if peaks else None,
        "peak_reserved_gib": max(reserved) if reserved else None,
        "host_peak_gib": most("host_peak_gib"),
        "host_base_gib": most("host_base_gib"),
        "pinned_peak_gib": most("pinned_peak_gib"),
        "host_peak_is_arm": all(r.get("host_peak_is_arm") for r in results),
        "losses": losses,
        "loss_first": losses[0],
        "loss_at_n": losses[n_check - 1],
        "note": main["note"],
        "profile": main.get("profile"),
        "phases": main.get("phases"),
        **derived(
            step_ms,
            batch=ctx.batch,
            seq_len=ctx.seq_len,
            flops_per_token=ctx.cfg.flops_per_token(ctx.seq_len),
        ),
    }


def floor_depths(floor_layers: int) -> tuple[int, int]:
    """The two depths ``--floor-layers N`` measures the floor at: N // 2 and N blocks."""
    return floor_layers // 2, floor_layers


def scale_floor(low: dict, high: dict, *, full_layers: int, flops_per_token: int) -> dict:
    """The floor's record at ``full_layers`` blocks from its records at two smaller depths.

    Step time (and host time) is taken as a line in the depth through the two measurements:
    ``t(L) = t(N) + (L - N) * (t(N) - t(N0)) / (N - N0)``; the slope is one block, the rest
    (embedding, output, loss, their optimizer step) is counted once. Peak memory, first step
    and losses stay the N-block model's; ``floor_scaled`` keeps what was measured.
    """
    n0, n = low["layers"], high["layers"]
    label = f"{high['label']}, scaled from {n0} and {n} layers"
    for r in (low, high):
        if r["status"] != "ok":
            return {**r, "label": label, "error": f"at {r['layers']} layers: {r['error']}"}

    def line(key: str) -> float:
        return high[key] + (full_layers - n) * (high[key] - low[key]) / (n - n0)

    step_ms = line("step_ms")
    scaled = {
        "full_layers": full_layers,
        "layers": [n0, n],
        "rule": "t(L) = t(N) + (L - N) * (t(N) - t(N0)) / (N - N0)",
        **{key: [low[key], high[key]] for key in
           ("step_ms", "step_ms_all", "host_ms", "peak_mem_gib", "first_step_s")},
    }  # fmt: skip
    record = {**high, "label": label, "step_ms": step_ms, "step_ms_all": [],
              "host_ms": line("host_ms"), "floor_scaled": scaled}  # fmt: skip
    del record["layers"]
    return {
        **record,
        **derived(step_ms, batch=high["batch"], seq_len=high["seq_len"],
                  flops_per_token=flops_per_token),
    }  # fmt: skip


def run_floor_scaled(
    spec: ArmSpec, ctx: ArmContext, regime: str, args, batches, ctrl, base: dict
) -> dict:
    """``--floor-layers``: the floor arm at two smaller depths, scaled to the model's."""
    records = []
    for n in floor_depths(args.floor_layers):
        sub = replace(ctx, cfg=replace(ctx.cfg, n_layers=n))
        if dist.get_rank() == 0:
            logger.info("   %s at %d of %d layers", spec.name, n, ctx.cfg.n_layers)
        records.append({**run_arm(spec, sub, regime, args, batches, ctrl, base), "layers": n})
    return scale_floor(
        *records,
        full_layers=ctx.cfg.n_layers,
        flops_per_token=ctx.cfg.flops_per_token(ctx.seq_len),
    )


def close_arm(arm) -> None:
    try:
        if arm is not None and arm.close is not None:
            arm.close()
    except Exception:  # the results are in; a failing close only gets logged
        logger.exception("closing the arm failed")


def free_memory(device: torch.device) -> None:
    """After the last reference to an arm is gone: drop compiled code, cached blocks, the peak."""
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        empty_host_cache()  # the next arm's host peak starts without this arm's pinned blocks


def _write(out: Path, record: dict) -> None:
    """Rank 0: add the record (annotated against the records before it) and redraw the reports."""
    records = report.read_records(out)
    records = [r for r in records if (r["regime"], r["arm"]) != (record["regime"], record["arm"])]
    report.annotate([*records, record])
    report.append_record(out, record)
    report.write_reports(out, draw_chart=False)  # the chart once, at the end


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
    timeout = datetime.timedelta(seconds=args.arm_timeout + 60)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    ctrl = dist.new_group(backend="gloo", timeout=timeout)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    arms = select_arms(args.arms, args.skip, as_given=args.arms_as_given)
    if not use_cuda:
        skipped = [a.name for a in arms if a.needs_cuda]
        arms = [a for a in arms if not a.needs_cuda]
        if skipped and rank == 0:
            logger.info("left out on the CPU (CUDA graphs need a GPU): %s", skipped)
    plan = regimes(args)
    cfg = LlamaConfig(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
        n_kv_heads=args.kv_heads, ffn_dim=args.ffn, tie_embeddings=bool(args.tie),
        checkpointing=args.checkpointing, max_seq_len=max(seq for _, seq in plan.values()),
    )  # fmt: skip
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        if args.fresh:
            for name in (report.RESULTS, report.TABLE, report.CHART):
                (args.out / name).unlink(missing_ok=True)
        logger.info(
            "arms %s; regimes %s; %d ranks on %s", [a.name for a in arms], plan, world, device
        )
    run_id = gather_json(
        datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + str(os.getpid()), ctrl
    )
    base = {
        "run_id": run_id[0], "world_size": world, "steps": args.steps, "warmup": args.warmup, "lr": args.lr,
        "seed": args.seed, "n_check": args.warmup + args.steps, "loss_rtol": args.loss_rtol,
        "data_batches": args.data_batches, "meta": _meta(args, cfg, device, world),
    }  # fmt: skip
    # Arm by arm (each over the regimes): the DeepSpeed arms, which patch torch, come last.
    for order, spec in enumerate(arms):
        for regime, (batch, seq) in plan.items():
            ctx = ArmContext(cfg=cfg, mesh=mesh, device=device, batch=batch, seq_len=seq,
                             seed=args.seed, lr=args.lr, compile_backend=args.compile_backend,
                             hf=args.hf)  # fmt: skip
            batches = make_batches(args, cfg, batch, seq, device)
            if rank == 0:
                logger.info("== %s, regime %s (%d x %d per rank)", spec.name, regime, batch, seq)
            run = run_floor_scaled if args.floor_layers and not spec.communicates else run_arm
            record = run(spec, ctx, regime, args, batches, ctrl, {**base, "order": order})
            del batches
            if rank == 0:
                _write(args.out, record)
                logger.info("%s", _one_line(record))
    dist.barrier(group=ctrl)
    if rank == 0:
        print(report.write_reports(args.out))
        logger.info("results in %s", args.out)
    dist.destroy_process_group()
    return 0


def _one_line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['arm']} {r['regime']}: FAILED {r['error']}"
    ratio = r.get("ratio_to_floor")
    return (
        f"{r['arm']} {r['regime']}: {r['step_ms']:.1f} ms/step"
        + (f" ({ratio:.2f}x floor)" if ratio else "")
        + (f", peak {r['peak_mem_gib']:.2f} GiB" if r["peak_mem_gib"] is not None else "")
        + f", first step {r['first_step_s']:.1f} s, "
        f"loss {r['loss_first']:.4f} -> {r['loss_at_n']:.4f}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return relaunch(args, argv)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
