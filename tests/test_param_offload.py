"""Parameter offload (``offload_params=True``): shards and grads in host memory, gathered
through the device, numerics equal to the single-process reference, less device memory.

The host-to-device path needs a GPU: the tests marked ``gpu`` run it (at one rank on a
machine with one GPU). On CPU the option's checks and its no-op on a CPU mesh run.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing import parity
from fczero.testing.distributed import gpu_world_size, run_on_ranks
from tests.models import ThreeBlocks, tiny_llama, token_batches


def test_bad_values_and_combinations_are_refused_before_anything_changes(fake_pg):
    model = ThreeBlocks()
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(TypeError, match="offload_params must be True or False"):
        fczero.parallelize(model, mesh, offload_params="yes")
    with pytest.raises(ValueError, match="offload_params=True needs stage=3"):
        fczero.parallelize(model, mesh, offload_params=True, stage=2)
    assert not fczero.is_parallelized(model)


def test_on_a_cpu_mesh_the_shards_stay_and_it_says_so(fake_pg, caplog):
    with caplog.at_level(logging.INFO, logger="fczero"):
        model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), offload_params=True)
    assert "the mesh is on the CPU, so the shards are there already" in caplog.text
    model(torch.randn(4, 512)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


ADAMW = {"optimizer": "adamw", "lr": 1e-3}


def _llama_run():
    return tiny_llama, token_batches(steps=3), parity.cross_entropy


def _offload_llama(rank: int, world_size: int) -> list[parity.Trace]:
    return [
        parity.train_parallel(
            rank, world_size, *_llama_run(), **ADAMW,
            device_type="cuda", compile_backend=backend, offload_params=True,
        )  # fmt: skip
        for backend in (None, "inductor")
    ]


@pytest.fixture(scope="module")
def offloaded_llama():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return run_on_ranks(_offload_llama, gpu_world_size(), backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "inductor"])
def test_training_matches_the_reference(offloaded_llama, mode):
    """AdamW steps on the host here and on the device in the reference: fp32 tolerance."""
    expected = parity.train_reference(*_llama_run(), **ADAMW, device="cuda")
    for traces in offloaded_llama:
        parity.assert_close(traces[0 if mode == "eager" else 1], expected, rtol=1e-4, atol=1e-5)


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
    peaks = {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = fczero.parallelize(Wide(), mesh, offload_params=offload)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
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
            facts = {
                "local_on_host": all(p.to_local().device.type == "cpu" for p in params),
                "pinned": all(p.to_local().is_pinned() for p in params),
                "states_on_host": all(
                    t.to_local().device.type == "cpu"
                    for s in optimizer.state.values()
                    for t in s.values()
                    if t.dim()
                ),
                "norm_finite": bool(torch.isfinite(norm)),
                "persistent": torch.cuda.memory_allocated() - base,
            }
            with fczero.no_sync(model):  # accumulation with host shards too
                model(x).square().mean().backward()
            model(x).square().mean().backward()
            facts["accumulated_grads_on_host"] = all(
                p.grad is not None and p.grad.to_local().device.type == "cpu" for p in params
            )
        del model, optimizer
    return peaks, facts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shards_grads_and_states_live_on_the_host_and_the_device_peak_drops():
    for peaks, facts in run_on_ranks(_where_things_live, gpu_world_size(), backend="nccl"):
        assert facts["local_on_host"] and facts["pinned"] and facts["states_on_host"], facts
        assert facts["norm_finite"], facts
        assert facts["accumulated_grads_on_host"], facts
        assert facts["persistent"] < 2 * 2**20, facts  # the input only: no param, grad, state
        # without offload: shards, grads and AdamW's two states (4 x 128 MiB / ranks) stay
        assert peaks[True] < 0.5 * peaks[False], peaks
