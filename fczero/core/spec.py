"""A sharded param's layout (``ShardSpec``) and its gather: how a whole tensor is split into
this rank's shard, and how the shards become the unsharded param again.

[Note: sharded and unsharded params]
The module owns the *sharded param*: an ``nn.Parameter`` DTensor with ``Shard(0)`` on
the data-parallel axis, so ``parameters()``, ``state_dict()`` and every optimizer see
only shards. Its local tensor follows DTensor's ``torch.chunk`` layout (rank r holds
rows ``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / world)``), which is what
``full_tensor()``, ``state_dict()`` and distributed checkpointing expect.

The gather pads every local shard to ``c`` rows, so all ranks all-gather the same
number of elements, then drops the padding rows. A 0-d param cannot be split along
dim 0: it is ``Replicate()`` and its grad is all-reduced.

With HSDP or tensor parallelism the sharded param lives on a larger mesh and a
tensor-parallel param is split from its local tensor; ``fczero.comm.meshes`` says where
([Note: mesh roles]), and ``shard_tensor`` takes that as a ``ParamLayout``.

[Note: what a compiled gather reads]
Dynamo guards every Python value the traced getter reads, per param, and an object that
two params reach (the shared ``Options``, the root's state) costs one more guard
per param that checks the two are still the same object: a Python lambda, evaluated on
every call of the compiled model. So the path a compiled gather traces reads only the
param's own ``ShardSpec`` and ``ParamState`` and the values copied into them (the dtypes,
``reshard_after_forward``, the sync flag), and ``to_local()`` takes its grad placements
from the param itself rather than from ``param.placements``.

Every constant the gather itself needs is one plain tuple of Python literals,
``ShardSpec.traced`` (``GatherConstants``), which Dynamo guards with one equality check;
read as attributes of the spec, the same values cost a guard each. For the 16-block toy
of ``bench.host_cost`` (115 params) that took the compiled forward's guards from 248 us
to 117 us per call on a 2-core CPU (the plain model's: 24 us).

The flags that choose the path (sync on, nothing accumulated, no whole copy, not kept
unsharded) are folded the same way: ``ParamState.traced`` is the spec's tuple while
all of them allow the plain gather and None otherwise, kept current by the state's
setters. The getter reads that one attribute and the leaf; only a param off the plain
path reads the flags themselves. On the same toy the forward's guard check fell from
115 to 65 us (the plain model's: 31 us; ``guard_manager.check`` timed alone).
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from fczero.comm import collectives
from fczero.comm.flat import FlatLayout
from fczero.core.config import Options
from fczero.core.streams import to_device

if TYPE_CHECKING:
    from fczero.comm.meshes import ParamLayout, TensorParallelView

logger = logging.getLogger("fczero")


#: What a gather needs, as a plain tuple of Python literals, in this order ([Note: what
#: a compiled gather reads]; a named tuple would be guarded field by field):
#: plain (neither 0-d nor tensor-parallel: the path ``gather_traced`` takes), recompute
#: (stage 3: backward gathers again rather than save the result), rows_per_rank, rows
#: (the unsharded dim 0), group_size, group_name, param_dtype, reduce_dtype, replicate,
#: compute_device, reduce_group (None: the reduce-scatter runs on group_name).
GatherConstants = tuple


def gather_with(local: torch.Tensor, c: GatherConstants) -> torch.Tensor:
    """This rank's local shard -> the unsharded param (pad, cast, all-gather, unpad)."""
    rows_per_rank, rows, group_size, group_name = c[2:6]
    param_dtype, reduce_dtype, replicate, device, reduce_group = c[6:]
    if device is not None:
        local = to_device(local, device)  # param offload: from the host
    local = collectives.pad_rows(local, rows_per_rank)
    full = collectives.gather_shard(
        local, group_size, group_name, param_dtype, reduce_dtype, replicate, reduce_group
    )
    return full if full.shape[0] == rows else full.narrow(0, 0, rows)


