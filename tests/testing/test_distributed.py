"""The multi-process test runner (``fczero.testing.distributed.run_on_ranks``) reports
every rank: a crash on one rank usually shows on its peer as a broken connection, so the
peer's error alone would hide the cause."""

from __future__ import annotations

import os

import pytest

from fczero.testing.distributed import run_on_ranks


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
