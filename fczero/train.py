"""The main job: train a small Llama on the shipped corpus with fczero (ZeRO-3).

    python -m fczero.train                 # 2 local processes, gloo on CPU or NCCL on GPUs
    torchrun --nproc-per-node 4 -m fczero.train --steps 300 --compile
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        -m fczero.train --replicate 2      # HSDP: replicas across the 2 nodes
    fczero-train --param-dtype bf16 --reduce-dtype fp32 --json summary.json

Run without a torchrun environment (no ``RANK`` / ``WORLD_SIZE``), it relaunches
itself on ``--nproc`` local processes through ``torch.distributed.run``; under
torchrun it trains. Each rank builds the same model from ``--seed``, shards it with
``fczero.parallelize``, builds AdamW over the sharded params, and trains on its own
random windows of the corpus (``fczero.data``).

Rank 0 prints a header, a line saying what the numbers are, the first step's line (its
wall time, compilation included), a line every ``--log-every`` steps and a summary;
``LEGEND`` (the end of ``--help``) says exactly what each number is averaged over.

``--save DIR`` writes a checkpoint (``fczero.checkpoint``: model, optimizer, LR
schedule, step) every ``--save-every`` steps and at the end; ``--resume DIR`` loads
one and continues from its step, at any world size, with each rank's data stream
moved past the batches already seen, so that a resumed run at the same world size
reproduces the uninterrupted run's losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fczero
from fczero import checkpoint
from fczero.comm.meshes import check_device_available, cuda_unavailable_reason
from fczero.data import VOCAB_SIZE, WindowSampler, encode, load_corpus
from fczero.models import Llama, LlamaConfig
from fczero.train_report import (
    LEGEND,
    LEGEND_LINE,
    LossMeter,
    StepClock,
    Summary,
    header_line,
    peak_memory,
    steps_label,
    summary_line,
)

__all__ = ["build_parser", "main", "train"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m fczero.train`` / ``fczero-train``."""
    p = argparse.ArgumentParser(
        prog="python -m fczero.train",
        description="Train a small Llama on fczero's shipped corpus with ZeRO-3 sharding.",
        epilog=LEGEND,
    )
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=150, help="optimizer steps (%(default)s)")
    run.add_argument(
        "--batch-size", type=int, default=8, help="sequences per rank per step (%(default)s)"
    )
    run.add_argument(
        "--seq-len", type=int, default=64, help="tokens (bytes) per sequence (%(default)s)"
    )
    run.add_argument(
        "--lr", type=float, default=3e-3, help="peak AdamW learning rate (%(default)s)"
    )
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        help="model seed; rank r samples data with seed + r (%(default)s)",
    )
    run.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cuda: NCCL, one GPU per process; cpu: gloo; auto: cuda when a GPU is "
        "visible (%(default)s)",
    )
    run.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local processes to launch when not under torchrun (ignored under torchrun); "
        "2 on CPU, one per GPU on a GPU machine",
    )
    model = p.add_argument_group("model")
    model.add_argument("--dim", type=int, default=128, help="model width (%(default)s)")
    model.add_argument("--layers", type=int, default=2, help="decoder blocks (%(default)s)")
    model.add_argument(
        "--heads", type=int, default=4, help="attention heads, must divide --dim (%(default)s)"
    )
    sharding = p.add_argument_group("fczero")
    sharding.add_argument("--compile", action="store_true", help="torch.compile(model) (Inductor)")
    sharding.add_argument(
        "--compile-blocks",
        action="store_true",
        help="fczero.compile_blocks(model): each block compiled on its own, the gathers eager "
        "(a first step as short as one block's compile, slower steps than --compile)",
    )
    sharding.add_argument(
        "--compile-backend",
        choices=("inductor", "aot_eager"),
        default="inductor",
        help="backend of --compile or --compile-blocks: inductor, or aot_eager (the same "
        "graphs run without code generation or fczero's Inductor passes; compiles in "
        "seconds) (%(default)s)",
    )
    sharding.add_argument(
        "--param-dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="dtype of the forward (the params' own, fp32)",
    )
    sharding.add_argument(
        "--reduce-dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="dtype of the grad reduce (--param-dtype)",
    )
    sharding.add_argument(
        "--replicate",
        type=int,
        default=1,
        metavar="N",
        help="HSDP: N replicas, each sharding over world/N consecutive ranks (one node under "
        "torchrun --nnodes N); grads are reduce-scattered, then all-reduced (%(default)s)",
    )
    sharding.add_argument(
        "--no-reshard",
        action="store_true",
        help="keep unsharded params from forward to backward (reshard_after_forward=False)",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--log-every",
        type=int,
        default=10,
        metavar="N",
        help="print a line every N steps, with the loss averaged over those N steps and all "
        "ranks (%(default)s)",
    )
    out.add_argument("--json", metavar="PATH", default=None, help="write the summary here (rank 0)")
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument(
        "--save",
        metavar="DIR",
        default=None,
        help="write a checkpoint to DIR at the end (and every --save-every steps); "
        "the previous one there is replaced only once the new one is complete",
    )
    ckpt.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="N",
        help="also checkpoint every N steps (0: only at the end) (%(default)s)",
    )
    ckpt.add_argument(
        "--resume",
        metavar="DIR",
        default=None,
        help="load the checkpoint in DIR and continue from its step (any world size)",
    )
    # Fault injection for the restart test: the last rank SIGKILLs itself after step N.
    ckpt.add_argument("--crash-at-step", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device cuda: {cuda_unavailable_reason()}; use --device cpu (gloo), or run on "
            "a machine with a GPU and a CUDA build of torch"
        )
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if args.device == "cuda" else 2
    for name in (
        "steps",
        "batch_size",
        "seq_len",
        "dim",
        "layers",
        "heads",
        "nproc",
        "log_every",
        "replicate",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.device == "cuda" and args.nproc > torch.cuda.device_count():
        parser.error(
            f"--nproc {args.nproc} is more than the {torch.cuda.device_count()} GPUs "
            "(NCCL takes one GPU per process); lower --nproc, or train on --device cpu"
        )
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    if args.compile and args.compile_blocks:
        parser.error("--compile and --compile-blocks exclude each other: pick the whole model "
                     "(--compile) or each block (--compile-blocks)")  # fmt: skip
    if args.save_every < 0:
        parser.error("--save-every must be >= 0")
    if args.save_every and not args.save:
        parser.error("--save-every needs --save DIR")
    if args.resume and not any(
        os.path.exists(os.path.join(d, ".metadata")) for d in (args.resume, args.resume + ".old")
    ):
        parser.error(f"--resume {args.resume}: no checkpoint there (a --save directory)")
    under_torchrun = all(name in os.environ for name in _TORCHRUN_ENV)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc
    if world % args.replicate:
        parser.error(
            f"--replicate {args.replicate} must divide the number of processes ({world}); "
            "each replica shards over world/N ranks"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point: relaunch on ``--nproc`` processes, or train if torchrun started us."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if all(name in os.environ for name in _TORCHRUN_ENV):
        train(args)
        return 0
    return _launch(args.nproc, argv)


def _launch(nproc: int, argv: list[str]) -> int:
    """Run ``python -m fczero.train argv`` on ``nproc`` local processes via torchrun."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if "OMP_NUM_THREADS" not in os.environ:  # else torchrun sets 1 and warns
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # --standalone: a rendezvous on a free local port, so two jobs on one machine (or a
    # test run in parallel) never meet on torchrun's fixed default port 29500
    launch_args = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(nproc), "--module", "fczero.train"]
    )
    launch_args.training_script_args = list(argv)  # not parsed by torchrun: --nproc is ambiguous
    try:
        run(launch_args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(
            f"fczero.train: rank {rank} failed first (exit code {failure.exitcode}); "
            "its traceback is above.",
            file=sys.stderr,
        )
        return 1
    return 0


def _init_distributed(device_type: str, replicate: int = 1) -> tuple[DeviceMesh, torch.device]:
    """NCCL on this local rank's GPU (``device_type`` "cuda"), else gloo on the CPU. With
    ``replicate`` > 1 the mesh is (replicate, shard): consecutive ranks (a node) shard."""
    check_device_available(device_type)  # before torch.cuda.set_device's own error
    world_size = int(os.environ["WORLD_SIZE"])
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if replicate > 1:
        shape, names = (replicate, world_size // replicate), ("replicate", "shard")
        return init_device_mesh(device.type, shape, mesh_dim_names=names), device
    return init_device_mesh(device.type, (world_size,)), device


def _model_config(args: argparse.Namespace) -> LlamaConfig:
    ffn_dim = 8 * math.ceil(8 * args.dim / 3 / 8)  # SwiGLU's 8/3 * dim, a multiple of 8
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        ffn_dim=ffn_dim,
        max_seq_len=args.seq_len,
    )


def _build_model(args: argparse.Namespace, mesh: DeviceMesh) -> nn.Module:
    """The same Llama on every rank (seeded), then sharded in place by fczero."""
    torch.manual_seed(args.seed)
    model = Llama(_model_config(args))
    return fczero.parallelize(
        model,
        mesh,
        mp_policy=fczero.MixedPrecisionPolicy(
            param_dtype=_DTYPES.get(args.param_dtype), reduce_dtype=_DTYPES.get(args.reduce_dtype)
        ),
        reshard_after_forward=not args.no_reshard,
        **({"axis": "shard", "replicate_axis": "replicate"} if args.replicate > 1 else {}),
    )


def _lr_schedule(steps: int) -> Callable[[int], float]:
    """Linear warmup over the first ~10% of steps (at most 10), cosine decay to 10%."""
    warmup = max(1, min(10, steps // 10))

    def factor(step: int) -> float:  # step counts from 0
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return factor


def _next_token_loss(forward: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]`` (as ``Llama.loss``)."""
    logits = forward(batch[:, :-1])  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args: argparse.Namespace) -> Summary:
    """Train under a torchrun environment; every rank returns the summary, rank 0 prints it.

    [Note: gloo at exit]
    Gloo drops a finished collective's reference to its tensors on its own worker
    thread, after the caller's ``wait`` has returned, and dropping a C++ reference to a
    tensor that has a Python object takes the GIL. ``destroy_process_group`` does not
    join those threads while anything still holds the group (a ``DeviceMesh`` does, and
    DTensor's caches keep the mesh), so a rank that reaches interpreter shutdown right
    after its last collective can have that thread killed inside ``take_gil``:
    "terminate called without an active exception", SIGABRT, exit code -6, about one
    run in four here. So every rank ends with a barrier and a short sleep, both with
    the GIL released, which lets the worker thread finish before shutdown begins.
    """
    start = time.perf_counter()
    mesh, device = _init_distributed(args.device, args.replicate)
    try:
        summary = _train_loop(args, mesh, device, start)
        _drain_collectives()
        return summary
    finally:
        dist.destroy_process_group()


def _drain_collectives() -> None:
    """Let gloo's worker threads release the last collectives: see [Note: gloo at exit]."""
    dist.barrier()
    time.sleep(0.05)


def _train_loop(
    args: argparse.Namespace,
    mesh: DeviceMesh,
    device: torch.device,
    start: float,
) -> Summary:
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    model = _build_model(args, mesh)
    forward = torch.compile(model, backend=args.compile_backend) if args.compile else model
    blocks = []  # the paths --compile-blocks compiles
    if args.compile_blocks:
        blocks = fczero.compile_blocks(model, backend=args.compile_backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_schedule(args.steps))
    sampler = WindowSampler(
        encode(load_corpus()),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        rank=rank,
        device=device,
    )
    start_step = _resume(args, model, optimizer, scheduler, sampler) if args.resume else 0
    n_params = sum(p.numel() for p in model.parameters())  # DTensor numel: the global size
    tokens_per_step = args.batch_size * args.seq_len * world
    if is_main:
        print(header_line(args, n_params, world, dist.get_backend(), device), flush=True)

    losses: list[tuple[int, float]] = []
    meter = LossMeter(device)
    first = start_step + 1
    loss_from = timed_from = first  # first step of the open loss window and tok/s window
    first_step_s = timed_s = 0.0
    if is_main:
        print(LEGEND_LINE, flush=True)
    clock = StepClock()
    for step in range(first, args.steps + 1):
        loss = _next_token_loss(forward, sampler.next_batch())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        meter.add(loss)
        if args.save and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            with clock.paused():
                _save(args, model, optimizer, scheduler, step)
        if step == args.crash_at_step and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # see --crash-at-step
        ends_window = step % args.log_every == 0 or step == args.steps
        if step != first and not ends_window:
            continue
        # the first step's line shows that step's loss and leaves its window open
        mean_loss = meter.mean(world, reset=ends_window)
        _sync(device)
        elapsed = clock.lap()
        losses.append((step, mean_loss))
        if step == first:
            first_step_s = elapsed
        else:
            timed_s += elapsed
        if is_main:
            mem, kind = peak_memory(device)
            if step == first:
                timing = f"first step {elapsed:.2f} s, compilation and warm-up included"
            else:
                tok_s = tokens_per_step * (step - timed_from + 1) / elapsed
                timing = f"{tok_s:>9,.0f} tok/s ({steps_label(timed_from, step)})"
            print(
                f"step {step:>{len(str(args.steps))}}/{args.steps} | loss {mean_loss:.4f} "
                f"({steps_label(loss_from, step)}, {world} ranks) | {timing} | {kind} {mem:,.0f} MiB (rank 0)",
                flush=True,
            )
        timed_from = step + 1
        if ends_window:
            loss_from = step + 1
    end = time.perf_counter()

    mem, kind = peak_memory(device)
    warm_steps = args.steps - start_step - 1
    summary = Summary(
        steps=args.steps,
        world_size=world,
        backend=dist.get_backend(),
        compiled=args.compile or args.compile_blocks,
        compiled_blocks=blocks,
        params=n_params,
        first_loss=losses[0][1],
        last_loss=losses[-1][1],
        first_step_s=first_step_s,
        tokens_per_s=tokens_per_step * warm_steps / timed_s if warm_steps else 0.0,
        peak_memory_mib=mem,
        peak_memory_kind=kind,
        wall_s=end - start,
        losses=losses,
        args=vars(args),
    )
    if is_main:
        print(summary_line(summary), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(asdict(summary), f, indent=2)
    return summary


_RUN_ARGS = ("steps", "lr", "seed", "batch_size", "seq_len")


def _save(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
) -> None:
    extra = {
        "scheduler": scheduler.state_dict(),
        "run": {name: getattr(args, name) for name in _RUN_ARGS},
    }
    checkpoint.save(args.save, model, optimizer, step=step, extra=extra)
    if dist.get_rank() == 0:
        print(f"saved checkpoint of step {step} to {args.save}", flush=True)


def _resume(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    sampler: WindowSampler,
) -> int:
    """Load ``--resume``; return its step. Every rank gets the same answer or error."""
    info = checkpoint.load(args.resume, model, optimizer)
    if info.step >= args.steps:
        raise ValueError(
            f"--resume {args.resume}: the checkpoint is at step {info.step}, not before "
            f"--steps {args.steps}; pass a larger --steps."
        )
    scheduler.load_state_dict(info.extra["scheduler"])
    sampler.skip(info.step)
    changed = {
        name: (value, getattr(args, name))
        for name, value in info.extra.get("run", {}).items()
        if getattr(args, name) != value
    }
    if dist.get_rank() == 0:
        print(
            f"resumed from {info.path} at step {info.step} (saved by {info.world_size} ranks)",
            flush=True,
        )
        if changed:
            diffs = ", ".join(
                f"--{k.replace('_', '-')} {a} -> {b}" for k, (a, b) in changed.items()
            )
            print(f"note: resumed with other settings than the saved run ({diffs})", flush=True)
    return info.step


if __name__ == "__main__":
    sys.exit(main())
