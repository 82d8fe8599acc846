"""Optimizer-state offload: bitwise the same training, states in host buffers between steps.

Each test trains a model twice from the same start, with and without offload, and
compares parameters and states bitwise (on the CPU the copies are exact). The sharded
case runs fczero on two gloo ranks, where the states are DTensors.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fczero
from fczero.core import streams
from fczero.offload import optimizer as offload_optimizer
from fczero.testing.distributed import run_on_ranks
from tests.models import UnevenTiedMLP, train_steps

_step_device = offload_optimizer._step_device


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False, amsgrad=True),
    ],
    ids=["adamw", "sgd-momentum", "adam-amsgrad-loop"],
)
def test_training_is_bitwise_equal_and_states_live_in_host_buffers(make_opt):
    torch.manual_seed(0)
    ref = UnevenTiedMLP()
    off = copy.deepcopy(ref)
    ref_opt, off_opt = make_opt(ref.parameters()), make_opt(off.parameters())
    handle = fczero.offload_optimizer_states(off_opt)

    def states_are_in_host_buffers() -> None:
        hosts = {s.host.data_ptr() for s in handle.slots}
        tensors = [v for st in off_opt.state.values() for v in st.values() if v.dim() > 0]
        assert tensors and all(v.data_ptr() in hosts for v in tensors)

    train_steps(ref, ref_opt, 4)
    train_steps(off, off_opt, 4, between=states_are_in_host_buffers)
    for a, b in zip(ref.parameters(), off.parameters()):
        assert torch.equal(a, b)
    for p_ref, p_off in zip(ref.parameters(), off.parameters()):
        for key, value in ref_opt.state[p_ref].items():
            assert torch.equal(value, off_opt.state[p_off][key]), key
    assert len(handle.slots) == len(handle.summary.offloaded) > 0


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    ],
    ids=["adamw-foreach", "adamw-loop", "sgd-momentum"],
)
def test_chunked_step_is_bitwise_equal(make_opt):
    torch.manual_seed(0)
    ref = UnevenTiedMLP()
    off = copy.deepcopy(ref)
    ref_opt = make_opt(ref.parameters())
    groups = [
        {"params": list(off.parameters())[:3]},
        {"params": list(off.parameters())[3:], "lr": 5e-3},
    ]
    off_opt = make_opt(groups)
    ref_opt = make_opt(
        [{"params": list(ref.parameters())[:3]}, {"params": list(ref.parameters())[3:], "lr": 5e-3}]
    )
    handle = fczero.offload_optimizer_states(off_opt, chunk_bytes=300)

    def between() -> None:
        hosts = {s.host.data_ptr() for s in handle.slots}
        states = [v for st in off_opt.state.values() for v in st.values() if v.dim() > 0]
        assert states and all(v.data_ptr() in hosts for v in states)

    train_steps(ref, ref_opt, 3)
    train_steps(off, off_opt, 3, between=between)
    assert handle.summary.chunks >= 3
    for a, b in zip(ref.parameters(), off.parameters()):
        assert torch.equal(a, b)
    for p_ref, p_off in zip(ref.parameters(), off.parameters()):
        assert set(ref_opt.state[p_ref]) == set(off_opt.state[p_off])
        for key, value in ref_opt.state[p_ref].items():
            assert torch.equal(value, off_opt.state[p_off][key]), key
    handle.remove()
    assert "step" not in off_opt.__dict__  # the chunked step is taken off again


def test_device_bytes_keeps_the_first_states():
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # param0 is the 0-d ``scale`` (its 0-d states stay put); param1 is inp.weight, whose
    # exp_avg and exp_avg_sq take 260 bytes each
    first_weight = 13 * 5 * 4
    handle = fczero.offload_optimizer_states(opt, device_bytes=2 * first_weight)
    train_steps(model, opt, 1)
    assert handle.summary.kept == ["group0.param1.exp_avg", "group0.param1.exp_avg_sq"]
    assert handle.summary.kept_bytes == 2 * first_weight
    assert "group0.param2.exp_avg" in handle.summary.offloaded
    assert not any(name.startswith("group0.param0.") for name in handle.summary.offloaded)


@pytest.mark.parametrize("chunk_bytes", [None, 256])
def test_auto_device_bytes_keeps_what_the_budget_leaves_above_the_peak(
    monkeypatch, caplog, chunk_bytes
):
    """``device_bytes="auto"``: the peak before the first step (injected: CPU has none)
    leaves room for inp.weight's two states (260 bytes each), as in the test above."""
    from fczero.core import memory

    peaks = []
    monkeypatch.setattr(memory, "peak_allocated", lambda device: peaks.append(device) or 10**6)
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    ref_model, off_model = model, copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(off_model.parameters(), lr=1e-2)
    # chunked, the budget must also hold three chunks of params' worth of states (AdamW:
    # twice the params) in flight; the largest 256-byte chunk is hidden.weight alone (364)
    reserve = 3 * 2 * 364 if chunk_bytes else 0
    handle = fczero.offload_optimizer_states(
        opt,
        device_bytes="auto",
        memory_budget=10**6 + reserve + 2 * 260 + 3,
        chunk_bytes=chunk_bytes,
    )
    with caplog.at_level(logging.INFO, logger="fczero"):
        train_steps(off_model, opt, 3)
    train_steps(ref_model, ref_opt, 3)
    assert len(peaks) == 1  # read once, before the first step
    assert handle.summary.kept == ["group0.param1.exp_avg", "group0.param1.exp_avg_sq"]
    assert "= 0.0 MiB of states kept" in handle.summary.sizing  # 523 bytes
    assert ("MiB for the chunks in flight" in handle.summary.sizing) == bool(chunk_bytes)
    assert "optimizer-state offload: auto: memory_budget" in caplog.text
    for p_ref, p_off in zip(ref_model.parameters(), off_model.parameters()):
        assert torch.equal(p_ref, p_off)  # offloading never changes the numbers


