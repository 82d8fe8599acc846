"""The host-memory check ([Note: host memory check] in ``fczero/core/offload_sizing.py``):
an offload that will not fit in host memory is refused before anything moves, with the
bytes needed and available in the message; one that fits goes on.

On CPU nothing is offloaded, so these tests make ``goes_to_host`` say yes and simulate the
host through the module's OS readers. The byte counts asserted are worked out by hand
from the shapes (each pinned buffer rounded up to a power of two). The test marked ``gpu``
runs the hooked paths on a real GPU mesh with a simulated small host.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.core import offload_sizing
from fczero.testing.distributed import gpu_world_size, run_on_ranks


@pytest.fixture
def host(monkeypatch):
    """A simulated host: ``host.available`` bytes free, no cgroup limit, no memlock limit,
    one rank per host; offloads count as going to host memory (as from a GPU)."""

    class Host:
        available: int | None = 10**12
        memlock: int | None = None

    monkeypatch.setattr(offload_sizing, "goes_to_host", lambda device: True)
    monkeypatch.setattr(offload_sizing, "read_mem_available", lambda: Host.available)
    monkeypatch.setattr(offload_sizing, "read_cgroup_headroom", lambda: None)
    monkeypatch.setattr(offload_sizing, "read_memlock", lambda: Host.memlock)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return Host


class TwoLinears(nn.Module):
    """Shapes chosen so the counts are easy to check by hand (see the tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(100, 30)  # weight (30, 100), bias (30,)
        self.b = nn.Linear(30, 3, bias=False)  # weight (3, 30)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


# Over 2 ranks, in fp32, pinned (power of two): a.weight 15 rows x 100 x 4 = 6000 -> 8192,
# a.bias 15 x 4 = 60 -> 64, b.weight 2 x 30 x 4 = 240 -> 256; shards 8512 bytes per rank.
SHARDS = 8192 + 64 + 256


def _snapshot(model: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    return [(n, p, p.detach().clone()) for n, p in model.named_parameters()]


def _unchanged(model: nn.Module, before) -> bool:
    after = list(model.named_parameters())
    return len(after) == len(before) and all(
        n == n0 and p is p0 and type(p) is nn.Parameter and torch.equal(p, v0)
        for (n, p), (n0, p0, v0) in zip(after, before)
    )


def test_param_offload_that_does_not_fit_is_refused_and_the_model_is_unchanged(
    fake_pg, host, monkeypatch
):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    model = TwoLinears()
    model.a.bias.requires_grad_(False)  # no grad buffer for it
    grads = SHARDS - 64
    needed = 3 * (SHARDS + grads)  # 3 ranks on the host: 50880
    host.available = needed - 1
    before = _snapshot(model)
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(MemoryError) as err:
        fczero.parallelize(model, mesh, offload_policy=fczero.OffloadPolicy(params=True))
    message = str(err.value)
    assert f"needs 49.69 KiB ({needed} bytes) of host memory" in message
    assert f"has 49.69 KiB ({needed - 1} bytes) available (MemAvailable" in message
    assert f"param shards (pinned) 8.31 KiB ({SHARDS} bytes)" in message
    assert f"their grads (pinned) 8.25 KiB ({grads} bytes)" in message
    assert "times 3 rank(s) on this host (LOCAL_WORLD_SIZE)" in message
    assert "fewer ranks per host" in message and "no OffloadPolicy(params=True)" in message
    assert not fczero.is_parallelized(model) and _unchanged(model, before)

    host.available = needed  # exactly enough: the same model goes through
    fczero.parallelize(model, mesh, offload_policy=fczero.OffloadPolicy(params=True))
    assert fczero.is_parallelized(model)


def test_without_offload_params_or_with_room_nothing_is_refused(fake_pg, host):
    host.available = 0
    mesh = init_device_mesh("cpu", (2,))
    fczero.parallelize(TwoLinears(), mesh)  # no offload: host memory is not consulted
    host.available = 10**12
    fczero.parallelize(TwoLinears(), mesh, offload_policy=fczero.OffloadPolicy(params=True))


def test_every_rank_stops_when_another_ranks_host_is_short(fake_pg, host, monkeypatch):
    """The ranks agree (an all-reduce of the shortfall): a rank whose own host has room
    raises too, so that none waits in a collective for the one that stopped."""

    def another_rank_short(tensor, op=None, group=None):
        assert op == torch.distributed.ReduceOp.MAX
        tensor.fill_(123)

    monkeypatch.setattr(torch.distributed, "all_reduce", another_rank_short)
    model = TwoLinears()
    before = _snapshot(model)
    with pytest.raises(MemoryError, match="another rank is 123 bytes short of host memory"):
        fczero.parallelize(model, init_device_mesh("cpu", (2,)), offload_policy=fczero.OffloadPolicy(params=True))
    assert _unchanged(model, before)


def test_a_small_locked_memory_limit_is_logged_not_refused(fake_pg, host, caplog):
    """torch's CUDA pinned memory is not charged to RLIMIT_MEMLOCK (measured, see the Note)."""
    host.memlock = 4096  # below the 2 x 8512 pinned bytes of shards and grads
    with caplog.at_level(logging.INFO, logger="fczero"):
        fczero.parallelize(TwoLinears(), init_device_mesh("cpu", (2,)), offload_policy=fczero.OffloadPolicy(params=True))
    assert "RLIMIT_MEMLOCK (ulimit -l) is 4.00 KiB (4096 bytes), below the 16.62 KiB" in caplog.text
    assert "so this is no error" in caplog.text


def test_optimizer_states_that_do_not_fit_are_refused_before_any_hook(host):
    model = nn.Linear(100, 30)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # two AdamW states per param: weight 12000 bytes -> 16384 pinned, bias 120 -> 128
    needed = 2 * 16384 + 2 * 128
    host.available = needed - 1
    with pytest.raises(MemoryError) as err:
        fczero.offload_optimizer_states(opt)
    assert f"({needed} bytes) of host memory" in str(err.value)
    assert f"AdamW's states 32.25 KiB ({needed} bytes)" in str(err.value)
    assert "device_bytes=N" in str(err.value)
    record = opt.__dict__.get("_fczero")
    assert (record is None or not record.offload) and "step" not in opt.__dict__
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    # what stays on the device is not counted: the weight's two states (12000 bytes each)
    handle = fczero.offload_optimizer_states(opt, device_bytes=2 * 12000)
    handle.remove()
    # pageable buffers take their exact size: 2 x 12000 + 2 x 120 bytes
    host.available = 2 * 12000 + 2 * 120
    fczero.offload_optimizer_states(opt, pin_memory=False).remove()
    host.available -= 1
    with pytest.raises(MemoryError, match=r"AdamW's states 23.67 KiB \(24240 bytes\)"):
        fczero.offload_optimizer_states(opt, pin_memory=False)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, amsgrad=True),
        lambda ps: torch.optim.AdamW(ps),
        lambda ps: torch.optim.Adamax(ps),
        lambda ps: torch.optim.NAdam(ps),
        lambda ps: torch.optim.RAdam(ps),
        lambda ps: torch.optim.Adadelta(ps),
        lambda ps: torch.optim.Rprop(ps),
        lambda ps: torch.optim.ASGD(ps),
        lambda ps: torch.optim.Adagrad(ps),
        lambda ps: torch.optim.RMSprop(ps),
        lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True),
    ],
)
def test_predicted_states_are_the_states_the_optimizer_creates(make):
    params = [nn.Parameter(torch.randn(7, 3)), nn.Parameter(torch.randn(5, dtype=torch.float64))]
    opt = make(params)
    predicted = [offload_sizing._state_sizes(opt, p, opt.param_groups[0]) for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    created = [
        sorted(v.numel() * v.element_size() for v in opt.state[p].values() if v.dim())
        for p in params
    ]
    assert [sorted(s) for s in predicted] == created


def test_an_unknown_optimizer_counts_only_the_states_it_has(host, caplog):
    class Custom(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("buf", torch.zeros_like(p))

    host.available = 0
    opt = Custom([nn.Parameter(torch.zeros(4))])
    with caplog.at_level(logging.INFO, logger="fczero"):
        fczero.offload_optimizer_states(opt).remove()  # nothing known, nothing refused
    assert "cannot tell the states Custom will create" in caplog.text
    opt.step()
    with pytest.raises(MemoryError, match=r"Custom's states 16 bytes"):
        fczero.offload_optimizer_states(opt)


def test_the_host_step_is_checked_once_before_its_states_exist(host):
    params = [nn.Parameter(torch.zeros(1000)), nn.Parameter(torch.zeros(10))]
    opt = torch.optim.AdamW(params)
    host.available = 2 * 4000 + 2 * 40 - 1  # pageable: exact sizes
    with pytest.raises(MemoryError, match=r"AdamW.step\(\) on the host .* \(8079 bytes\) avail"):
        offload_sizing.check_host_step(opt, params)
    host.available += 1
    offload_sizing.check_host_step(opt, params)
    host.available = 0
    offload_sizing.check_host_step(opt, params)  # checked already: not again


def test_os_readers(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 8 kB\nMemAvailable:    1024 kB\n")
    assert offload_sizing.read_mem_available(str(tmp_path / "meminfo")) == 1024 * 1024
    assert offload_sizing.read_mem_available(str(tmp_path / "missing")) is None
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir()
    v1.mkdir()
    (v2 / "memory.max").write_text("1000000\n")
    (v2 / "memory.current").write_text("600000\n")
    (v2 / "memory.stat").write_text("anon 500000\ninactive_file 100000\n")
    # limit less the working set (usage less inactive file cache)
    assert offload_sizing.read_cgroup_headroom(str(v2), str(v1)) == 500000
    (v2 / "memory.max").write_text("max\n")
    assert offload_sizing.read_cgroup_headroom(str(v2), str(v1)) is None
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory.usage_in_bytes").write_text("1\n")
    assert offload_sizing.read_cgroup_headroom(str(tmp_path / "none"), str(v1)) is None
    (v1 / "memory.limit_in_bytes").write_text("3000\n")
    (v1 / "memory.stat").write_text("inactive_file 5\ntotal_inactive_file 1000\n")
    (v1 / "memory.usage_in_bytes").write_text("2500\n")
    assert offload_sizing.read_cgroup_headroom(str(tmp_path / "none"), str(v1)) == 1500


def test_the_cgroup_limit_wins_when_it_is_lower(monkeypatch):
    monkeypatch.setattr(offload_sizing, "read_mem_available", lambda: 10**9)
    monkeypatch.setattr(offload_sizing, "read_cgroup_headroom", lambda: 10**6)
    assert offload_sizing.available() == (10**6, "the memory cgroup's limit less its working set")
    monkeypatch.setattr(offload_sizing, "read_cgroup_headroom", lambda: None)
    assert offload_sizing.available() == (10**9, "MemAvailable in /proc/meminfo")


def test_sizes_and_rounding():
    assert [offload_sizing.pinned_size(n) for n in (0, 1, 4096, 4097, 2**30 + 1)] == [
        0,
        1,
        4096,
        8192,
        2**31,
    ]
    assert offload_sizing.shard_bytes(torch.Size([13, 5]), 4, 4) == 4 * 5 * 4  # ceil(13 / 4) rows
    assert offload_sizing.shard_bytes(torch.Size([]), 4, 2) == 2  # 0-d: replicated
    assert offload_sizing.size_text(3 * 2**30 + 2**29) == "3.50 GiB (3758096384 bytes)"


def _small_host_on_gpu(rank: int, world_size: int):
    """On a GPU mesh: parallelize, the host step and offload_optimizer_states are each
    refused on a host with 1 MiB available, and go on once the host has room."""
    offload_sizing.read_mem_available = lambda: 2**20
    offload_sizing.read_cgroup_headroom = lambda: None
    mesh = init_device_mesh("cuda", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))
    reference = copy.deepcopy(model)
    out = {}
    try:
        fczero.parallelize(model, mesh, offload_policy=fczero.OffloadPolicy(params=True))
    except MemoryError as err:
        out["parallelize"] = str(err)
    out["model_unchanged"] = not fczero.is_parallelized(model) and all(
        torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters())
    )
    offload_sizing.read_mem_available = lambda: 10**12
    fczero.parallelize(model, mesh, offload_policy=fczero.OffloadPolicy(params=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 512, device="cuda")).sum().backward()
    offload_sizing.read_mem_available = lambda: 2**20
    shards = [p.to_local().clone() for p in model.parameters()]
    try:
        opt.step()
    except MemoryError as err:
        out["host_step"] = str(err)
    out["not_stepped"] = not opt.state and all(
        torch.equal(p.to_local(), s) for p, s in zip(model.parameters(), shards)
    )
    try:
        fczero.offload_optimizer_states(opt, chunk_bytes=2**20)
    except MemoryError as err:
        out["offload_optimizer_states"] = str(err)
    offload_sizing.read_mem_available = lambda: 10**12
    fczero.offload_optimizer_states(opt, chunk_bytes=2**20)
    opt.step()
    out["stepped"] = bool(opt.state)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_mesh_a_small_host_is_refused_at_each_entry():
    for out in run_on_ranks(_small_host_on_gpu, gpu_world_size(), backend="nccl"):
        assert "parallelize(..., offload_policy=OffloadPolicy(params=True)) needs" in out["parallelize"], out
        assert "(1048576 bytes) available" in out["parallelize"], out
        assert out["model_unchanged"], out
        assert "AdamW.step() on the host (param offload) needs" in out["host_step"], out
        assert out["not_stepped"], out
        assert "AdamW's states" in out["offload_optimizer_states"], out
        assert "grads still to come" not in out["offload_optimizer_states"], out  # grads exist
        assert out["stepped"], out
