"""Mesh roles (fczero/comm/meshes.py): which axis shards, which replicates, which is
tensor-parallel, the placements a sharded param gets, and the errors for axes that do
not fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fczero
from fczero.comm.meshes import resolve_mesh, root_group_name
from tests.models import TwoLayer


def _assert_untouched(model: nn.Module) -> None:
    assert not fczero.is_parallelized(model)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def _mesh(n: int = 2):
    return init_device_mesh("cpu", (n,))


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_wrong_mesh_axes(fake_pg):
    model = TwoLayer()
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
    with pytest.raises(ValueError, match=r"axis=5 is out of range for a 2-axis mesh"):
        fczero.parallelize(model, named, axis=5)
    with pytest.raises(ValueError, match=r"pick an axis of a multi-axis mesh by name"):
        fczero.parallelize(model, init_device_mesh("cpu", (2, 2)), axis=1)
    with pytest.raises(ValueError, match=r"axis='dp' is not an axis of this 1-d mesh"):
        fczero.parallelize(model, _mesh(4), axis="dp")
    _assert_untouched(model)


def test_mesh_larger_than_the_world(fake_pg):
    # torch itself refuses a mesh of more ranks than the process group has
    with pytest.raises(RuntimeError, match=r"Mesh should not be bigger than default world size"):
        init_device_mesh("cpu", (4,))


def test_cuda_mesh_without_cuda(fake_pg, monkeypatch):
    # init_device_mesh("cuda", ...) itself fails first on a CPU-only torch, with torch's
    # "no attribute '_cuda_setDevice'"; a cuda mesh built without its backend reaches here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mesh = DeviceMesh("cuda", [0, 1], _init_backend=False)
    model = TwoLayer()
    with pytest.raises(ValueError, match=r'a "cuda" mesh needs CUDA, .* init_device_mesh\("cpu"'):
        fczero.parallelize(model, mesh)
    _assert_untouched(model)


def test_param_already_a_dtensor_on_the_data_parallel_mesh(fake_pg):
    # A DTensor param must be tensor-parallel, on another named axis of the same mesh.
    model = TwoLayer()
    mesh = _mesh()
    model.fc2.weight = nn.Parameter(distribute_tensor(model.fc2.weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match=r"'fc2.weight' is a DTensor on a mesh without axis names"):
        fczero.parallelize(model, mesh)
    assert not fczero.is_parallelized(model)


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_hsdp_layout_replicates_then_shards(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    layout = resolve_mesh(mesh, "shard", "replicate")
    assert (layout.shard_axis, layout.replicate_axis) == ("shard", "replicate")
    assert layout.shard_mesh.mesh_dim_names == ("shard",)
    assert layout.replicate_mesh.mesh_dim_names == ("replicate",)
    param = layout.for_param(torch.zeros(4, 3))
    assert param.placements == (Replicate(), Shard(0))  # in the mesh's axis order
    assert param.scalar_placements == (Replicate(), Replicate())
    assert param.replicate == (2, layout.replicate_mesh.get_group().group_name)
    assert param.tensor_parallel is None


def test_a_one_axis_mesh_shards_over_its_only_axis(fake_pg):
    layout = resolve_mesh(_mesh(), None, None)
    assert layout.shard_axis is None and layout.replicate_mesh is None
    param = layout.for_param(torch.zeros(4))
    assert param.placements == (Shard(0),) and param.scalar_placements == (Replicate(),)
    assert param.replicate is None


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_shard_axis_left_of_a_row_split_tensor_parallel_axis_strides(fake_pg):
    # dp splits each of tp's two row pieces: DTensor's _StridedShard(0, split_factor=2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    weight = distribute_tensor(torch.zeros(8, 4), mesh["tp"], [Shard(0)])
    layout = resolve_mesh(mesh, "dp", None)
    layout.check_param("w", weight)  # a tensor-parallel param on another axis: accepted
    param = layout.for_param(weight)
    dp, tp = param.placements
    assert type(dp).__name__ == "_StridedShard" and dp.split_factor == 2
    assert tp == Shard(0)
    assert param.tensor_parallel.shape == torch.Size([8, 4])
    with pytest.raises(ValueError, match=r"already distributed over mesh axis 'tp'"):
        resolve_mesh(mesh, "tp", None).check_param("w", weight)


def test_a_root_gets_its_groups_own_name_unless_another_root_on_it_lives(fake_pg):
    """[Note: a root's group name]: the group's own name while no other root on the group is
    alive, else the smallest free registered name of the same group; a name frees when its
    root goes, also one held in a reference cycle."""
    group = _mesh().get_group()
    own = group.group_name
    first, second = nn.Linear(1, 1), nn.Linear(1, 1)
    assert root_group_name(group, first) == own
    assert root_group_name(group, second) == f"{own}.fczero.1"
    assert torch.distributed.distributed_c10d._resolve_process_group(f"{own}.fczero.1") is group
    first.cycle = first  # freed only by the garbage collector
    del first
    third = nn.Linear(1, 1)
    assert root_group_name(group, third) == own  # the first, collected, left it free
    assert root_group_name(group, nn.Linear(1, 1)) == f"{own}.fczero.2"  # 1: the second's
