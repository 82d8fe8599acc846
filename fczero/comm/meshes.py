"""Which mesh axes shard, which replicate, and which belong to tensor parallelism.

[Note: mesh roles]
``parallelize(model, mesh, axis=..., replicate_axis=...)`` gives mesh axes roles:

* the *shard* axis (``axis``): each param is split along dim 0 over its ranks; the
  gather and the reduce-scatter run on this axis's process group;
* the *replicate* axis (``replicate_axis``, HSDP): every shard-axis group holds a full
  copy of the sharded params; the reduce-scattered grad is then averaged over this
  axis with an all-reduce;
* any other axis is left to the user. A param that is already a DTensor (tensor
  parallelism, ``torch.distributed.tensor.parallel.parallelize_module``) must live on
  such axes only, as a sub-mesh of ``mesh``.

Every sharded param is a DTensor on the sub-mesh of the axes it lives on, in the
order of ``mesh``'s axes: ``Replicate()`` on the replicate axis, ``Shard(0)`` on the
shard axis, and the tensor-parallel placements on the tensor-parallel axes. When
the shard axis and a tensor-parallel axis to its right both split dim 0, the shard
axis splits each tensor-parallel piece (right to left), which DTensor spells
``_StridedShard(0, split_factor=<tp pieces of dim 0>)``; with that, ``full_tensor()``
and ``state_dict()`` see the right whole tensor.

A tensor-parallel param is sharded from its *local* tensor, and the module sees, on
access, ``DTensor.from_local(gathered local, tp mesh, tp placements)``: the same
DTensor the tensor-parallel plan made, so its hooks and DTensor ops work unchanged.
"""

from __future__ import annotations

import gc
import itertools
import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "MeshLayout",
    "ParamLayout",
    "TensorParallelView",
    "check_device_available",
    "cuda_unavailable_reason",
    "resolve_mesh",
    "root_group_name",
]


@dataclass(frozen=True)
class TensorParallelView:
    """How to show a module a tensor-parallel param: its mesh, placements and global shape."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def wrap(self, local: torch.Tensor) -> DTensor:
        """The gathered local tensor as the DTensor the tensor-parallel plan made (differentiable)."""
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


@dataclass(frozen=True)
class ParamLayout:
    """Where one sharded param lives: its mesh, its placements, and what its gather needs."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]  # the placements of a param with dim >= 1
    scalar_placements: tuple[Placement, ...]  # a 0-d param: replicated on the shard axis too
    replicate: tuple[int, str] | None  # (size, group name) of the replicate axis, HSDP only
    tensor_parallel: TensorParallelView | None


