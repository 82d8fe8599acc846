"""The multi-process test runner (``fczero.testing.distributed.run_on_ranks``) reports
every rank: a crash on one rank usually shows on its peer as a broken connection, so the
peer's error alone would hide the cause. The NCCL tests' rank count
(``gpu_world_size``) follows ``FCZERO_GPU_RANKS`` up to the GPUs there are."""

from __future__ import annotations

import os

import pytest
import torch

from fczero.testing.distributed import gpu_world_size, run_on_ranks


def _one_fails_one_dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)  # as a rank that aborts in C code leaves no Python traceback
    raise ValueError("rank 0's own error")


def test_every_failing_rank_is_reported():
    with pytest.raises(RuntimeError) as info:
        run_on_ranks(_one_fails_one_dies, 2, timeout_s=60)
    message = str(info.value)
    assert "rank 0 failed:" in message and "ValueError: rank 0's own error" in message
    assert "rank 1 exited with code 3 and left no result" in message


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
