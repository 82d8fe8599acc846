"""First-step (compile) time by depth: the plain model and fczero, split into their parts.

    python -m bench.compile_time --layers 8 16 32 64 --out out/compile_time     # CPU, fake group
    python -m bench.compile_time --layers 1 2 --backend aot_eager --out /tmp/ct  # a quick look
    torchrun --standalone --nproc-per-node 2 -m bench.compile_time --device cuda \\
        --layers 16 28 --warm --out out/compile_time                          # 2 GPUs, NCCL

For each depth (``--layers``) it builds the benchmark's Llama (``bench.arms.build_model``;
on the CPU the smoke run's tiny width, ``bench.run.SMOKE``, as Hugging Face's model with
its checkpointing for an ``hf-`` preset; on a GPU ``--model``'s preset from
``bench.run.MODELS``) and times the first training step (forward, backward,
AdamW step; compilation included) of four arms of ``bench.arms``:

| arm | what compiles |
| --- | --- |
| floor | the plain model (bf16 autocast, no comm), ``torch.compile`` of the whole |
| floor-per-block | the same, each block ``block.compile()``'d, the rest eager |
| fczero-compiled | ``fczero.parallelize(model, mesh)`` (bf16 params), ``torch.compile`` of the whole |
| fczero-per-block | the same, each block compiled by ``fczero.compile_blocks`` (its gathers eager, prefetched), the rest eager |

Each first step is split into parts, from torch's own compile-time accounting
(``torch._dynamo.utils.calculate_time_spent``: the seconds each ``dynamo_timed`` phase took
in this process, summed over every frame and graph) and from ``fczero.passes.timing``:

- ``dynamo``: Dynamo's bytecode tracing and guards (``entire_frame_compile`` less
  ``backend_compile``);
- ``aot``: AOT autograd: the joint graph, functionalization, the partition, and the
  backward compiled at the first backward (``backend_compile`` plus
  ``entire_backward_compile``, less the Inductor parts); with a non-Inductor backend
  (``--backend aot_eager...``) fczero's passes, where they run, are taken out of it;
- ``inductor``: Inductor's graph passes and code generation, C++/Triton compiles included
  (``inductor_compile`` plus the pre-grad and joint-graph passes), less fczero's passes;
- ``passes``: fczero's graph passes (``run_passes``, forward and backward graphs);
- ``rest``: the first step less those parts: running it, and whatever compiling the
  accounting leaves out.

``later step`` is the second step's time (nothing left to compile), ``graphs`` the graphs
Dynamo compiled (``torch._dynamo.utils.counters``), ``cache`` the hits, misses and bypasses
of AOT autograd's cache and of Inductor's FX graph cache in the first step, with torch's
reason for each bypass (``cache_bypass_reasons``). ``--cache-details`` also saves the parts
each cache key was made from (``child_....keys.txt``) and logs those of a warm run that the
cold run did not have: what changed between the processes when a restart missed. For a
finer look at one run, set ``TORCH_TRACE=DIR`` and open it with ``tlparse``.

Cold caches: every measurement is a process of its own (so no import, compile worker pool
or in-memory cache of an earlier one helps) with an empty ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` (Inductor's FX graph cache, AOT autograd's cache and Triton's kernels
start empty). ``--warm`` then runs a second process on the same cache folders: what a job
restarted from a checkpoint sees. (Where AOT autograd's cache has the graphs, loading
them counts as ``aot``, with ``inductor`` and ``passes`` at 0.) A row times the step only: the whole process (imports
included) is ``process_s`` in the JSON lines, joining the group and building the arm
``build_s``.

On the CPU one process joins a fake process group of ``--world`` ranks (collectives return
at once) and compiles with stock Inductor (or ``--backend``). On GPUs, under torchrun,
each rank's process starts each measurement's process, which joins an NCCL group through
torchrun's store (a fresh key prefix each time). Rank 0 writes, in ``--out``:

- ``compile_time.jsonl``: one JSON object per depth, arm and cache state (every rank's
  numbers under ``ranks``; the top-level ones are rank 0's; rewritten by each run);
- ``compile_time.md``: the table (depth x arm);
- ``compile_time.png``: first step against depth, per arm (only where matplotlib imports);
- ``child_<arm>_<layers>_<caches>_rank<r>.log`` (every rank): each measurement's own output,
  which says when it was built and when its first step ended, so a process that a time
  limit cut off still tells how far it got.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.arms import ARMS, ArmContext
from bench.plotting import pyplot
from bench.run import MODELS, REGIMES, SMOKE
from fczero.models.llama import LlamaConfig
from fczero.passes import timing

logger = logging.getLogger("fczero.bench")

REPO = Path(__file__).resolve().parents[1]
RESULTS, TABLE, CHART = "compile_time.jsonl", "compile_time.md", "compile_time.png"
DEFAULT_ARMS = ("floor", "floor-per-block", "fczero-compiled", "fczero-per-block")
PARTS = ("dynamo", "aot", "inductor", "passes")
"""The parts of a first step, in the table's order (each ``<part>_s`` in a record)."""
TEST_BACKENDS = ("aot_eager_with_passes",)
"""``--backend`` names that are fczero's test backends (``fczero.testing.backends``)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.compile_time", description=__doc__.split("\n")[0]
    )
    a = p.add_argument
    a("--layers", type=int, nargs="+", default=[8, 16, 32, 64], help="depths (default 8 16 32 64)")
    a(
        "--arms",
        default=",".join(DEFAULT_ARMS),
        help=f"comma-separated arms of bench.arms (default {','.join(DEFAULT_ARMS)})",
    )
    a("--out", type=Path, default=Path("out/compile_time"), help="output folder")
    a(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu (fake process group, or gloo under torchrun) or cuda (under torchrun, NCCL)",
    )
    a(
        "--backend",
        default="inductor",
        help="torch.compile backend: inductor (default), aot_eager, aot_eager_with_passes, eager",
    )
    a(
        "--warm",
        action="store_true",
        help="also time a second process on the same (now warm) compile caches",
    )
    a(
        "--model",
        choices=sorted(MODELS),
        default="bench",
        help="GPU size preset of bench.run (default bench); on the CPU the smoke run's tiny one",
    )
    a("--dim", type=int, help="model width (default: the preset's)")
    a("--heads", type=int)
    a("--kv-heads", type=int)
    a("--ffn", type=int)
    a("--vocab", type=int)
    a("--checkpointing", choices=["none", "full", "selective"])
    a("--batch", type=int, help="sequences per rank (default: 2 on the CPU, the regime's on GPUs)")
    a("--seq", type=int, help="sequence length (default: 32 on the CPU, the regime's on GPUs)")
    a("--world", type=int, default=2, help="fake ranks on the CPU outside torchrun (default 2)")
    a("--seed", type=int, default=0)
    a("--timeout", type=float, default=3600.0, help="seconds one measurement may take")
    a(
        "--cache-details",
        action="store_true",
        help="write the parts of every compile-cache key beside each measurement's log "
        "(child_....keys.txt): diff a warm run's against the cold run's to see why it missed",
    )
    a("--child", help=argparse.SUPPRESS)  # one measurement, in a process of its own (JSON)
    args = p.parse_args(argv)
    if args.child is None:
        unknown = [a for a in arm_names(args) if a not in ARMS]
        if unknown:
            p.error(f"unknown arms {unknown}; see bench/arms.py ARMS")
        if min(args.layers) < 1:
            p.error("--layers must be at least 1")
    return args


def arm_names(args: argparse.Namespace) -> list[str]:
    return [name.strip() for name in args.arms.split(",") if name.strip()]


def model_config(args: argparse.Namespace, layers: int) -> tuple[LlamaConfig, int, int]:
    """The Llama of one depth, and (batch, seq) per rank."""
    if args.device == "cpu":  # the smoke run's width; a Hugging Face preset keeps its kind
        hf = bool(MODELS[args.model].get("hf"))
        base = {"dim": SMOKE["dim"], "heads": SMOKE["heads"], "kv_heads": None,
                "ffn": SMOKE["ffn"], "vocab": SMOKE["vocab"],
                "checkpointing": MODELS[args.model]["checkpointing"] if hf else "none"}  # fmt: skip
        batch, seq = int(SMOKE["batch"]), int(SMOKE["seq"])  # type: ignore[call-overload]
        tie = hf and bool(MODELS[args.model]["tie"])
    else:
        base = dict(MODELS[args.model])
        batch, seq = REGIMES["R" if args.model in ("llama3-3b", "hf-llama3-3b") else "M"]
        tie = bool(base["tie"])
    size = {k: getattr(args, k) if getattr(args, k) is not None else base[k] for k in
            ("dim", "heads", "kv_heads", "ffn", "vocab", "checkpointing")}  # fmt: skip
    batch, seq = args.batch or batch, args.seq or seq
    cfg = LlamaConfig(
        vocab_size=size["vocab"], dim=size["dim"], n_layers=layers, n_heads=size["heads"],
        n_kv_heads=size["kv_heads"], ffn_dim=size["ffn"], tie_embeddings=tie,
        checkpointing=size["checkpointing"], max_seq_len=max(seq, 2048),
    )  # fmt: skip
    return cfg, batch, seq


# ---- the parts of a first step ----------------------------------------------------------


def compile_parts(passes: timing.PassTime) -> dict[str, float]:
    """This process's compile time so far, in seconds per part (see the module docstring);
    ``passes``: fczero's pass time over the same span."""
    spent = torch._dynamo.utils.calculate_time_spent()
    frames = spent.get("entire_frame_compile", 0.0)
    backend = spent.get("backend_compile", 0.0) + spent.get("entire_backward_compile", 0.0)
    inductor = spent.get("inductor_compile", 0.0)
    if inductor > 0.0:  # Inductor's passes before and inside AOT's trace are Inductor's too
        inductor += spent.get("_recursive_pre_grad_passes", 0.0)
        inductor += spent.get("_recursive_joint_graph_passes", 0.0)
    aot = backend - inductor
    if inductor > 0.0:  # fczero's passes run in Inductor's post-grad hook
        inductor -= passes.seconds
    else:  # or in a test backend's graph compiler, inside AOT's compile
        aot -= passes.seconds
    return {
        "dynamo": max(frames - spent.get("backend_compile", 0.0), 0.0),
        "aot": max(aot, 0.0),
        "inductor": max(inductor, 0.0),
        "passes": passes.seconds,
    }


