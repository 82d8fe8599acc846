"""Host cost on the CPU: what fczero adds to a step's Python and dispatch time.

    python -m bench.host_cost                                  # 2, 4, 8, 16 blocks, Inductor
    python -m bench.host_cost --layers 2 --backend aot_eager   # a quick run
    python -m bench.host_cost --layers 16 --arms plain-eager,fczero-eager,fsdp2-eager
    python -m bench.host_cost --layers 16 --device cuda        # the same toy on one GPU
    python -m bench.host_cost --layers 16 --rounds 7           # arms interleaved: a noisy host

One process joins a fake process group (``world`` ranks, default 2) whose collectives
return at once, so nothing is communicated and nothing waits: the model is tiny (width
32), so its kernels cost next to nothing and a step's time is host work. For each size
it times the plain model and fczero's, eager and compiled, phase by phase
(``bench.phases``), and reports each fczero arm's host time over the plain model's in
the same mode (``fsdp2-eager``, when asked for, is compared with plain eager too). The
sweep over blocks shows the cost per parameter and per collective:
each block adds 9 params and, compiled, one bucket of collectives. With ``--device cuda``
the toy runs on one GPU (still the fake group, so 2+ ranks' copy-in and copy-out run
with nothing communicated): its kernels are real launches, and each phase also reports
GPU time.

With ``--rounds R`` (R > 1) every arm of a size is built and warmed first, then timed in
R rounds of ``--steps`` steps, the arms taking turns within each round; each phase is
the median over the rounds' medians. A burst of load from elsewhere then slows every arm
of the round alike instead of one arm: on a 2-core machine, 16 blocks, the arms one
after the other gave 0.97x to 2.12x of plain in five runs of two trees, interleaved (7
rounds of 20 steps) 1.57x to 1.72x over four (docs/benchmarks.md, earlier results). The plain arms then
step with fczero's global optimizer hooks installed (about 30 us a step at 115 params).

``--threads`` (default 1) sets torch's intra-op threads for the run. The toy's kernels are
far too small to gain from a second thread, and on a 2-core machine a parallel region
waits for whichever core is busy elsewhere: on a 2-core VM (16 blocks, 2026-11-26) the
plain compiled arm took 5.3 to 9.0 ms a step over three runs with 2 threads, 3.8 to 4.9
ms over four with one. One thread also makes the comparison stricter: the plain arm,
whose step is mostly kernels, gains more from it than fczero's does (1.54-1.71x with 2
threads, 1.69-1.78x with one, in those runs).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from bench.arms import LossModule, TrainStep
from bench.phases import time_phases
from bench.report import PHASES
from fczero.models.llama import Llama, LlamaConfig

logger = logging.getLogger("fczero.bench")

ARMS = (
    "plain-eager", "plain-compiled", "fczero-eager", "fczero-compiled", "fsdp2-eager",
    "fczero-eager-per-read", "plain-blocks", "fczero-blocks", "fsdp2-blocks",
)  # fmt: skip
"""Every arm, in the order they run; ``fczero-X`` and ``fsdp2-X`` are compared with
``plain-X``. ``fsdp2-eager`` (FSDP2's ``fully_shard`` on each block and the root) is not in
the default sweep: ``--arms`` names it. ``fczero-eager-per-read``: ``units=None`` (each read
gathers), against plain eager; ``X-blocks``: each block compiled on its own
(``block.compile()``), the rest eager."""

DEFAULT_ARMS = ARMS[:4]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.host_cost", description=__doc__.split("\n")[0]
    )
    p.add_argument("--layers", default="2,4,8,16", help="decoder blocks to sweep (comma-separated)")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"from {', '.join(ARMS)}")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--world", type=int, default=2, help="ranks of the fake process group")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the toy runs")
    p.add_argument("--steps", type=int, default=30, help="timed steps per arm (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiling)")
    p.add_argument("--rounds", type=int, default=1, help="interleave the arms over R rounds")
    p.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (default 1; 0: leave torch's)"
    )
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help="fczero's bucket_bytes (default its own; 41216 puts one toy block in a "
                   "bucket whether or not units are on)")  # fmt: skip
    p.add_argument("--out", type=Path, help="write results.jsonl and results.md here")
    args = p.parse_args(argv)
    args.layers = [int(n) for n in args.layers.split(",") if n.strip()]
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; pick from {', '.join(ARMS)}")
    return args


def build(
    arm: str, layers: int, backend: str, mesh, bucket_bytes: int | None = None
) -> tuple[TrainStep, int]:
    """The arm's step over a fresh tiny Llama of ``layers`` blocks (on the mesh's device
    type), and its param count."""
    import fczero

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=2, ffn_dim=64, max_seq_len=16)
    model = Llama(cfg).to(mesh.device_type)
    root: nn.Module = LossModule(model)
    if arm.startswith("fczero"):
        options: dict = {"units": None} if arm.endswith("per-read") else {}
        if bucket_bytes is not None:
            options["comm_policy"] = fczero.CommPolicy(bucket_bytes=bucket_bytes)
        fczero.parallelize(root, mesh, **options)
    elif arm.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(root, mesh=mesh)
    params = list(root.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    module = torch.compile(root, backend=backend) if arm.endswith("compiled") else root
    if arm.endswith("blocks"):
        for block in model.layers:
            block.compile(backend=backend)
    return TrainStep(module, opt), len(params)


def run(args: argparse.Namespace) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    try:
        return _sweep(args, init_device_mesh(args.device, (args.world,)))
    finally:
        torch._dynamo.reset()
        torch.set_num_threads(threads)
        if own_group:
            dist.destroy_process_group()


def _sweep(args: argparse.Namespace, mesh) -> list[dict]:
    device = torch.device(args.device)
    batches = [torch.randint(0, 64, (1, 17), device=device)]
    done: dict[int, dict] = {}  # by position in the order asked for
    # every plain arm first: the first parallelize installs fczero's optimizer step hooks
    # for the whole process, and a plain optimizer's step would then pay for them too;
    # the table keeps the order asked for
    runs = list(enumerate((n, a) for n in args.layers for a in args.arms))
    runs.sort(key=lambda run: not run[1][1].startswith("plain"))
    if args.rounds > 1:  # each size's arms alive together, timed in turns
        for layers in args.layers:
            _time_in_rounds(args, mesh, batches, [r for r in runs if r[1][0] == layers], done)
    else:
        for order, (layers, arm) in runs:
            torch._dynamo.reset()
            step, n_params = _warm(arm, layers, args, mesh, batches)
            phases = time_phases(step, batches, steps=args.steps, device=device)
            done[order] = _record(arm, layers, n_params, args, phases)
    records = [done[i] for i in sorted(done)]
    for r in records:
        plain = "plain-" + r["arm"].split("-")[1]
        base = next((b for b in records if b["layers"] == r["layers"] and b["arm"] == plain), None)
        r["x_plain"] = r["host_ms"] / base["host_ms"] if base and r["arm"] != plain else None
    return records


def _warm(arm: str, layers: int, args: argparse.Namespace, mesh, batches) -> tuple[TrainStep, int]:
    step, n_params = build(arm, layers, args.backend, mesh, args.bucket_bytes)
    for _ in range(args.warmup):
        step(batches[0])
    return step, n_params


def _time_in_rounds(args, mesh, batches, runs: list, done: dict[int, dict]) -> None:
    """``--rounds``: the arms of one size, built and warmed, then timed in turns; each
    phase's numbers are the medians of the rounds' medians."""
    device = torch.device(args.device)
    torch._dynamo.reset()
    built = {order: _warm(arm, layers, args, mesh, batches) for order, (layers, arm) in runs}
    rounds: dict[int, list[dict]] = {order: [] for order in built}
    for _ in range(args.rounds):
        for order, (step, _) in built.items():
            rounds[order].append(time_phases(step, batches, steps=args.steps, device=device))
    for order, (layers, arm) in runs:
        phases = {p: _median_of(rounds[order], p) for p in PHASES}
        done[order] = _record(arm, layers, built[order][1], args, phases)


def _median_of(rounds: list[dict], phase: str) -> dict[str, float]:
    """One phase's host (and GPU) ms: the median of its per-round medians."""
    keys = rounds[0][phase]
    return {key: statistics.median(r[phase][key] for r in rounds) for key in keys}