def test_auto_device_bytes_without_a_budget_or_peak_offloads_everything(caplog):
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = fczero.offload_optimizer_states(opt, device_bytes="auto")
    with caplog.at_level(logging.INFO, logger="fczero"):
        train_steps(model, opt, 1)
    assert handle.summary.kept == [] and handle.summary.offloaded
    assert handle.summary.sizing == "auto: no memory_budget on cpu, every state offloaded"
    opt2 = torch.optim.AdamW(UnevenTiedMLP().parameters(), lr=1e-2)
    handle2 = fczero.offload_optimizer_states(opt2, device_bytes="auto", memory_budget=10**9)
    train_steps(model, opt2, 0)
    assert handle2.summary.sizing == ""  # decided at the first step, not before
    model2 = UnevenTiedMLP()
    opt3 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    handle3 = fczero.offload_optimizer_states(opt3, device_bytes="auto", memory_budget=10**9)
    train_steps(model2, opt3, 1)
    assert handle3.summary.sizing == "auto: no allocator peak on cpu, every state offloaded"
    assert handle3.summary.kept == []


@pytest.mark.parametrize("chunk_bytes", [None, 256])
def test_a_budget_below_the_peak_without_states_names_the_minimum(monkeypatch, chunk_bytes):
    """Offloading every state cannot bring forward and backward (injected peak) within the
    budget: the first step raises before anything is stepped, naming the peak."""
    from fczero.core import memory

    monkeypatch.setattr(memory, "peak_allocated", lambda device: 10**6)
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = fczero.offload_optimizer_states(
        opt, device_bytes="auto", memory_budget=10**6 - 1, chunk_bytes=chunk_bytes
    )
    with pytest.raises(ValueError) as err:
        train_steps(model, opt, 1)
    assert str(err.value).startswith(
        "fczero: memory_budget=999999 bytes (1.0 MiB) is below what forward and backward "
        "took before the first step with no optimizer state on the device: 1000000 bytes "
        "(1.0 MiB), the minimum. Raise memory_budget to 1000000 or more"
    )
    assert not opt.state and handle.summary.sizing == ""
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_auto_device_bytes_below_the_default_budget_offloads_everything(monkeypatch, caplog):
    """Without a budget of the user's, "auto" plans within the default one (90% of the
    device): a peak above it is no error (the user asked for none), every state is
    offloaded and one warning says why."""
    from fczero.core import memory

    monkeypatch.setattr(memory, "peak_allocated", lambda device: 10**6)
    monkeypatch.setattr(
        memory, "device_budget", lambda device, budget: 10**6 - 1 if budget is None else budget
    )
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    ref_model, off_model = model, copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(off_model.parameters(), lr=1e-2)
    handle = fczero.offload_optimizer_states(opt, device_bytes="auto", chunk_bytes=256)
    with caplog.at_level(logging.INFO, logger="fczero"):
        train_steps(off_model, opt, 2)
    train_steps(ref_model, ref_opt, 2)
    assert handle.summary.kept == [] and handle.summary.offloaded
    assert "= 0.0 MiB of states kept (the default budget, 90% of the device" in caplog.text
    assert [r.levelname for r in caplog.records if "default budget" in r.message] == ["WARNING"]
    for p_ref, p_off in zip(ref_model.parameters(), off_model.parameters()):
        assert torch.equal(p_ref, p_off)


