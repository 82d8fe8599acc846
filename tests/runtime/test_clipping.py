"""``fczero.clip_grad_norm_`` on sharded grads against ``torch.nn.utils.clip_grad_norm_``
on the whole grads of a single-process reference.

The model has an uneven dim 0, a shard that is empty on rank 1 (one row over two
ranks), a 0-d ``Replicate()`` param, a tied weight and a frozen param. Tolerance: rtol
1e-5 / atol 1e-6 (fp32; only the order of the sums differs).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import fczero
from fczero.testing import parity
from fczero.testing.distributed import run_on_ranks
from tests.models import UnevenTiedMLP, mlp_batches

FP32 = {"rtol": 1e-5, "atol": 1e-6}
# (norm_type, foreach, max_norm): max_norm well under the grads' norm, so every case clips
CASES = [
    (2.0, None, 0.05),
    (2.0, False, 0.05),
    (2.0, True, 0.05),
    (math.inf, None, 0.01),
    (math.inf, True, 0.01),
    (1.0, False, 0.1),
    (2.0, None, 1e6),  # no clipping: grads unchanged, the norm still reported
]


class ClipModel(nn.Module):
    """UnevenTiedMLP plus a one-row param: rank 1 of 2 holds an empty shard of it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = UnevenTiedMLP()
        self.gate = nn.Linear(13, 1)  # weight (1, 13), bias (1,): rows 1 and 0 on 2 ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return h * torch.sigmoid(self.gate(h))


def _grads(model: nn.Module, whole: bool) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.full_tensor() if whole else p.grad).detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _reference(norm_type: float, foreach: bool | None, max_norm: float):
    torch.manual_seed(0)
    model = ClipModel()
    x, y = mlp_batches(steps=1)[0]
    parity.mse(model(x), y).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type, foreach=foreach)
    return total, _grads(model, whole=False)


def _ranks(rank: int, world_size: int, cases):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    results = []
    for norm_type, foreach, max_norm in cases:
        torch.manual_seed(0)
        model = fczero.parallelize(ClipModel(), mesh)
        x, y = mlp_batches(steps=1)[0]
        n = x.shape[0] // world_size
        parity.mse(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        shapes = {
            n: tuple(p.grad.to_local().shape)
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        total = fczero.clip_grad_norm_(model, max_norm, norm_type, foreach=foreach)
        results.append((total, _grads(model, whole=True), shapes))
    return results


def _all_ranks(rank: int, world_size: int):
    return _ranks(rank, world_size, CASES), _scalar_only(rank, world_size)


@pytest.fixture(scope="module")
def clip_results():
    return run_on_ranks(_all_ranks, 2)  # one spawn for every case of this file


@pytest.fixture(scope="module")
def clipped(clip_results):
    return [per_case for per_case, _ in clip_results]


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "-".join(map(str, CASES[i])))
def test_clip_matches_reference(clipped, index):
    norm_type, foreach, max_norm = CASES[index]
    expected_total, expected_grads = _reference(norm_type, foreach, max_norm)
    for per_case in clipped:
        total, grads, _ = per_case[index]
        torch.testing.assert_close(total, expected_total, **FP32)
        assert grads.keys() == expected_grads.keys()
        for name, g in expected_grads.items():
            torch.testing.assert_close(grads[name], g, **FP32, msg=lambda m, n=name: f"{n}: {m}")
    # the case really covers an empty shard and a replicated 0-d grad
    assert clipped[1][index][2]["gate.weight"] == (0, 13)
    assert clipped[0][index][2]["body.scale"] == ()
    if max_norm < 1e6:
        assert expected_total > max_norm  # the case clips


def test_replicated_grad_counted_once(clip_results):
    """Only the 0-d param is clipped: the norm is |grad|, not sqrt(world) * |grad|."""
    r0, r1 = (scalar for _, scalar in clip_results)
    torch.manual_seed(0)
    ref = ClipModel()
    x, y = mlp_batches(steps=1)[0]
    parity.mse(ref(x), y).backward()
    expected = ref.body.scale.grad.abs()
    torch.testing.assert_close(r0, expected, **FP32)
    torch.testing.assert_close(r1, expected, **FP32)


def _scalar_only(rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = fczero.parallelize(ClipModel(), init_device_mesh("cpu", (world_size,)))
    x, y = mlp_batches(steps=1)[0]
    n = x.shape[0] // world_size
    parity.mse(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
    return fczero.clip_grad_norm_([model.body._parameters["scale"]], 1e6)


def test_plain_model_matches_torch():
    """A model that is not parallelized (no process group at all) clips like torch."""
    torch.manual_seed(0)
    a, b = ClipModel(), ClipModel()
    b.load_state_dict(a.state_dict())
    x, y = mlp_batches(steps=1)[0]
    for m in (a, b):
        parity.mse(m(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.05)
    total = fczero.clip_grad_norm_(b, 0.05)
    torch.testing.assert_close(total, expected, **FP32)
    for pa, pb in zip(a.parameters(), b.parameters()):
        if pa.grad is not None:
            torch.testing.assert_close(pb.grad, pa.grad, **FP32)


def test_no_grads_returns_zero():
    assert fczero.clip_grad_norm_(nn.Linear(2, 2), 1.0).item() == 0.0


def test_nonfinite_norm_raises_and_leaves_grads():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("inf"), 2.0])
    with pytest.raises(RuntimeError, match="error_if_nonfinite=False"):
        fczero.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert p.grad[0].item() == 1.0


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((nn.Linear(2, 2), -1.0), ValueError, "max_norm=-1.0 must be 0 or more"),
        ((nn.Linear(2, 2), 1.0, 0.0), ValueError, "norm_type=0.0 is not supported"),
        ((nn.Linear(2, 2), "1"), TypeError, "max_norm must be a number"),
        ((3, 1.0), TypeError, "needs a module, a tensor or an iterable"),
        (([nn.Linear(2, 2)], 1.0), TypeError, "got an element of type Linear"),
    ],
)
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        fczero.clip_grad_norm_(*args)


def test_partial_grad_is_refused(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (2,))
    p = nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Partial()]))
    p.grad = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    with pytest.raises(ValueError, match=r"placement P\(sum\); only Shard and Replicate"):
        fczero.clip_grad_norm_([p], 1.0)
    assert p.grad.to_local()[0].item() == 1.0