def _record(arm: str, layers: int, n_params: int, args: argparse.Namespace, phases: dict) -> dict:
    total = sum(phases[p]["host_ms"] for p in PHASES)
    logger.info("%s, %d blocks: %.2f host ms/step", arm, layers, total)
    return {"arm": arm, "layers": layers, "params": n_params, "backend": args.backend,
            "device": args.device, "rounds": args.rounds, "host_ms": total,
            **{p: phases[p]["host_ms"] for p in PHASES},
            **{f"{p}_gpu": phases[p].get("gpu_ms") for p in PHASES}}  # fmt: skip


def per_param_ms(records: list[dict], arm: str) -> float | None:
    """Host ms each extra param adds (slope between the smallest and largest size)."""
    rows = sorted((r for r in records if r["arm"] == arm), key=lambda r: r["params"])
    if len(rows) < 2 or rows[-1]["params"] == rows[0]["params"]:
        return None
    return (rows[-1]["host_ms"] - rows[0]["host_ms"]) / (rows[-1]["params"] - rows[0]["params"])


def markdown(records: list[dict]) -> str:
    gpu = any(r.get("device") == "cuda" for r in records)
    head = ["blocks", "params", "arm", *(f"{p} ms" for p in PHASES), "host ms/step", "x plain"]
    head += ["GPU ms/step"] if gpu else []
    lines = ["| " + " | ".join(head) + " |", "| ---: | ---: | --- |" + " ---: |" * (len(head) - 3)]
    for r in records:
        ratio = f"{r['x_plain']:.2f}" if r["x_plain"] is not None else "-"
        cells = [str(r["layers"]), str(r["params"]), r["arm"], *(f"{r[p]:.2f}" for p in PHASES),
                 f"{r['host_ms']:.2f}", ratio]  # fmt: skip
        if gpu:
            cells.append(f"{sum(r[f'{p}_gpu'] for p in PHASES):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    slopes = [(a, per_param_ms(records, a)) for a in dict.fromkeys(r["arm"] for r in records)]
    lines += ["", "Host ms per param (slope over the sweep): "
              + ", ".join(f"{a} {s * 1e3:.1f} us" for a, s in slopes if s is not None)]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    records = run(args)
    text = markdown(records)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (args.out / "results.md").write_text(
            f"# Host cost, torch {torch.__version__}, backend {args.backend},"
            f" {args.threads or torch.get_num_threads()} intra-op thread(s)\n\n{text}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