def compile_counts() -> dict[str, int]:
    """Graphs and frames Dynamo compiled in this process, its graph breaks, and what the
    two compile caches did (``cache``: AOT autograd's and Inductor's FX graph cache hits,
    misses and bypasses)."""
    counters = torch._dynamo.utils.counters
    cache = {
        f"{short}_{what}": int(counters[group][f"{key}_{what}"])
        for short, group, key in (
            ("aot", "aot_autograd", "autograd_cache"), ("fx", "inductor", "fxgraph_cache")
        )
        for what in ("hit", "miss", "bypass")
    }  # fmt: skip
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "frames": int(counters["frames"]["ok"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "pass_graphs": timing.total().graphs,
        "cache": cache,
    }


class _CacheLog(logging.Handler):
    """What the compile caches said while it is entered: why one refused a graph (torch
    logs it at INFO), and with ``details`` the parts each cache key was made from (at
    DEBUG), to compare a warm restart's keys with the cold run's."""

    LOGGERS = ("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.codecache")
    DETAILS = ("FX graph cache hash details", "Autograd graph cache hash details")

    def __init__(self, details: bool) -> None:
        super().__init__(logging.DEBUG if details else logging.INFO)
        self.reasons: list[str] = []
        self.details: list[str] = []
        self._levels: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Bypass"):
            self.reasons.append(message[:300])
        elif message.startswith(self.DETAILS):
            self.details.append(message)

    def __enter__(self) -> _CacheLog:
        for name in self.LOGGERS:
            log = logging.getLogger(name)
            log.addHandler(self)
            self._levels[name] = log.level
            if not log.isEnabledFor(self.level):
                log.setLevel(self.level)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            log = logging.getLogger(name)
            log.removeHandler(self)
            log.setLevel(self._levels[name])


# ---- one measurement, in a process of its own ---------------------------------------------


def measure(spec: dict) -> dict:
    """Build one arm at one depth, time its first two steps; what this rank saw."""
    device = torch.device(spec["device"])
    cfg = LlamaConfig(**spec["cfg"])
    start = time.perf_counter()
    ctx = ArmContext(
        cfg=cfg, mesh=_mesh(spec, device), device=device, batch=spec["batch"],
        seq_len=spec["seq"], seed=spec["seed"], compile_backend=_backend(spec["backend"]),
        hf=spec.get("hf", False),
    )  # fmt: skip
    arm = ARMS[spec["arm"]].build(ctx)
    gen = torch.Generator().manual_seed(spec["seed"] + 1 + spec["rank"])
    tokens = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"] + 1), generator=gen)
    tokens = tokens.to(device)
    _sync(device, spec)
    build_s = time.perf_counter() - start
    logger.info("built in %.1f s; first step (compiling) starts", build_s)
    passes_before = timing.total()
    with _CacheLog(details=bool(spec.get("keys_file"))) as cache_log:
        first_s = _timed_step(arm.step, tokens, device)
    if spec.get("keys_file"):
        Path(spec["keys_file"]).write_text("\n\n".join(cache_log.details) + "\n")
    logger.info("first step done in %.1f s", first_s)
    parts = compile_parts(timing.total() - passes_before)
    counts = compile_counts()
    later_s = _timed_step(arm.step, tokens, device)
    parts_sum = sum(parts.values())
    return {
        "rank": spec["rank"], "build_s": build_s, "first_step_s": first_s,
        **{f"{k}_s": v for k, v in parts.items()}, "rest_s": first_s - parts_sum,
        "later_step_s": later_s, **counts,
        "graph_break_reasons": sorted(torch._dynamo.utils.counters["graph_break"]),
        "cache_bypass_reasons": sorted(set(cache_log.reasons)),
    }  # fmt: skip


def _backend(name: str) -> object:
    if name in TEST_BACKENDS:  # a callable: ArmContext hands it to torch.compile as it is
        from fczero.testing.backends import BACKENDS

        return BACKENDS[name]
    return name


def _mesh(spec: dict, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    timeout = datetime.timedelta(seconds=spec["timeout"])
    if spec["fake"]:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=spec["world"])
    else:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=_store(spec), rank=spec["rank"],
            world_size=spec["world"], timeout=timeout,
        )  # fmt: skip
    return init_device_mesh(device.type, (spec["world"],))


