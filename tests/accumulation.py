"""Gradient accumulation on one rank, as the tests share it: ``train_accumulating`` trains
a model (the uneven MLP, the tiny Llama or the checkpointed GQA Llama, picked by
``accumulation_setup``) on K
micro-batches a step under fczero, turning gradient sync off in one of three ways, and
returns its trace for the single-process reference to check. tests/runtime/test_accumulation.py
runs it on gloo and NCCL ranks, tests/core/test_unsharding.py with params kept unsharded."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.testing import parity
from fczero.testing.backends import BACKENDS
from tests.cases import BLOCKS
from tests.models import UnevenTiedMLP, mlp_batches, tiny_gqa, tiny_llama, token_batches


def accumulation_setup(model: str):
    if model == "mlp":
        return UnevenTiedMLP, mlp_batches(steps=3), parity.mse
    if model == "gqa":  # tied, every block checkpointed
        return functools.partial(tiny_gqa, "full"), token_batches(steps=3), parity.cross_entropy
    return tiny_llama, token_batches(steps=3), parity.cross_entropy


def train_accumulating(
    rank: int,
    world_size: int,
    model_name: str,
    stage: int,
    backend: str | None,
    k: int,
    api: str,
    device_type: str = "cpu",
    **options,
) -> tuple[parity.Trace, list[int]]:
    """One rank: every batch as K micro-batches, reduce on the last. ``api`` picks how sync
    is turned off: "context" (fczero.no_sync around forward and backward), "flag"
    (set_requires_gradient_sync) or "late" (only the forwards inside no_sync; their
    backwards run after the block). Returns the trace and the compiled-frame count
    after each step (constant after the first step: no recompiles). ``backend``
    ``blocks:<backend>`` compiles each block on its own instead of the whole model.
    ``options`` go to ``fczero.parallelize``."""
    build, batches, criterion = accumulation_setup(model_name)
    torch.manual_seed(0)
    model = build()
    fczero.parallelize(
        model, init_device_mesh(device_type, (world_size,)), stage=stage, **options
    )
    device = next(model.parameters()).device
    counter = None
    step_fn = model
    if backend is not None and backend.startswith(BLOCKS):  # each block compiled on its own
        name = backend[len(BLOCKS) :]
        counter = CompileCounterWithBackend(BACKENDS.get(name, name))
        fczero.compile_blocks(model, backend=counter)
    elif backend is not None:
        counter = CompileCounterWithBackend(BACKENDS.get(backend, backend))
        step_fn = torch.compile(model, backend=counter)
    opt = parity.make_optimizer("sgd", model.parameters(), 0.05)
    losses, frames = [], []
    for batch in batches:
        inputs, target = parity._slice(batch, rank, world_size, device)
        micro = list(zip(inputs.chunk(k), target.chunk(k)))
        total = torch.zeros((), device=device)
        if api == "late":
            with fczero.no_sync(model):
                pending = [criterion(step_fn(x), y) / k for x, y in micro[:-1]]
            for loss in pending:
                loss.backward()
                total += loss.detach()
        else:
            for i, (x, y) in enumerate(micro[:-1]):
                if api == "flag":
                    fczero.set_requires_gradient_sync(model, False)
                    loss = criterion(step_fn(x), y) / k
                    loss.backward()
                else:
                    with fczero.no_sync(model):
                        loss = criterion(step_fn(x), y) / k
                        loss.backward()
                total += loss.detach()
            fczero.set_requires_gradient_sync(model, True)
        x, y = micro[-1]
        loss = criterion(step_fn(x), y) / k
        loss.backward()
        total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append((total / world_size).item())
        frames.append(counter.frame_count if counter is not None else 0)
    params = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
    return parity.Trace(losses, params), frames
