"""``check_finite_grads`` (fczero/runtime/grads.py): a NaN or an inf in any rank's shard
is reported on every rank, by name."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing.distributed import run_on_ranks
from tests.models import TwoLayer, UnevenTiedMLP


def test_check_finite_grads_needs_a_module():
    with pytest.raises(TypeError, match=r"check_finite_grads needs an nn.Module, got list"):
        fczero.check_finite_grads([])


def test_check_finite_grads_unsharded_model():
    model = TwoLayer()
    model(torch.randn(2, 8)).sum().backward()
    assert fczero.check_finite_grads(model) == []
    model.fc2.weight.grad[0, 0] = float("inf")
    assert fczero.check_finite_grads(model, raise_error=False) == ["fc2.weight"]
    with pytest.raises(
        FloatingPointError, match=r"1 parameter\(s\) hold NaN or inf \('fc2.weight'\)"
    ):
        fczero.check_finite_grads(model)


def _nan_on_one_rank(rank: int, world: int) -> tuple[list[str], list[str], str]:
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    fczero.parallelize(model, init_device_mesh("cpu", (world,)))
    model(torch.randn(4, 5)).sum().backward()
    clean = fczero.check_finite_grads(model)
    if rank == 1:  # the shard of rank 1 only: rank 0 cannot see it without the all-reduce
        model.hidden._parameters["bias"].grad.to_local()[0] = float("nan")
    bad = fczero.check_finite_grads(model, raise_error=False)
    try:
        fczero.check_finite_grads(model)
        message = ""
    except FloatingPointError as e:
        message = str(e)
    return clean, bad, message


def test_check_finite_grads_agrees_on_every_rank():
    results = run_on_ranks(_nan_on_one_rank, 2, timeout_s=120)
    for clean, bad, message in results:
        assert clean == []
        assert bad == ["hidden.bias"]
        assert "1 parameter(s) hold NaN or inf ('hidden.bias')" in message