def _store(spec: dict) -> dist.Store:
    """torchrun's store, under this measurement's own prefix (its ranks meet there)."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=datetime.timedelta(seconds=spec["timeout"]),
    )  # fmt: skip
    return dist.PrefixStore(spec["prefix"], store)


def _sync(device: torch.device, spec: dict) -> None:
    if not spec["fake"]:
        dist.barrier()  # the ranks start together (NCCL's communicators are made here)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(step, tokens: torch.Tensor, device: torch.device) -> float:
    start = time.perf_counter()
    step(tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def child(args: argparse.Namespace) -> int:
    """``--child``: one measurement; writes every rank's record (rank 0) to ``spec["result"]``."""
    spec = json.loads(args.child)
    if spec["device"] == "cuda":
        spec["device"] = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    record = measure(spec)
    if spec["fake"]:
        ranks = [record]
    else:  # every rank's record through the store: no collective, no numpy
        store = _store(spec)
        store.set(f"result/{spec['rank']}", json.dumps(record))
        ranks = [json.loads(store.get(f"result/{r}")) for r in range(spec["world"])]
        dist.barrier()
    if spec["rank"] == 0:
        Path(spec["result"]).write_text(json.dumps(ranks))
    dist.destroy_process_group()
    return 0


# ---- the sweep ------------------------------------------------------------------------------