def test_auto_device_bytes_takes_the_parallelized_models_budget(fake_pg, monkeypatch):
    """One budget: without its own, the offload plans within parallelize's memory_budget."""
    from torch.distributed.device_mesh import init_device_mesh

    from fczero.core import memory

    monkeypatch.setattr(memory, "peak_allocated", lambda device: 3 * 2**20)
    model = fczero.parallelize(
        UnevenTiedMLP(), init_device_mesh("cpu", (2,)), memory_budget=5 * 2**20
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = fczero.offload_optimizer_states(opt, device_bytes="auto")
    train_steps(model, opt, 1)
    assert handle.summary.sizing == (
        "auto: memory_budget 5.0 MiB - peak before the first step 3.0 MiB = 2.0 MiB of "
        "states kept"
    )
    assert handle.summary.offloaded == [] and handle.summary.kept  # all states fit


def test_state_dict_round_trip_and_remove():
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = fczero.offload_optimizer_states(opt)
    train_steps(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    handle.remove()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(saved)
    for p in model.parameters():
        for key, value in opt.state[p].items():
            assert torch.equal(value, fresh.state[p][key])
    fczero.offload_optimizer_states(opt)  # allowed again once removed


def test_loading_a_state_dict_plans_again():
    torch.manual_seed(0)
    ref = UnevenTiedMLP()
    off = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    off_opt = torch.optim.AdamW(off.parameters(), lr=1e-2)
    handle = fczero.offload_optimizer_states(off_opt)
    train_steps(ref, ref_opt, 2)
    train_steps(off, off_opt, 2)
    off_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    assert handle.slots is None
    train_steps(ref, ref_opt, 2)
    train_steps(off, off_opt, 2)
    hosts = {s.host.data_ptr() for s in handle.slots}
    for p_ref, p_off in zip(ref.parameters(), off.parameters()):
        assert torch.equal(p_ref, p_off)
        for key, value in off_opt.state[p_off].items():
            assert torch.equal(value, ref_opt.state[p_ref][key])
            assert value.dim() == 0 or value.data_ptr() in hosts


def test_bad_inputs_are_clear_errors():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        fczero.offload_optimizer_states(object())
    with pytest.raises(ValueError, match="device_bytes must be an int >= 0"):
        fczero.offload_optimizer_states(opt, device_bytes=-1)
    with pytest.raises(ValueError, match=r"or 'auto' \(sized from memory_budget\), got 'all'"):
        fczero.offload_optimizer_states(opt, device_bytes="all")
    with pytest.raises(ValueError, match="memory_budget .* sizes device_bytes='auto' and nothing else"):
        fczero.offload_optimizer_states(opt, device_bytes=0, memory_budget=10**9)
    with pytest.raises(ValueError, match="got memory_budget=-1"):
        fczero.offload_optimizer_states(opt, device_bytes="auto", memory_budget=-1)
    with pytest.raises(ValueError, match="chunk_bytes must be None"):
        fczero.offload_optimizer_states(opt, chunk_bytes=0)
    with pytest.raises(TypeError, match="pin_memory"):
        fczero.offload_optimizer_states(opt, pin_memory="yes")
    fczero.offload_optimizer_states(opt)
    with pytest.raises(ValueError, match="already offloaded"):
        fczero.offload_optimizer_states(opt)


def test_without_cuda_says_once_that_nothing_moves(caplog, monkeypatch):
    monkeypatch.setattr(streams, "_warned", set())
    model = UnevenTiedMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fczero.offload_optimizer_states(opt)
    with caplog.at_level(logging.WARNING, logger="fczero"), pytest.warns(RuntimeWarning):
        train_steps(model, opt, 3)
    notes = [r for r in caplog.records if "saves no memory" in r.getMessage()]
    assert len(notes) == 1


def _as_if_params_were_offloaded(monkeypatch) -> None:
    """Every param steps through stand-ins, as under param offload ([Note: the device
    step]); the "device" is the CPU, so the copies are exact and the path runs here."""
    monkeypatch.setattr(offload_optimizer, "_step_device", lambda p: torch.device("cpu"))


@pytest.mark.parametrize("chunk_bytes", [None, 300])
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    ],
    ids=["adamw", "adam-amsgrad-loop", "sgd-momentum"],
)
def test_device_step_through_stand_ins_is_bitwise_equal(monkeypatch, make_opt, chunk_bytes):
    """The params keep their identity, storage and states; no stand-in is left behind."""
    _as_if_params_were_offloaded(monkeypatch)
    torch.manual_seed(0)
    ref = UnevenTiedMLP()
    off = copy.deepcopy(ref)
    ref_opt, off_opt = make_opt(ref.parameters()), make_opt(off.parameters())
    handle = fczero.offload_optimizer_states(off_opt, chunk_bytes=chunk_bytes)
    assert handle.device_step
    params = list(off.parameters())
    storages = [p.data_ptr() for p in params]
    train_steps(ref, ref_opt, 3)
    train_steps(off, off_opt, 3)
    assert handle.summary.chunks == (1 if chunk_bytes is None else 5)
    assert [p.data_ptr() for p in params] == storages
    # keyed by the params, not their stand-ins
    assert [id(p) for p in params if p in off_opt.state] == [id(p) for p in off_opt.state]
    assert len(off_opt.state) == len(ref_opt.state) > 0
    assert all(p is q for p, q in zip(off_opt.param_groups[0]["params"], params))
    for p_ref, p_off in zip(ref.parameters(), params):
        assert torch.equal(p_ref, p_off)
        for key, value in ref_opt.state[p_ref].items():
            assert torch.equal(value, off_opt.state[p_off][key]), key
    hosts = {s.host.data_ptr() for s in handle.slots}
    states = [v for st in off_opt.state.values() for v in st.values() if v.dim() > 0]
    assert states and all(v.data_ptr() in hosts for v in states)
    handle.remove()  # back to the host step, states where the params are
    assert "step" not in off_opt.__dict__
    train_steps(ref, ref_opt, 1)
    train_steps(off, off_opt, 1)
    for p_ref, p_off in zip(ref.parameters(), params):
        assert torch.equal(p_ref, p_off)