@dataclass(frozen=True)
class MeshLayout:
    """The roles of the given mesh's axes (see [Note: mesh roles])."""

    mesh: DeviceMesh
    shard_axis: str | None  # None: a 1-d mesh without names
    replicate_axis: str | None

    @property
    def shard_mesh(self) -> DeviceMesh:
        return self.mesh if self.shard_axis is None else _sub(self.mesh, (self.shard_axis,))

    @property
    def replicate_mesh(self) -> DeviceMesh | None:
        return None if self.replicate_axis is None else _sub(self.mesh, (self.replicate_axis,))

    def check_param(self, name: str, param: torch.Tensor) -> None:
        """Raise if ``param`` (a DTensor) is not a tensor-parallel param fczero can shard here."""
        if not isinstance(param, DTensor):
            return
        pmesh, names = param.device_mesh, param.device_mesh.mesh_dim_names
        given = self.mesh.mesh_dim_names
        if not names or not given:
            raise ValueError(
                f"fczero: parameter {name!r} is a DTensor on a mesh without axis names; build "
                "one mesh with named axes, e.g. init_device_mesh(..., (dp, tp), "
                "mesh_dim_names=('dp', 'tp')), apply tensor parallelism on mesh['tp'] and "
                "pass that same mesh to parallelize with axis='dp'."
            )
        taken = {self.shard_axis, self.replicate_axis} & set(names)
        if taken:
            axis = min(taken)
            raise ValueError(
                f"fczero: parameter {name!r} is already distributed over mesh axis {axis!r}, "
                f"which parallelize was asked to use for data parallelism (axis="
                f"{self.shard_axis!r}, replicate_axis={self.replicate_axis!r}). Apply tensor "
                "parallelism on a different axis, or pass the other axis name to parallelize."
            )
        unknown = [n for n in names if n not in given]
        in_order = list(names) == sorted(names, key=lambda n: given.index(n) if n in given else 0)
        if unknown or not in_order or not _same_ranks(_sub(self.mesh, names), pmesh):
            raise ValueError(
                f"fczero: parameter {name!r} is a DTensor on mesh {pmesh} (axes {names}), which "
                f"is not a sub-mesh of the mesh given to parallelize (axes {given}). Apply "
                "tensor parallelism on mesh[<tp axis>] of the very mesh you pass to parallelize."
            )
        for axis, placement in zip(names, param.placements):
            if type(placement) not in (Shard, Replicate):
                raise ValueError(
                    f"fczero: parameter {name!r} has placement {placement} on mesh axis "
                    f"{axis!r}; fczero composes with Shard(dim) and Replicate() tensor-parallel "
                    "params only."
                )

    def for_param(self, param: torch.Tensor) -> ParamLayout:
        """The layout of the sharded param made from ``param`` (checked by ``check_param``)."""
        roles: dict[str, Placement] = {}
        if self.replicate_axis is not None:
            roles[self.replicate_axis] = Replicate()
        tp = None
        if isinstance(param, DTensor):
            tp_names = param.device_mesh.mesh_dim_names
            roles.update(zip(tp_names, param.placements))
            tp = TensorParallelView(
                param.device_mesh, tuple(param.placements), param.shape, param.stride()
            )
        replicate = None
        if self.replicate_axis is not None:
            rep = self.replicate_mesh
            replicate = (rep.size(), rep.get_group().group_name)
        if self.shard_axis is None:  # a 1-d mesh without names: nothing else can be on it
            return ParamLayout(self.mesh, (Shard(0),), (Replicate(),), replicate, tp)
        order = [n for n in self.mesh.mesh_dim_names if n in roles or n == self.shard_axis]
        mesh = _sub(self.mesh, tuple(order))
        at = order.index(self.shard_axis)
        # pieces of dim 0 made by tensor-parallel axes to the right of the shard axis
        split = math.prod(
            mesh.size(i)
            for i, n in enumerate(order)
            if i > at and isinstance(roles[n], Shard) and roles[n].dim == 0
        )
        dp = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
        placements = tuple(dp if n == self.shard_axis else roles[n] for n in order)
        scalar = tuple(Replicate() if n == self.shard_axis else roles[n] for n in order)
        return ParamLayout(mesh, placements, scalar, replicate, tp)