def sweep(args: argparse.Namespace) -> list[dict]:
    """Every depth, arm and cache state, one process each; rank 0 returns the records."""
    torchrun = "WORLD_SIZE" in os.environ and "MASTER_PORT" in os.environ
    if args.device == "cuda" and not torchrun:
        raise SystemExit(
            "--device cuda runs under torchrun: torchrun --standalone --nproc-per-node 2 "
            "-m bench.compile_time --device cuda ..."
        )
    rank = int(os.environ.get("RANK", "0")) if torchrun else 0
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.world
    records: list[dict] = []
    index = 0
    for layers in args.layers:
        cfg, batch, seq = model_config(args, layers)
        for arm in arm_names(args):
            cache = Path(tempfile.mkdtemp(prefix=f"fczero-compile-time-rank{rank}-"))
            try:
                for caches in ("cold", "warm") if args.warm else ("cold",):
                    spec = {
                        "arm": arm, "device": args.device, "backend": args.backend,
                        "cfg": dataclasses.asdict(cfg), "batch": batch, "seq": seq,
                        "seed": args.seed, "rank": rank, "world": world, "fake": not torchrun,
                        "hf": bool(MODELS[args.model].get("hf")),
                        "timeout": args.timeout, "prefix": f"compile_time/{index}/",
                        "result": str(cache / "result.json"),
                    }  # fmt: skip
                    index += 1
                    log = args.out / f"child_{arm}_{layers}_{caches}_rank{rank}.log"
                    if args.cache_details:
                        spec["keys_file"] = str(log.with_suffix(".keys.txt"))
                    record = _run_child(spec, cache, args.timeout, log)
                    if args.cache_details and caches == "warm":
                        _say_key_differences(log.with_name(log.name.replace("_warm_", "_cold_")), log)
                    if rank == 0:
                        record.update(
                            layers=layers, arm=arm, caches=caches, params=cfg.num_params(),
                            label=ARMS[arm].label, backend=args.backend, device=args.device,
                            world=world, batch=batch, seq=seq, dim=cfg.dim,
                        )  # fmt: skip
                        records.append(record)
                        _append(args.out, record)
                        logger.info("%s", _one_line(record))
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    return records