def test_device_step_runs_a_closure_once_before_the_chunks(monkeypatch):
    _as_if_params_were_offloaded(monkeypatch)
    torch.manual_seed(0)
    ref = UnevenTiedMLP()
    off = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    off_opt = torch.optim.AdamW(off.parameters(), lr=1e-2)
    fczero.offload_optimizer_states(off_opt, chunk_bytes=300)
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    calls = []

    def closure(model, opt):
        def run():
            calls.append(model)
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss

        return run

    for _ in range(2):
        expected = ref_opt.step(closure(ref, ref_opt))
        assert torch.equal(off_opt.step(closure(off, off_opt)), expected)
    assert calls.count(off) == 2
    for a, b in zip(ref.parameters(), off.parameters()):
        assert torch.equal(a, b)


def test_chunked_step_runs_fczeros_step_hooks_once_per_step(fake_pg):
    """The parts of a chunked step are one step for fczero: the stale-param check sees
    every param (here only the later chunks hold stale ones), and step counts count once."""
    from torch.distributed.device_mesh import init_device_mesh

    from fczero.core.state import root_state
    from tests.models import ThreeBlocks

    model = ThreeBlocks()
    fresh = nn.Linear(512, 512)
    early = torch.optim.SGD([{"params": fresh.parameters()}, {"params": model.parameters()}])
    fczero.offload_optimizer_states(early, chunk_bytes=512 * 512 * 4)
    model = fczero.parallelize(
        model, init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(keep_unsharded="auto"), memory_budget=10**9
    )
    with pytest.raises(RuntimeError, match=r"SGD holds 7 parameter\(s\) that parallelize"):
        early.step()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    handle = fczero.offload_optimizer_states(opt, chunk_bytes=512 * 512 * 4)
    steps = []
    for _ in range(2):
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        opt.zero_grad()
        steps.append(root_state(model).auto_unsharding.steps)
    assert handle.summary.chunks == 3
    assert steps == [1, 2]  # (counted per part, the plan would have come in step 1)