def gather_traced(local: torch.Tensor, c: GatherConstants) -> torch.Tensor:
    """The gather a compiled graph traces: tagged for recomputation under stage 3 (``c[1]``),
    so the partitioner gathers again in backward rather than save the unsharded param."""
    if not c[1]:
        return gather_with(local, c)
    return checkpoint(gather_with, local, c, use_reentrant=False, context_fn=recompute_everything)


@dataclass(frozen=True)
class ShardSpec:
    """What the gather of one sharded param needs; identical on every rank but ``local_rows``."""

    shape: torch.Size  # the unsharded param's shape
    rows_per_rank: int  # c: padded dim-0 size of every shard
    local_rows: int  # rows this rank really holds (<= c)
    group_size: int
    group_name: str
    options: Options
    keep_unsharded: bool = False  # selective unsharding: see fczero/core/unsharding.py
    replicate: tuple[int, str] | None = None  # HSDP: (size, group name) of the replicate axis
    tensor_parallel: TensorParallelView | None = None  # shows the module a TP DTensor
    # param offload: the shard lives on the host; gathers copy it to this device first
    compute_device: torch.device | None = None
    # CommPolicy.separate_reduce_group: the name of the group the reduce-scatters run on
    # (the same ranks); None: they run on ``group_name``
    reduce_group: str | None = None
    # copied from ``options`` ([Note: what a compiled gather reads])
    param_dtype: torch.dtype | None = field(init=False, repr=False, compare=False)
    reduce_dtype: torch.dtype | None = field(init=False, repr=False, compare=False)
    reshard_after_forward: bool = field(init=False, repr=False, compare=False)
    traced: GatherConstants = field(init=False, repr=False, compare=False)
    # shard dtype -> this param's place in a flat gather (made once, read on every eager step)
    _flat_layouts: dict = field(init=False, repr=False, compare=False, default_factory=dict)
    # the path of the unit the param belongs to (``fczero.runtime.units``; set once, when
    # units are built): an eager bucket never holds params of two units
    unit_path: str | None = field(init=False, repr=False, compare=False, default=None)

    def join_unit(self, path: str) -> None:
        """Record the unit this param belongs to (``fczero.runtime.units.build_units``)."""
        object.__setattr__(self, "unit_path", path)

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", self.options.mp.param_dtype)
        object.__setattr__(self, "reduce_dtype", self.options.mp.reduce_dtype)
        object.__setattr__(self, "reshard_after_forward", self.options.reshard_after_forward)
        traced = (
            self.tensor_parallel is None and len(self.shape) > 0,
            self.reshard_after_forward and not self.keep_unsharded,
            self.rows_per_rank,
            self.shape[0] if len(self.shape) > 0 else 0,
            self.group_size,
            self.group_name,
            self.param_dtype,
            self.reduce_dtype,
            self.replicate,
            self.compute_device,
            self.reduce_group,
        )
        object.__setattr__(self, "traced", traced)

    @property
    def reduce_group_name(self) -> str:
        """The group the grads are reduce-scattered on."""
        return self.reduce_group or self.group_name

    @property
    def is_scalar(self) -> bool:
        return len(self.shape) == 0

    def flat_layout(self, shard_dtype: torch.dtype) -> FlatLayout:
        """Where this param's shard lies when gathered with others as one flat buffer."""
        layout = self._flat_layouts.get(shard_dtype)
        if layout is None:
            layout = FlatLayout(
                self.rows_per_rank, self.local_rows, self.shape[0], tuple(self.shape[1:]), shard_dtype
            )
            self._flat_layouts[shard_dtype] = layout
        return layout

    def unsharded_bytes(self, param: torch.Tensor) -> int:
        """Bytes of the unsharded param this spec gathers (in ``param_dtype`` if set)."""
        dtype = self.param_dtype or param.dtype
        return math.prod(self.shape) * dtype.itemsize

    def unshard_traced(self, param: torch.Tensor) -> torch.Tensor:
        """The gather a compiled graph traces, for any sharded param (``param`` is its leaf or
        the DTensor): a plain tensor, or for a tensor-parallel param the tensor-parallel
        DTensor (``fczero.comm.meshes``). Eager reads gather through the runtime instead
        (``fczero.runtime.prefetch.gather_eagerly``)."""
        traced = self.traced  # one guard for every constant (see the module docstring)
        if traced[0]:
            return gather_traced(local_shard(param), traced)
        if self.is_scalar:
            return self.gather_scalar(local_shard(param))
        return self.tensor_parallel.wrap(gather_traced(local_shard(param), traced))

    def gather_scalar(self, local: torch.Tensor) -> torch.Tensor:
        """A 0-d param: its value, the same on every rank (``Replicate()``, grad all-reduced)."""
        return collectives.replicate_scalar(
            self.on_device(local),
            self.group_size,
            self.group_name,
            self.param_dtype,
            self.reduce_dtype,
            self.replicate,
        )

    def on_device(self, local: torch.Tensor) -> torch.Tensor:
        """The shard where the collectives run (a copy from the host under param offload;
        its backward copies the grad back)."""
        if self.compute_device is None:
            return local
        return to_device(local, self.compute_device)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return gather_with(local, self.traced)

    def regather(self, param: torch.Tensor) -> torch.Tensor:
        """Eager stage 3: issue the gather again, without autograd, for a saved-tensor
        unpack (asynchronous: the caller settles it, see ``collectives.settle``)."""
        with torch.no_grad():  # the regather is not differentiated: no grad link needed
            return self.gather(param.to_local() if isinstance(param, DTensor) else param)


