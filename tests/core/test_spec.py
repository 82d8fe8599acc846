"""A param's layout: ``shard_tensor`` splits rows as ``torch.chunk`` does, and the
``ShardSpec`` it returns says how to put them back."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fczero
from fczero.core.config import Options
from fczero.core.spec import shard_tensor


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
@pytest.mark.parametrize(("rows", "per_rank", "local"), [(13, 4, 4), (3, 1, 1), (16, 4, 4)])
def test_rows_follow_torch_chunk(fake_pg, rows, per_rank, local):
    tensor = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
    param, spec = shard_tensor(tensor, init_device_mesh("cpu", (4,)), Options(), True)
    assert isinstance(param, DTensor) and tuple(param.placements) == (Shard(0),)
    assert param.requires_grad and param.shape == tensor.shape
    assert spec.shape == tensor.shape and spec.group_size == 4
    assert spec.rows_per_rank == per_rank and spec.local_rows == local  # rank 0's rows
    assert torch.equal(param.to_local(), torch.chunk(tensor, 4)[0])
    assert spec.unsharded_bytes(param) == tensor.numel() * 4


def test_a_0d_param_is_replicated_and_mixed_precision_is_copied_in(fake_pg):
    options = Options(mp=fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    param, spec = shard_tensor(torch.tensor(2.0), init_device_mesh("cpu", (2,)), options, False)
    assert tuple(param.placements) == (Replicate(),) and spec.is_scalar
    assert not param.requires_grad
    assert spec.param_dtype == torch.bfloat16 and spec.reduce_dtype is None
    assert spec.unsharded_bytes(param) == 2  # counted in the dtype the gather casts to


def test_eager_local_gives_the_grad_to_local_gives(fake_pg):
    """The eager shard's backward wraps the grad with (a copy of) the param's spec: the
    same DTensor grad as ``to_local()``'s backward, without a new spec per grad."""
    from torch.nn import Parameter

    from fczero.core.spec import eager_local

    mesh = init_device_mesh("cpu", (2,))
    grads = []
    for local_of in (lambda p: p.to_local(), eager_local):
        param, _ = shard_tensor(torch.arange(12.0).reshape(6, 2), mesh, Options(), True)
        param = Parameter(param)
        local = local_of(param)
        assert torch.equal(local, param.to_local()) and type(local) is torch.Tensor
        (local * torch.arange(6.0).reshape(3, 2)).sum().backward()
        grads.append(param.grad)
    expected, got = grads
    assert isinstance(got, DTensor) and got.placements == expected.placements
    assert got.shape == expected.shape and got.stride() == expected.stride()
    assert torch.equal(got.to_local(), expected.to_local())
    assert got._spec == param._spec


@pytest.mark.parametrize("units", ["auto", None], ids=["units", "per-read"])
def test_a_compiled_gather_reads_its_constants_as_one_literal_tuple(fake_pg, units):
    """[Note: what a compiled gather reads]: the gather's constants are one plain tuple of
    Python literals, so Dynamo guards them with one equality check; in the plain case the
    compiled gather reads that tuple and the leaf from the param's state and nothing else
    (no field of the spec, no flag of the state): through the unit's list of states when
    the unit gathers, through the module's getter when each read does."""
    import re

    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.variables.constant import ConstantVariable

    from tests.models import TwoLayer

    model = fczero.parallelize(TwoLayer(), init_device_mesh("cpu", (2,)), units=units)
    spec = model.fc1._fczero.params["weight"].spec
    assert type(spec.traced) is tuple and ConstantVariable.is_literal(spec.traced)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(3, 8)).sum().backward()
    (entry,) = _debug_get_cache_entry_list(type(model).forward.__code__)
    parts = getattr(entry.guard_manager, "code_parts", None)
    if parts is None:
        pytest.skip("this torch does not list its guards' code")
    state = r"\.unit\.states\[0\]" if units else r"\._fczero\.params\['weight'\]"
    read = {m for part in parts for m in re.findall(state + r"\.(\w+)", part)}
    assert read == {"traced", "leaf"}, read
