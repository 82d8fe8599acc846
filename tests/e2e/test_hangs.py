"""No silent hangs: with ``check_policy=CheckPolicy()``, ranks that would issue different
collectives get a clear error within seconds (fczero/comm/consistency.py).

Each case makes the ranks differ on purpose: a graph break on one rank, a recompile on
one rank (from a rank-dependent Python value or shape), a rank-dependent branch in
eager mode, a model that differs between ranks. Every rank catches its own error and
returns it, so the test sees what each rank said and how long it took; the check
timeout is 5 s, so a case that hung would blow the 90 s limit of ``run_on_ranks``.
"""

from __future__ import annotations

import io
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing.backends import aot_eager_with_passes
from fczero.testing.distributed import run_on_ranks
from tests.models import ThreeBlocks, TwoLayer, UnevenTiedMLP, mlp_batches

TIMEOUT_S = 5.0
LIMIT_S = 90


class _BreakOnRank(nn.Module):
    """A print (graph break) between the two layers, on the ranks in ``breaking`` only."""

    def __init__(self, breaking: set[int]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.breaking = dist.get_rank() in breaking
        self.sink = io.StringIO()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.breaking:
            print("graph break", file=self.sink)
        return self.fc2(h)


def _outcome(fn, leave: bool = True) -> tuple[str, str, float]:
    """('ok', result, s) or ('error', message, s). With ``leave``, a rank that failed leaves
    the group, so a peer blocked in a collective fails at once (not at the group's timeout);
    without it the group stays usable, for errors that every rank raises at the same point."""
    start = time.perf_counter()
    try:
        result = fn()
        return "ok", repr(result), time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - reported to the test
        message = f"{type(e).__name__}: {e}"
        if leave:
            dist.destroy_process_group()
        return "error", message, time.perf_counter() - start


def _train(model: nn.Module, batches, compiled: bool) -> list[float]:
    fczero.parallelize(
        model, init_device_mesh("cpu", (dist.get_world_size(),)),
        check_policy=fczero.CheckPolicy(timeout_s=TIMEOUT_S),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch.compile(model, backend=aot_eager_with_passes) if compiled else model
    losses = []
    for x in batches:
        loss = step(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _recompile_on_rank_1(rank: int, world: int, cause: str):
    torch.manual_seed(0)
    model = ThreeBlocks(dim=32)
    batches = [torch.randn(4, 32) for _ in range(3)]

    def run():
        fczero.parallelize(
            model, init_device_mesh("cpu", (world,)),
            check_policy=fczero.CheckPolicy(timeout_s=TIMEOUT_S),
        )  # fmt: skip
        step = torch.compile(model, backend=aot_eager_with_passes)
        for i, x in enumerate(batches):
            if i == 2 and rank == 1:
                if cause == "value":
                    model.skip = {1}  # a rank-dependent Python value: a guard fails
                else:
                    x = torch.randn(3, 32)  # a rank-dependent shape
            step(x).sum().backward()
        return "done"

    return _outcome(run)


def test_recompile_on_one_rank_from_a_python_value_times_out_with_a_clear_error():
    start = time.perf_counter()
    results = run_on_ranks(_recompile_on_rank_1, 2, "value", timeout_s=LIMIT_S)
    status, message, _ = results[1]
    assert status == "error", message
    assert "rank 1 reached compiled graph #2 of this process but rank(s) [0] did not" in message
    assert "within 5 s" in message and "all_gather_into_tensor" in message
    assert results[0][0] == "error"  # rank 0 waited in a collective: it fails once rank 1 leaves
    assert time.perf_counter() - start < LIMIT_S


@pytest.mark.slow  # a second spawn for a variant of the test above
def test_recompile_on_one_rank_from_a_shape_times_out_with_a_clear_error():
    results = run_on_ranks(_recompile_on_rank_1, 2, "shape", timeout_s=LIMIT_S)
    status, message, _ = results[1]
    assert status == "error", message
    assert "rank 1 reached compiled graph #2 of this process but rank(s) [0] did not" in message


class _OptionalTail(nn.Module):
    """Two layers, then a third one that ``use_tail=False`` leaves out."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.tail = nn.Linear(16, 4)
        self.use_tail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.tail(h) if self.use_tail else h


def _eager_branch_on_rank_1(rank: int, world: int):
    torch.manual_seed(0)
    model = _OptionalTail()
    batches = [torch.randn(4, 8) for _ in range(2)]

    def run():
        fczero.parallelize(
            model, init_device_mesh("cpu", (world,)),
            check_policy=fczero.CheckPolicy(timeout_s=TIMEOUT_S),
        )  # fmt: skip
        for i, x in enumerate(batches):
            if i == 1 and rank == 1:
                model.use_tail = False  # a rank-dependent branch: two gathers fewer
            model(x).sum().backward()
        return "done"

    return _outcome(run)


def test_rank_dependent_branch_in_eager_is_a_clear_error():
    results = run_on_ranks(_eager_branch_on_rank_1, 2, timeout_s=LIMIT_S)
    messages = [m for status, m, _ in results if status == "error"]
    assert len(messages) == 2, results
    # each gather is compared before it is issued: rank 1 reaches the end of its forward
    # where rank 0 is about to gather the tail, and both say so at once, by name
    where = ["gather #4 of eager forward #1", "the end of eager forward #1"]
    for rank, (status, message, seconds) in enumerate(results):
        assert status == "error", message
        assert f"ranks {rank} and {1 - rank} differ at {where[rank]}" in message
        assert "end of forward after 4 gathers" in message
        assert "gather tail.weight [4, 16] as same" in message
        assert "so far: " in message and "(gather [16, 8] as same, gather [16] as same" in message
        assert seconds < TIMEOUT_S, (rank, seconds)


def _reference_losses() -> list[float]:
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, _ in mlp_batches(steps=3):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _symmetric_cases(rank: int, world: int) -> dict[str, object]:
    """The cases in which every rank stops at the same check (no collective left pending),
    so one process group serves them all, one after another."""
    out: dict[str, object] = {}
    batches = [x for x, _ in mlp_batches(steps=3)]
    for compiled in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        out[f"agree compiled={compiled}"] = _train(UnevenTiedMLP(), batches, compiled)

    torch.manual_seed(0)
    model = TwoLayer() if rank == 0 else nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    out["different models"] = _outcome(
        lambda: fczero.parallelize(model, mesh, check_policy=fczero.CheckPolicy(timeout_s=TIMEOUT_S)),
        leave=False,
    )
    out["untouched"] = not fczero.is_parallelized(model)

    torch._dynamo.reset()
    torch.manual_seed(0)
    out["graph break"] = _outcome(
        lambda: _train(_BreakOnRank({1}), [torch.randn(4, 8)], compiled=True), leave=False
    )
    return out


def test_checks_agree_or_refuse_at_the_same_point_on_every_rank():
    results = run_on_ranks(_symmetric_cases, 2, timeout_s=LIMIT_S)
    reference = _reference_losses()
    for rank, out in enumerate(results):
        # no false alarm, compiled or eager; the losses are the single-process model's (every
        # rank feeds the same batch, so the averaged gradient is the whole-batch one)
        for compiled in (True, False):
            torch.testing.assert_close(
                out[f"agree compiled={compiled}"], reference, rtol=1e-5, atol=1e-6
            )
        # a model that differs between ranks: refused at parallelize, before sharding
        status, message, _ = out["different models"]
        assert status == "error", message
        assert "differ at parallelize (the model and options): entry #2" in message
        assert out["untouched"]
        # a graph break on rank 1 only: refused when the first graph is compiled
        status, message, seconds = out["graph break"]
        assert status == "error", (rank, message)
        assert "CollectiveMismatchError" in message
        assert "differ at compiled graph #" in message
        assert "entry #2 is " in message  # fc2's gather: rank 1's first graph ends before it
        assert "all_gather_into_tensor float32[4, 16]" in message
        assert seconds < 30
    assert "fc1.weight [16, 8]" in results[0]["different models"][1]
    assert "0.weight [16, 8]" in results[0]["different models"][1]


@pytest.mark.slow  # stock Inductor on CPU: C++ compiles
def test_inductor_hands_every_compiled_graph_to_the_check(fake_pg, monkeypatch):
    """The check runs inside Inductor's post-grad hook, on forward and backward graphs
    (the fake group has no peers, so the exchange itself is recorded instead)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from fczero.comm import consistency

    seen: list[tuple[str, list[str], str]] = []
    monkeypatch.setattr(
        consistency, "exchange", lambda group, kind, entries, timeout, what: seen.append(
            (kind, entries, what)
        )
    )  # fmt: skip
    model = fczero.parallelize(
        TwoLayer(), init_device_mesh("cpu", (2,)), check_policy=fczero.CheckPolicy(timeout_s=5.0)
    )
    # a cache hit skips the post-grad hook (docs/troubleshooting.md): compile for real
    with (
        inductor_config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        torch.compile(model)(torch.randn(3, 8)).sum().backward()
    graphs = [(entries, what) for kind, entries, what in seen if kind == "graph"]
    assert len(graphs) == 2  # forward, then backward
    forward, backward = graphs[0][0], graphs[1][0]
    assert forward.count("all_gather_into_tensor float32[16, 8]") == 1  # fc1.weight, gathered
    assert any(e.startswith("reduce_scatter_tensor") for e in backward)
    assert [kind for kind, _, _ in seen][0] == "parallelize"
