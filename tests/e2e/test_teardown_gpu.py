"""Tearing the process group down after training under CUDA graphs on two GPUs (skipped
with fewer): ``dist.destroy_process_group()`` returns without the user freeing Inductor's
graphs by hand once the model is gone, and with ``torch.compiler.reset()`` while it is
still held ([Note: tearing down after CUDA graphs] in fczero/core/cuda_graphs.py).

Each case runs on two NCCL ranks in their own processes (``run_on_ranks``), which call
``destroy_process_group`` themselves; a rank still inside it when the timeout ends is
killed and the test fails (before the fix both ranks waited there forever).
"""

from __future__ import annotations

import time

import pytest
import torch

from fczero.testing.distributed import run_on_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

#: Seconds a case may take in all: compiling and capturing take tens of seconds; a hung
#: ``destroy_process_group`` never ends.
TIMEOUT_S = 300.0


def _train_then_destroy(rank: int, world_size: int, keep_model: bool) -> dict:
    """Train a small model under ``torch.compile(mode="reduce-overhead")``, then destroy the
    process group: after the model is freed (``keep_model=False``), or while it is still
    held, after ``torch.compiler.reset()``. Never calls fczero's own release."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fczero
    from fczero.core.cuda_graphs import trees_in_use
    from tests.models import ThreeBlocks

    device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (world_size,))

    def train() -> tuple:
        torch.manual_seed(0)
        model = fczero.parallelize(ThreeBlocks(256), mesh)
        compiled = torch.compile(model, mode="reduce-overhead")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(4):  # warm-up, capture, then replays
            torch.compiler.cudagraph_mark_step_begin()
            x = torch.randn(
                64, 256, device=device, generator=torch.Generator(device).manual_seed(step)
            )
            compiled(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return model, compiled, opt

    trained = train()
    captured = trees_in_use(device)  # graphs that hold the communicator were captured
    if keep_model:
        torch.compiler.reset()  # the one case that asks for a call: the model is still held
    else:
        del trained  # (as returning from a training function does)
    released = not trees_in_use(device)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    dist.destroy_process_group()
    return {"captured": captured, "released": released, "destroy_s": time.perf_counter() - start}


@pytest.mark.parametrize("keep_model", [False, True], ids=["model-freed", "model-held-reset"])
def test_destroy_process_group_returns_after_cuda_graphs(keep_model):
    results = run_on_ranks(
        _train_then_destroy, 2, keep_model, backend="nccl", timeout_s=TIMEOUT_S
    )  # (a rank hung in destroy_process_group raises TimeoutError here)
    for rank, result in enumerate(results):
        assert result["captured"], f"rank {rank} captured no CUDA graph: nothing was tested"
        assert result["released"], f"rank {rank} still holds CUDA graphs before the teardown"
        assert result["destroy_s"] < 60.0, result