def _sharded_run(rank: int, world_size: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh

    results = []
    for offload in (False, True, "chunked", "device-step"):
        torch.manual_seed(0)
        model = fczero.parallelize(UnevenTiedMLP(), init_device_mesh("cpu", (world_size,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        if offload == "device-step":  # (the spawned rank has no monkeypatch fixture)
            offload_optimizer._step_device = lambda p: torch.device("cpu")
        try:
            if offload:
                chunk = None if offload is True else 200
                handle = fczero.offload_optimizer_states(opt, chunk_bytes=chunk)
            train_steps(model, opt, 3)
        finally:
            offload_optimizer._step_device = _step_device
        params = list(model.parameters())
        if offload:
            assert handle.slots and all(
                isinstance(v, DTensor)
                for st in opt.state.values()
                for v in st.values()
                if v.dim() > 0
            )
        results.append(
            [_local(p).clone() for p in params]
            + [_local(v).clone() for p in params for _, v in sorted(opt.state[p].items())]
        )
    plain = results[0]
    return all(
        len(other) == len(plain) and all(torch.equal(a, b) for a, b in zip(plain, other))
        for other in results[1:]
    )


def test_sharded_dtensor_states_are_bitwise_equal_on_two_ranks():
    assert run_on_ranks(_sharded_run, 2) == [True, True]


def test_offloading_states_frees_what_the_default_kept(fake_pg, caplog):
    """[Note: the default kept bytes]: the default keeps the last half of a 2-rank model
    gathered for backward; offloading the optimizer's states asks for the least device
    memory, so those params are freed after forward again. A budget in bytes stays."""
    from torch.distributed.device_mesh import init_device_mesh

    from fczero.core.state import root_state
    from tests.models import ThreeBlocks

    def kept(model: nn.Module) -> list[str]:
        return [p.spec.keep_unsharded for p in root_state(model).params]

    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)))
    assert kept(model) == [False] * 4 + [True] * 3  # blocks.2 and the head
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level(logging.INFO, logger="fczero"):
        fczero.offload_optimizer_states(opt)
    assert kept(model) == [False] * 7
    assert "with offload_optimizer_states: none" in caplog.text
    assert "with offload_optimizer_states" in root_state(model).kept.source
    model(torch.randn(4, 512)).sum().backward()  # trains as pure stage 3
    opt.step()

    sized = fczero.parallelize(
        ThreeBlocks(),
        init_device_mesh("cpu", (2,)),
        comm_policy=fczero.CommPolicy(keep_unsharded=512 * 8 * 4),  # the head
    )
    fczero.offload_optimizer_states(torch.optim.SGD(sized.parameters(), lr=0.01))
    assert kept(sized) == [False] * 6 + [True]