def resolve_mesh(
    mesh: DeviceMesh, axis: str | int | None, replicate_axis: str | int | None
) -> MeshLayout:
    """Check ``axis`` / ``replicate_axis`` against ``mesh`` and name their roles."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            "fczero.parallelize needs a DeviceMesh, e.g. "
            "torch.distributed.device_mesh.init_device_mesh('cuda', (world_size,)); "
            f"got {type(mesh).__name__}."
        )
    check_device_available(mesh.device_type)
    names = mesh.mesh_dim_names
    if replicate_axis is not None:
        if mesh.ndim < 2:
            raise ValueError(
                f"fczero: replicate_axis={replicate_axis!r} needs a mesh with a replicate axis "
                "and a shard axis, e.g. init_device_mesh(..., (replicas, shards), "
                "mesh_dim_names=('replicate', 'shard')); this mesh has 1 axis."
            )
        replicate_axis = _axis_name(mesh, replicate_axis, "replicate_axis")
        if axis is None:
            raise ValueError(
                f"fczero: with replicate_axis={replicate_axis!r}, name the shard axis too: "
                f"parallelize(..., axis=<one of {names}>, replicate_axis={replicate_axis!r})."
            )
    if mesh.ndim == 1:
        if axis not in (None, 0) and not (names and axis == names[0]):
            raise ValueError(
                f"fczero: axis={axis!r} is not an axis of this 1-d mesh (axis names: "
                f"{names or 'none'}); leave axis unset."
            )
        return MeshLayout(mesh, names[0] if names else None, None)
    if axis is None:
        raise ValueError(
            f"fczero: the mesh has {mesh.ndim} axes (names: {names or 'none'}); say which one is "
            "data-parallel with parallelize(..., axis=<name or index>)."
        )
    axis = _axis_name(mesh, axis, "axis")
    if axis == replicate_axis:
        raise ValueError(
            f"fczero: axis and replicate_axis are both {axis!r}; shard over one mesh axis and "
            "replicate over another (HSDP), e.g. axis='shard', replicate_axis='replicate'."
        )
    return MeshLayout(mesh, axis, replicate_axis)


def check_device_available(device_type: str) -> None:
    """Raise a clear error for a "cuda" mesh on a machine where CUDA is not available.

    ``init_device_mesh("cuda", ...)`` on a CPU-only build of torch fails inside
    ``torch.cuda.set_device`` with ``module 'torch._C' has no attribute
    '_cuda_setDevice'``, which names neither the cause nor the fix. ``parallelize``
    (through ``resolve_mesh``) and the main job check first and say what to do.
    """
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f'fczero: a "cuda" mesh needs CUDA, and {cuda_unavailable_reason()}. To train '
            'on the CPU, use gloo and a CPU mesh: dist.init_process_group("gloo") and '
            'init_device_mesh("cpu", (world_size,)). To train on GPUs, run on a machine '
            "with a GPU and a CUDA build of torch."
        )


def cuda_unavailable_reason() -> str:
    """Why ``torch.cuda.is_available()`` is False here, in words."""
    if torch.version.cuda is None:
        return "this torch is a CPU-only build (torch.version.cuda is None)"
    return "no CUDA GPU is visible to this torch (check the driver and CUDA_VISIBLE_DEVICES)"


def _axis_name(mesh: DeviceMesh, axis: str | int, what: str) -> str:
    names = mesh.mesh_dim_names
    if isinstance(axis, int):
        if not 0 <= axis < mesh.ndim:
            raise ValueError(f"fczero: {what}={axis} is out of range for a {mesh.ndim}-axis mesh.")
        if not names:
            raise ValueError(
                f"fczero: pick {'an axis' if what == 'axis' else what} of a multi-axis mesh by "
                "name; build the mesh with mesh_dim_names=(...)."
            )
        return names[axis]
    if not names or axis not in names:
        raise ValueError(f"fczero: {what}={axis!r} is not one of the mesh's axes {names}.")
    return axis


def _sub(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    if tuple(mesh.mesh_dim_names or ()) == names:
        return mesh
    return mesh[names[0]] if len(names) == 1 else mesh[names]


def _same_ranks(a: DeviceMesh, b: DeviceMesh) -> bool:
    return a.device_type == b.device_type and torch.equal(a.mesh, b.mesh)


# [Note: a root's group name]
# A compiled graph names the process groups of its collectives and nothing else, so the
# graphs of two models parallelized on one group could not tell whose pass settings
# apply ([Note: from a graph to its root] in ``fczero/passes/registry.py``). So each
# root's own collectives (the gathers, reduces and all-reduces of its ``ShardSpec``s)
# carry a name of the group that no other live root uses: the group's own name while no
# other model parallelized on it is alive (the usual case: one model per group, or one
# after another), else ``<name>.fczero.<n>`` with the smallest free ``n``, registered
# with c10d's group registry as another name of the same group. The functional
# collectives find their group by name, so the collectives, the communicator and their
# order are unchanged. Whether an earlier model is alive is asked after a garbage
# collection, so it depends on what the program still references, the same on every
# rank; and nothing that ranks compare depends on the name: the cross-rank graph check
# keys its exchanges by the group's own name (``fczero.comm.consistency``). A registered
# name lasts until the default process group is destroyed (``destroy_process_group()``
# forgets every name).
_ROOTS_ON: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, weakref.ref]] = (
    weakref.WeakKeyDictionary()
)


def group_over_the_same_ranks(mesh: DeviceMesh, asked_by: str) -> str:
    """The name of a new process group over the ranks of ``mesh`` (a second communicator
    between them), made on every rank alike: ``new_group`` is collective over all ranks,
    so ``mesh`` must span them (``asked_by`` names the option, for the error)."""
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(
            f"fczero: {asked_by} needs the data-parallel axis to span every rank (it has "
            f"{mesh.size()} of {world}); drop the option, or shard over all ranks."
        )
    return dist.new_group(ranks=dist.get_process_group_ranks(mesh.get_group())).group_name


def root_group_name(group: dist.ProcessGroup, root: nn.Module) -> str:
    """The name the collectives of ``root``, one more model parallelized on ``group``, carry
    ([Note: a root's group name]); registered as a name of ``group`` where it is not the
    group's own."""
    taken = _ROOTS_ON.setdefault(group, {})
    if any(ref() is not None for ref in taken.values()):
        gc.collect()  # a dropped model held in a reference cycle frees its name now
    n = next(i for i in itertools.count() if taken.get(i) is None or taken[i]() is None)
    taken[n] = weakref.ref(root)
    if n == 0:
        return group.group_name
    name = f"{group.group_name}.fczero.{n}"
    _unregister_process_group(name)  # (of an earlier group of the same name, if any)
    _register_process_group(name, group)
    return name