class _EagerLocal(torch.autograd.Function):
    """``param.to_local()`` for eager gathers, with a cheaper backward. DTensor's own
    backward builds each grad through ``DTensor.from_local`` (a new spec, checks, one
    more autograd node) for every param on every step; this one wraps the grad with
    the param's own spec, which describes it exactly: fczero's reduce hands back a
    contiguous grad with the param's placements, shape and dtype."""

    @staticmethod
    def forward(ctx, param: DTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = param._spec
        return param._local_tensor.view_as(param._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:  # type: ignore[override]
        return sharded_grad(grad, ctx.spec)


def sharded_grad(grad: torch.Tensor, spec) -> DTensor:
    """The local grad of a sharded param as its DTensor grad, wrapped with the param's own
    ``DTensorSpec``, which describes it exactly (fczero's reduce hands back a contiguous
    grad with the param's placements, shape and dtype). Sharing the spec object, as FSDP2
    does for its grads, costs nothing per grad (``DTensor.from_local`` builds and checks a
    new spec; even a field copy was one more object per param per step), and lets the
    local step see at once that a grad is laid out like its param (same spec object).

    Built by ``DTensor.__new__`` alone: ``DTensor.__init__`` does nothing but sits behind
    two Python wrappers (Dynamo's disable and export's constructor mark), which cost more
    than the construction itself (2.4 against 0.9 us per grad, on this CPU, torch 2.13)."""
    return DTensor.__new__(DTensor, grad.contiguous(), spec, requires_grad=False)


def eager_local(param: torch.Tensor) -> torch.Tensor:
    """The local shard for an eager gather (outside compiled graphs only), linked to the
    sharded param by ``_EagerLocal``."""
    return _EagerLocal.apply(param) if isinstance(param, DTensor) else param


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The local shard, linked to the sharded param by autograd (its grad is ``Shard(0)``)."""
    return param.to_local() if isinstance(param, DTensor) else param  # grad: same placements


def _must_recompute(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def recompute_everything():
    return create_selective_checkpoint_contexts(_must_recompute)


#: What AOT autograd's cache keys this policy on: it caches no graph whose selective
#: checkpoint has a ``context_fn`` without a ``cache_hash``. The policy's code is the key.
recompute_everything.cache_hash = hashlib.sha256(
    _must_recompute.__code__.co_code + recompute_everything.__code__.co_code
).hexdigest()


class _QuietGatherCheckpoint(logging.Filter):
    """Drops torch's once-per-process note that a ``context_fn`` reached ``checkpoint``
    under compile. fczero's own gather region causes it and holds no in-place op, which
    is all the note warns about; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


def quiet_gather_checkpoint_note() -> None:
    log = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _QuietGatherCheckpoint) for f in log.filters):
        log.addFilter(_QuietGatherCheckpoint())


