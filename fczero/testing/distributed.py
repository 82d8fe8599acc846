"""Run a function on N local processes with a real process group (gloo on CPU, NCCL on GPUs).

``run_on_ranks(fn, world_size, *args)`` starts one fresh process per rank, joins a
process group through a file store, calls ``fn(rank, world_size, *args)`` and returns
every rank's result, in rank order. No state of the caller's is inherited: on a CPU
build of torch the ranks are forked from a server process that has imported torch and
fczero and done nothing else ([Note: ranks from a fork server]); with CUDA they are
spawned. A failure on any rank raises in the caller with that rank's traceback; a rank
that does not finish within ``timeout_s`` is killed and reported, so a hang fails the
test instead of CI. A rank counts by the result it wrote, not its exit code (see the
note in ``_child``), and fails if it leaves a functional collective unwaited.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def _child(fn, rank, world_size, args, backend, workdir, timeout_s, env):  # pragma: no cover
    os.environ.clear()  # the caller's environment now, not the fork server's when it started
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    from fczero.core.cuda_graphs import release_graphs

    out_path = os.path.join(workdir, f"rank{rank}.pkl")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{os.path.join(workdir, 'store')}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result = ("ok", fn(rank, world_size, *args))
        unwaited = pending_collectives()
        if unwaited:
            result = ("error", f"{unwaited} functional collectives were never waited")
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        result = ("error", traceback.format_exc())
    # The result is on disk (whole, via rename) before teardown: gloo can abort the process
    # while the group is destroyed (its worker threads release tensors late), which must
    # not lose a finished rank's answer.
    with open(out_path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    if dist.is_initialized():
        if result[0] == "ok":
            dist.barrier()  # no rank tears down while another still communicates
        # graphs that captured NCCL collectives would hold the group's teardown forever; fczero
        # frees them once the model goes, but ``fn``'s result may still hold one
        release_graphs()
        dist.destroy_process_group()


def pending_collectives() -> int:
    """Collectives issued through ``torch.ops._c10d_functional`` whose output was never
    waited. Each one pins its buffers for the life of the process, and on gloo abandoned
    collectives corrupt the heap, so a rank that leaves any fails its test."""
    import torch

    size = getattr(torch._C._distributed_c10d, "_get_work_registry_size", None)
    return size() if size is not None else 0


def gpu_world_size(wanted: int | None = None) -> int:
    """Ranks for a NCCL test: ``wanted`` (default: ``FCZERO_GPU_RANKS``, else 2), or fewer
    on a machine with fewer GPUs (NCCL takes one GPU per rank). On one GPU the collectives
    have a single member, yet the compiled CUDA graphs, the custom ops and the numerics
    against the reference still run. ``FCZERO_GPU_RANKS=4`` runs the same tests over 4
    GPUs (the parity batches split evenly over 1, 2, 4 and 8 ranks)."""
    import torch

    if wanted is None:
        text = os.environ.get("FCZERO_GPU_RANKS", "2")
        if not text.isdigit() or int(text) < 1:
            raise ValueError(
                f"FCZERO_GPU_RANKS={text!r}: set it to a whole number of ranks, 1 or more "
                "(or unset it for 2)"
            )
        wanted = int(text)
    return min(wanted, torch.cuda.device_count())


# [Note: ranks from a fork server]
# A spawned rank starts a new interpreter and imports torch and fczero: about 5 s of a
# 2-core machine for two ranks that do nothing, which most multi-rank tests would spend
# again. multiprocessing's fork server imports them once (the preload below) and forks
# each rank from that process, which has run nothing else: a rank still inherits none of
# the caller's state (its modules, monkeypatches, process groups, compiled code), and it
# is ready in a fraction of a second. The environment is the caller's at each call (set
# again in ``_child``), though modules the server imported read theirs at import.
# Only a CPU build of torch forks its ranks. With a CUDA build a forked rank cannot use
# CUDA at all, gloo or not: on an H100 with torch 2.11 the preload left the driver's
# library loaded in the server, every forked rank that touched CUDA failed ("Cannot
# re-initialize CUDA in forked subprocess"), and gloo ranks failed too, since torch's
# optimizer step asks CUDA about graph capture wherever a GPU is. So a CUDA build spawns
# every rank, as before. Importing torch starts an OpenMP pool in the server; a forked
# rank builds its own when it first computes in parallel (checked: two threads per rank,
# as spawned).
_PRELOAD = ["torch", "torch.distributed.tensor", "torch._inductor.compile_fx", "fczero"]


def _context(backend: str) -> mp.context.BaseContext:
    """The multiprocessing context ranks of ``backend`` start from (see the note above)."""
    import torch

    forkable = backend == "gloo" and not torch.backends.cuda.is_built()
    if not forkable or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")  # (multiprocessing keeps one per method)
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts, the first time
    return ctx


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results."""
    ctx = _context(backend)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="fczero-ranks-") as workdir:
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, rank, world_size, args, backend, workdir, timeout_s, env),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout_s:.0f} s")
        results, failures = [], []
        for rank in range(world_size):  # every rank's story: one rank's crash shows on its peer
            path = os.path.join(workdir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                code = procs[rank].exitcode
                how = f" (signal {-code})" if code is not None and code < 0 else ""
                failures.append(f"rank {rank} exited with code {code}{how} and left no result")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                failures.append(f"rank {rank} failed:\n{value}")
            results.append(value)
        if failures:
            raise RuntimeError("\n".join(failures))
        return results
