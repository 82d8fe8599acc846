"""Numerics parity: N ranks under fczero against one process training the whole batch.

Both sides build the model from the same seed, see the same batches (each rank
takes its contiguous slice of the batch dimension) and run the same optimizer. The
distributed side reports the loss averaged over ranks, which equals the reference's
full-batch mean loss when slices are equal, and the final params gathered whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.core.spec import mesh_device
from fczero.offload.params import full_tensor
from fczero.testing.backends import BACKENDS

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Trace:
    """What one training run produced: the loss per step and the final whole params."""

    losses: list[float]
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, -2), target.flatten())


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target.float())


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    raise ValueError(f"unknown optimizer {name!r}; use 'sgd' or 'adamw'")


def _train(
    model: nn.Module,
    step_fn: Callable[[torch.Tensor], torch.Tensor],
    batches: Sequence[Batch],
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: str,
    lr: float,
    reduce_loss: Callable[[torch.Tensor], torch.Tensor],
    configure_optimizer: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> list[float]:
    opt = make_optimizer(optimizer, model.parameters(), lr)
    if configure_optimizer is not None:
        configure_optimizer(opt)
    losses = []
    for inputs, target in batches:
        loss = criterion(step_fn(inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(reduce_loss(loss.detach()).item())
    return losses


def train_reference(
    build: Callable[[], nn.Module],
    batches: Sequence[Batch],
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    optimizer: str = "sgd",
    lr: float = 0.05,
    seed: int = 0,
    device: str = "cpu",
) -> Trace:
    """Single-process training on whole batches."""
    torch.manual_seed(seed)
    model = build().to(device)
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    losses = _train(model, model, batches, criterion, optimizer, lr, lambda t: t)
    return Trace(losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()})


def train_parallel(
    rank: int,
    world_size: int,
    build: Callable[[], nn.Module],
    batches: Sequence[Batch],
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    optimizer: str = "sgd",
    lr: float = 0.05,
    seed: int = 0,
    compile_backend: str | None = None,
    device_type: str = "cpu",
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
    data_axes: tuple[str, ...] | None = None,
    prepare: Callable[[nn.Module, Any], Any] | None = None,
    configure_optimizer: Callable[[torch.optim.Optimizer], Any] | None = None,
    finish: Callable[[nn.Module], Any] | None = None,
    **options: Any,
) -> Trace:
    """One rank of fczero training on its slice of every batch (call inside a process group).

    By default the mesh is 1-d over all ranks and each rank takes its own slice. For
    other meshes (HSDP, tensor parallelism) give ``mesh_shape``/``mesh_dim_names``;
    ``data_axes`` names the axes the batch is split over (ranks that differ only on
    other axes see the same slice), and ``prepare(model, mesh)`` runs before
    ``fczero.parallelize`` (e.g. tensor parallelism's ``parallelize_module``).
    ``configure_optimizer(optimizer)`` runs once the optimizer is built (e.g.
    ``fczero.offload_optimizer_states``). ``finish(model)`` runs right after
    ``fczero.parallelize`` (e.g. ``block.compile()`` for every block).
    """
    torch.manual_seed(seed)
    model = build()
    mesh = init_device_mesh(device_type, mesh_shape or (world_size,), mesh_dim_names=mesh_dim_names)
    if prepare is not None:
        prepare(model, mesh)
    fczero.parallelize(model, mesh, **options)
    if finish is not None:
        finish(model)
    step_fn: Callable[[torch.Tensor], torch.Tensor] = model
    if compile_backend is not None:
        step_fn = torch.compile(model, backend=BACKENDS.get(compile_backend, compile_backend))
    device = mesh_device(mesh)  # (not the params': with param offload they are on the host)
    data_rank, data_size = rank, world_size
    if data_axes is not None:
        data_rank, data_size = 0, 1
        for axis in data_axes:  # row-major over the data axes
            data_rank = data_rank * mesh.size(
                mesh.mesh_dim_names.index(axis)
            ) + mesh.get_local_rank(axis)
            data_size *= mesh.size(mesh.mesh_dim_names.index(axis))
    local = [_slice(b, data_rank, data_size, device) for b in batches]

    def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t / world_size

    losses = _train(
        model, step_fn, local, criterion, optimizer, lr, mean_over_ranks, configure_optimizer
    )
    params = {n: full_tensor(p).detach().cpu() for n, p in model.named_parameters()}
    return Trace(losses, params)


def _slice(batch: Batch, rank: int, world_size: int, device: torch.device) -> Batch:
    inputs, target = batch
    n = inputs.shape[0]
    if n % world_size:
        raise ValueError(f"batch size {n} does not split evenly over {world_size} ranks")
    size = n // world_size
    return (
        inputs[rank * size : (rank + 1) * size].to(device),
        target[rank * size : (rank + 1) * size].to(device),
    )


def assert_close(actual: Trace, expected: Trace, *, rtol: float, atol: float) -> None:
    """Per-step losses and every final param agree within the tolerances."""
    torch.testing.assert_close(
        torch.tensor(actual.losses), torch.tensor(expected.losses), rtol=rtol, atol=atol
    )
    assert actual.params.keys() == expected.params.keys(), (
        f"param names differ: {sorted(actual.params)} vs {sorted(expected.params)}"
    )
    for name, value in expected.params.items():
        torch.testing.assert_close(
            actual.params[name].float(),
            value.float(),
            rtol=rtol,
            atol=atol,
            msg=lambda m: f"{name}: {m}",
        )
