"""Parameter offload (``offload_params=True``): shards and grads in host memory, gathered
through the device, numerics equal to the single-process reference, less device memory.

The host-to-device path needs a GPU: the tests marked ``gpu`` run it (at one rank on a
machine with one GPU). On CPU the option's checks and its no-op on a CPU mesh run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing import parity
from fczero.testing.distributed import gpu_world_size, run_on_ranks
from tests.models import ThreeBlocks, tiny_llama, token_batches

OFFLOAD = fczero.OffloadPolicy(params=True)


def test_bad_values_and_combinations_are_refused_before_anything_changes(fake_pg):
    model = ThreeBlocks()
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(ValueError, match="OffloadPolicy.params needs stage=3"):
        fczero.parallelize(model, mesh, offload_policy=fczero.OffloadPolicy(params=True), stage=2)
    assert not fczero.is_parallelized(model)


def test_on_a_cpu_mesh_the_shards_stay_and_it_warns(fake_pg):
    with pytest.warns(RuntimeWarning, match="on a CPU mesh changes nothing"):
        model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), offload_policy=OFFLOAD)
    model(torch.randn(4, 512)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


ADAMW = {"optimizer": "adamw", "lr": 1e-3}


def _llama_run():
    return tiny_llama, token_batches(steps=3), parity.cross_entropy


def _device_step(optimizer: torch.optim.Optimizer) -> None:
    """The step on the device, in chunks of about 3 of tiny_llama's 64 x 64 weights."""
    handle = fczero.offload_optimizer_states(optimizer, chunk_bytes=3 * 64 * 64 * 4)
    assert handle.device_step


STEPS = {"host step": None, "device step": _device_step}


def _offload_llama(rank: int, world_size: int) -> list[parity.Trace]:
    return [
        parity.train_parallel(
            rank, world_size, *_llama_run(), **ADAMW,
            device_type="cuda", compile_backend=backend, offload_policy=OFFLOAD,
            configure_optimizer=STEPS[step],
        )  # fmt: skip
        for backend in (None, "inductor")
        for step in STEPS
    ]


@pytest.fixture(scope="module")
def offloaded_llama():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return run_on_ranks(_offload_llama, gpu_world_size(), backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("mode", ["eager", "inductor"])
def test_training_matches_the_reference(offloaded_llama, mode, step):
    """AdamW steps on the host (or on the device, a chunk at a time) here and on the device
    in the reference: fp32 tolerance."""
    expected = parity.train_reference(*_llama_run(), **ADAMW, device="cuda")
    index = 2 * ["eager", "inductor"].index(mode) + list(STEPS).index(step)
    for traces in offloaded_llama:
        parity.assert_close(traces[index], expected, rtol=1e-4, atol=1e-5)


class Wide(nn.Module):
    """Eight 2048 x 2048 layers: 128 MiB of fp32 params, so the persistent state shows."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2048, 2048) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _where_things_live(rank: int, world_size: int):
    mesh = init_device_mesh("cuda", (world_size,))
    peaks, facts = {}, {}
    for offload in (False, "host step", "device step"):
        torch.manual_seed(0)
        model = fczero.parallelize(Wide(), mesh, offload_policy=fczero.OffloadPolicy(params=bool(offload)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if offload == "device step":  # chunks of one layer's shards
            fczero.offload_optimizer_states(optimizer, chunk_bytes=2048 * 2049 * 4 // world_size)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        x = torch.randn(64, 2048, device="cuda")
        for _ in range(2):
            model(x).square().mean().backward()
            norm = fczero.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
        peaks[offload] = torch.cuda.max_memory_allocated() - base
        if offload:
            params = list(model.parameters())
            facts[offload] = {
                "local_on_host": all(p.to_local().device.type == "cpu" for p in params),
                "pinned": all(p.to_local().is_pinned() for p in params),
                "states_on_host": all(
                    t.to_local().device.type == "cpu"
                    for s in optimizer.state.values()
                    for t in s.values()
                    if t.dim()
                ),
                "states_pinned": all(
                    t.to_local().is_pinned() for s in optimizer.state.values() for t in s.values() if t.dim()
                ),
                "norm_finite": bool(torch.isfinite(norm)),
                "persistent": torch.cuda.memory_allocated() - base,
            }
            with fczero.no_sync(model):  # accumulation with host shards too
                model(x).square().mean().backward()
            model(x).square().mean().backward()
            facts[offload]["accumulated_grads_on_host"] = all(
                p.grad is not None and p.grad.to_local().device.type == "cpu" for p in params
            )
        del model, optimizer
    return peaks, facts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shards_grads_and_states_live_on_the_host_and_the_device_peak_drops():
    for peaks, by_step in run_on_ranks(_where_things_live, gpu_world_size(), backend="nccl"):
        print(peaks, by_step)
        for step, facts in by_step.items():
            assert facts["local_on_host"] and facts["pinned"], (step, facts)
            assert facts["states_on_host"], (step, facts)
            assert step == "host step" or facts["states_pinned"], (step, facts)
            assert facts["norm_finite"], (step, facts)
            assert facts["accumulated_grads_on_host"], (step, facts)
            # the input only: no param, grad or state stays on the device
            assert facts["persistent"] < 2 * 2**20, (step, facts)
            # without offload: shards, grads and AdamW's two states (4 x 128 MiB / ranks)
            # stay; the device step holds two chunks of one layer (an eighth each) at most
            assert peaks[step] < 0.5 * peaks[False], peaks


def _compiled_grads_are_pinned(rank: int, world_size: int) -> list[bool]:
    mesh = init_device_mesh("cuda", (world_size,))
    torch.manual_seed(0)
    model = fczero.parallelize(Wide(), mesh, offload_params=True)
    compiled = torch.compile(model)
    x = torch.randn(64, 2048, device="cuda")
    compiled(x).square().mean().backward()
    torch.cuda.synchronize()
    return [p.grad.to_local().is_pinned() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_backward_puts_grads_in_pinned_memory():
    """Compiled as eager: every grad lands in pinned host memory ([Note: the grad's host
    buffer is an op]; torch 2.11's Inductor otherwise allocates it pageable)."""
    for pinned in run_on_ranks(_compiled_grads_are_pinned, gpu_world_size(), backend="nccl"):
        assert pinned and all(pinned), pinned
