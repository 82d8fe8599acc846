"""The multi-process test runner (``fczero.testing.distributed.run_on_ranks``) reports
every rank: a crash on one rank usually shows on its peer as a broken connection, so the
peer's error alone would hide the cause. A rank starts with none of the caller's state
but the caller's environment at the call. The NCCL tests' rank count
(``gpu_world_size``) follows ``FCZERO_GPU_RANKS`` up to the GPUs there are."""

from __future__ import annotations

import os

import pytest
import torch

from fczero.testing.distributed import gpu_world_size, run_on_ranks


def _one_fails_one_dies(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    dist.barrier()  # both ranks connected: rank 0's setup cannot fail on rank 1's exit
    if rank == 1:
        os._exit(3)  # as a rank that aborts in C code leaves no Python traceback
    raise ValueError("rank 0's own error")


def test_every_failing_rank_is_reported():
    with pytest.raises(RuntimeError) as info:
        run_on_ranks(_one_fails_one_dies, 2, timeout_s=60)
    message = str(info.value)
    assert "rank 0 failed:" in message and "ValueError: rank 0's own error" in message
    assert "rank 1 exited with code 3 and left no result" in message


#: Set by the test below in the caller only: a rank that inherited the caller's modules
#: would see it.
CALLER_ONLY = None


def _what_a_rank_sees(rank: int, world_size: int) -> tuple:
    import fczero.testing.distributed as runner

    return (
        CALLER_ONLY,
        os.environ.get("FCZERO_TEST_MARK"),
        hasattr(runner, "caller_was_here"),
        torch.distributed.get_rank(),
    )


def test_a_rank_sees_the_callers_environment_and_none_of_its_state(monkeypatch):
    import fczero.testing.distributed as runner

    monkeypatch.setattr(f"{__name__}.CALLER_ONLY", "caller")
    monkeypatch.setattr(runner, "caller_was_here", True, raising=False)
    for mark in ("first", "second"):  # a rank forked later sees the environment of then
        monkeypatch.setenv("FCZERO_TEST_MARK", mark)
        seen = run_on_ranks(_what_a_rank_sees, 2, timeout_s=60)
        assert seen == [(None, mark, False, 0), (None, mark, False, 1)]


def test_gpu_ranks_follow_the_environment_up_to_the_gpus_there_are(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("FCZERO_GPU_RANKS", raising=False)
    assert gpu_world_size() == 2
    monkeypatch.setenv("FCZERO_GPU_RANKS", "4")
    assert gpu_world_size() == 4
    monkeypatch.setenv("FCZERO_GPU_RANKS", "8")
    assert gpu_world_size() == 4  # NCCL takes one GPU per rank
    assert gpu_world_size(1) == 1
    for bad in ("two", "0", "-1"):
        monkeypatch.setenv("FCZERO_GPU_RANKS", bad)
        with pytest.raises(ValueError, match="FCZERO_GPU_RANKS"):
            gpu_world_size()


def test_ranks_are_forked_only_on_a_cpu_build_of_torch(monkeypatch):
    from fczero.testing import distributed

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    assert distributed._context("gloo").get_start_method() == "forkserver"
    assert distributed._context("nccl").get_start_method() == "spawn"
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)  # forked CUDA would fail
    assert distributed._context("gloo").get_start_method() == "spawn"