def shard_tensor(
    tensor: torch.Tensor,
    mesh: DeviceMesh,
    options: Options,
    requires_grad: bool,
    layout: ParamLayout | None = None,
) -> tuple[nn.Parameter, ShardSpec]:
    """Split a whole tensor (same on every rank) into this rank's sharded param.

    ``mesh`` is the shard axis. ``layout`` (``fczero.comm.meshes``) places the sharded param
    on a larger mesh (HSDP, tensor parallelism); a tensor-parallel DTensor is split
    from its local tensor, which every rank of the shard axis holds the same.
    """
    whole_shape, whole_stride = tensor.shape, tensor.stride()
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    tensor = tensor.detach().to(mesh_device(mesh))
    rows, start, local_rows = _rows_of(tensor.shape, mesh)
    local = tensor.clone() if tensor.dim() == 0 else tensor.narrow(0, start, local_rows).clone()
    return _sharded_param(
        local,
        tensor.shape,
        whole_shape,
        whole_stride,
        rows,
        local_rows,
        mesh,
        options,
        requires_grad,
        layout,
    )


def empty_shard(
    shape: torch.Size,
    dtype: torch.dtype,
    mesh: DeviceMesh,
    options: Options,
    requires_grad: bool,
) -> tuple[nn.Parameter, ShardSpec]:
    """This rank's sharded param of a ``shape`` tensor, uninitialized, allocated at its
    shard's size only (the whole tensor never exists); laid out as ``shard_tensor`` does."""
    rows, _, local_rows = _rows_of(shape, mesh)
    local_shape = shape if len(shape) == 0 else (local_rows, *shape[1:])
    local = torch.empty(local_shape, dtype=dtype, device=mesh_device(mesh))
    stride = torch.empty(shape, device="meta").stride()
    return _sharded_param(
        local, shape, shape, stride, rows, local_rows, mesh, options, requires_grad, None
    )


def _rows_of(shape: torch.Size, mesh: DeviceMesh) -> tuple[int, int, int]:
    """(rows per rank c, this rank's first row, rows it holds) of dim 0; zeros for 0-d."""
    if len(shape) == 0:
        return 0, 0, 0
    rows = math.ceil(shape[0] / mesh.size())
    start = min(mesh.get_local_rank() * rows, shape[0])
    return rows, start, min(rows, shape[0] - start)


def _sharded_param(
    local: torch.Tensor,
    shape: torch.Size,
    whole_shape: torch.Size,
    whole_stride: tuple[int, ...],
    rows: int,
    local_rows: int,
    mesh: DeviceMesh,
    options: Options,
    requires_grad: bool,
    layout: ParamLayout | None,
) -> tuple[nn.Parameter, ShardSpec]:
    """Wrap this rank's rows (``local``) as the sharded param, with its ``ShardSpec``."""
    placement = Replicate() if len(shape) == 0 else Shard(0)
    if layout is None:
        on, placements = mesh, [placement]
    else:
        on = layout.mesh
        placements = layout.scalar_placements if len(shape) == 0 else layout.placements
    dtensor = DTensor.from_local(
        local, on, placements, run_check=False, shape=whole_shape, stride=whole_stride
    )
    spec = ShardSpec(
        shape=shape,
        rows_per_rank=rows,
        local_rows=local_rows,
        group_size=mesh.size(),
        group_name=mesh.get_group().group_name,
        options=options,
        replicate=layout.replicate if layout is not None else None,
        tensor_parallel=layout.tensor_parallel if layout is not None else None,
    )
    return nn.Parameter(dtensor, requires_grad=requires_grad), spec


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's shards live on (the current accelerator for a GPU mesh)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())