def _run_child(spec: dict, cache: Path, timeout: float, log: Path) -> dict:
    """Run one measurement in a process of its own; its output goes to ``log``, which stays
    when the process fails or is cut off (it says how far it got: built, first step done)."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    Path(spec["result"]).unlink(missing_ok=True)
    start = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.compile_time", "--child", json.dumps(spec)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
    process_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"{spec['arm']} at {spec['cfg']['n_layers']} layers failed (exit {proc.returncode}):\n"
            + log.read_text()[-4000:]
        )
    if spec["rank"] != 0:
        return {}
    ranks = json.loads(Path(spec["result"]).read_text())
    return {**ranks[0], "process_s": process_s, "ranks": ranks}


def _say_key_differences(cold_log: Path, warm_log: Path, most: int = 12) -> None:
    """Log the cache-key parts of the warm run that the cold run's keys did not have (the
    reason for a miss), each cut to one short line."""
    def part(line: str) -> str:  # "[hash] name: value": the hash and name decide
        return line.split(":", 1)[0] if line.startswith("[") else line

    cold = {part(line) for line in cold_log.with_suffix(".keys.txt").read_text().splitlines()}
    warm = warm_log.with_suffix(".keys.txt").read_text().splitlines()
    new = [line for line in dict.fromkeys(warm) if part(line) not in cold]
    logger.info("%d cache-key lines of the warm run are not in the cold run's", len(new))
    for line in new[:most]:
        logger.info("  new key part: %s", line[:200])


def _append(out: Path, record: dict) -> None:
    with open(out / RESULTS, "a") as f:
        f.write(json.dumps(record) + "\n")


def _one_line(r: dict) -> str:
    parts = ", ".join(f"{p} {r[f'{p}_s']:.2f}" for p in PARTS)
    return (
        f"{r['arm']}, {r['layers']} layers, {r['caches']}: first step {r['first_step_s']:.2f} s "
        f"({parts}, rest {r['rest_s']:.2f}); later step {r['later_step_s']:.3f} s; "
        f"{r['graphs']} graphs; {_cache_summary(r)}"
    )


def _cache_summary(r: dict) -> str:
    """``AOT 2 hit/0 miss/0 bypass, FX ...`` and the bypass reasons, if any."""
    c = r.get("cache") or {}
    text = ", ".join(
        f"{name} {c.get(f'{key}_hit', 0)} hit/{c.get(f'{key}_miss', 0)} miss/"
        f"{c.get(f'{key}_bypass', 0)} bypass"
        for name, key in (("AOT cache", "aot"), ("FX cache", "fx"))
    )
    reasons = r.get("cache_bypass_reasons") or []
    return text + (f" ({'; '.join(reasons)})" if reasons else "")


# ---- the report -------------------------------------------------------------------------------


def table(records: list[dict]) -> str:
    """The markdown table: one row per depth, arm and cache state, in the order run."""
    head = ["layers", "arm", "caches", "first step s", *(f"{p} s" for p in PARTS),
            "rest s", "later step s", "graphs"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        cells = [str(r["layers"]), r["arm"], r["caches"], f"{r['first_step_s']:.2f}",
                 *(f"{r[f'{p}_s']:.2f}" for p in PARTS), f"{r['rest_s']:.2f}",
                 f"{r['later_step_s']:.3f}", str(r["graphs"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    r = records[0] if records else {}
    about = (
        f"{r.get('device')}, backend {r.get('backend')}, {r.get('world')} ranks, width "
        f"{r.get('dim')}, {r.get('batch')} x {r.get('seq')} tokens per rank; seconds, rank 0"
    )
    return f"# First-step time by depth\n\n{about}\n\n" + "\n".join(lines) + "\n"


def chart(records: list[dict], path: Path) -> bool:
    """First step against depth, per arm (solid cold, dashed warm); False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in dict.fromkeys(r["arm"] for r in records):
        for caches, style in (("cold", "-o"), ("warm", "--o")):
            rows = [r for r in records if r["arm"] == arm and r["caches"] == caches]
            if rows:
                xs, ys = [r["layers"] for r in rows], [r["first_step_s"] for r in rows]
                ax.plot(xs, ys, style, label=f"{arm} ({caches})")
    ax.set_xlabel("layers")
    ax.set_ylabel("first step, s")
    ax.set_title("First-step time by depth")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 or args.child is not None else logging.WARNING,
        format=f"[rank{rank} %(asctime)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    if args.child is not None:  # (its log goes to a file of the sweep: ``_run_child``)
        return child(args)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / RESULTS).unlink(missing_ok=True)
    records = sweep(args)
    if rank == 0:
        text = table(records)
        (args.out / TABLE).write_text(text)
        chart(records, args.out / CHART)
        print(text)
        logger.info("results in %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
