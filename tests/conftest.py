"""Shared fixtures: a fake process group for graph tests, a real gloo group of one rank,
Dynamo reset between tests, pinned memory that cannot be allocated."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def fake_pg(request):
    """A fake process group of ``world_size`` (default 2, or the test's param) on one CPU process.

    Collectives compile and run but return garbage: use it for graphs and errors, never numerics.
    """
    world_size = getattr(request, "param", 2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    yield world_size
    dist.destroy_process_group()


@pytest.fixture
def gloo_one_rank():
    """A real gloo group of one rank, in this process: collectives (or their absence over
    one rank) are exact, so numerics are checked against the plain model."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def no_pinned_memory(monkeypatch):
    """As if on a CUDA machine where every pinned allocation fails (no host memory to back it);
    fczero's once-per-process warnings are reset so the test sees its own."""
    from fczero.core import streams

    monkeypatch.setattr(streams, "_warned", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_empty = torch.empty

    def no_pinning(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_pinning)
