"""Guards (fczero/runtime/guards.py): misuse around parallelize gets a clear error (the
table in docs/troubleshooting.md): a model with nothing to shard, params on the wrong
device, and after parallelize the old params, moves and casts, full state dicts, shared
params. Option and mesh errors are in tests/core/test_config.py and tests/comm/test_meshes.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fczero
from fczero.runtime import guards
from tests.models import TwoLayer, UnevenTiedMLP


def _assert_untouched(model: nn.Module) -> None:
    assert not fczero.is_parallelized(model)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def _mesh(n: int = 2):
    return init_device_mesh("cpu", (n,))


# ---- before parallelize ---------------------------------------------------------------


def test_empty_model(fake_pg):
    model = nn.Sequential(nn.ReLU(), nn.Tanh())
    with pytest.raises(ValueError, match=r"Sequential has no parameters, so there is nothing"):
        fczero.parallelize(model, _mesh())
    _assert_untouched(model)


def test_accelerator_params_with_a_cpu_mesh():
    # A CPU machine has no accelerator tensors: the rule is checked on (name, device) pairs.
    with pytest.raises(ValueError, match=r"'fc1.weight' is on cuda:0 but the mesh is a CPU mesh"):
        guards.check_devices([("fc1.weight", torch.device("cuda", 0))], "cpu")
    guards.check_devices([("fc1.weight", torch.device("cpu"))], "cpu")
    guards.check_devices([("fc1.weight", torch.device("cpu"))], "cuda")  # moved to the GPU: fine
    guards.check_devices([("fc1.weight", torch.device("cuda", 1))], "cuda")


# ---- after parallelize ----------------------------------------------------------------


def test_optimizer_built_before_parallelize(fake_pg):
    model = TwoLayer()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    fczero.parallelize(model, _mesh())
    with pytest.raises(
        RuntimeError,
        match=r"SGD holds 3 parameter\(s\) that parallelize replaced "
        r"\('fc1.weight', 'fc1.bias', 'fc2.weight'\).*after parallelize",
    ):
        early.step()
    late = torch.optim.SGD(model.parameters(), lr=0.1)
    late.step()  # built after: steps (no grads yet, so nothing changes)
    late.step()


@pytest.mark.parametrize(
    ("move", "message"),
    [
        (lambda m: m.double(), r"'fc1.weight' from cpu torch.float32 to cpu torch.float64"),
        (lambda m: m.half(), r"to cpu torch.float16"),
        (lambda m: m.to(torch.bfloat16), r"to cpu torch.bfloat16"),
        (lambda m: m.to("meta"), r"from cpu torch.float32 to meta torch.float32"),
        (lambda m: m.fc2.double(), r"'weight' from cpu torch.float32 to cpu torch.float64"),
    ],
)
def test_moving_or_casting_after_parallelize(fake_pg, move, message):
    model = TwoLayer()
    model.register_buffer("steps", torch.zeros(2))
    fczero.parallelize(model, _mesh())
    before = {n: (p.dtype, p.device) for n, p in model.named_parameters()}
    with pytest.raises(
        RuntimeError,
        match=r"moving or casting a parallelized model is not "
        r"supported.*" + message,
    ):
        move(model)
    assert {n: (p.dtype, p.device) for n, p in model.named_parameters()} == before
    assert model.steps.dtype == torch.float32  # nothing was converted, buffers neither


def test_moves_that_change_nothing_are_allowed(fake_pg):
    model = UnevenTiedMLP()
    fczero.parallelize(model, _mesh())
    params = dict(model.named_parameters())
    assert model.to("cpu") is model
    assert model.float() is model
    assert model.cpu() is model
    assert dict(model.named_parameters()) == params  # the same param objects
    assert all(model._parameters[n] is p for n, p in params.items() if "." not in n)
    assert type(model.inp).__name__ == "FCZeroLinear"  # the guard keeps class names


def test_loading_a_full_state_dict_after_parallelize(fake_pg):
    model = TwoLayer()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    fczero.parallelize(model, _mesh())
    sharded = model.state_dict()
    before = model.fc1._parameters["weight"].to_local().clone()
    with torch.no_grad():
        full["fc1.weight"].fill_(7.0)
    with pytest.raises(
        ValueError,
        match=r"load_state_dict got a plain tensor for 'fc1.weight', "
        r"a sharded param .*set_model_state_dict",
    ):
        model.load_state_dict(full)
    assert torch.equal(model.fc1._parameters["weight"].to_local(), before)  # nothing copied
    assert not model.load_state_dict(sharded).missing_keys  # a sharded one loads as is


class _Tempered(nn.Module):
    """A Linear and a 0-d learnable temperature (fczero keeps the 0-d param replicated)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.temp = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / self.temp


def test_a_full_state_dict_with_a_0d_param_loads_through_set_model_state_dict(gloo_one_rank):
    """torch's ``set_model_state_dict(full_state_dict=True)`` hands a 0-d value to
    ``load_state_dict`` as a plain tensor: the whole value of a replicated param, so it
    loads; a plain tensor for a sharded param is still refused, naming its placement."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    torch.manual_seed(0)
    full = _Tempered().state_dict()
    full["temp"] = torch.tensor(1.5)
    torch.manual_seed(1)
    model = fczero.parallelize(_Tempered(), init_device_mesh("cpu", (1,)))
    set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True))
    loaded = fczero.checkpoint.full_state_dict(model, rank0_only=False)
    assert loaded["temp"].item() == 1.5
    assert torch.equal(loaded["fc.weight"], full["fc.weight"])
    with pytest.raises(ValueError, match=r"plain tensor for 'fc.weight'.*Shard\(dim=0\)"):
        model.load_state_dict(full)


def test_loading_with_assign_after_parallelize_is_refused(fake_pg):
    """assign=True would swap the sharded params for tensors fczero does not track."""
    model = fczero.parallelize(TwoLayer(), _mesh())
    sharded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"assign=True\) would replace the sharded params"):
        model.load_state_dict(sharded, assign=True)
    assert all(p is params[n] for n, p in model.named_parameters())  # nothing swapped


class _Outer(nn.Module):
    """``enc`` is parallelized alone; ``dec`` ties its weight to ``enc.fc1.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = TwoLayer()
        self.dec = nn.Linear(8, 16, bias=False)
        self.dec.weight = self.enc.fc1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(x).sum() + self.enc(x).sum()


def test_param_shared_with_a_module_that_is_not_parallelized(fake_pg):
    outer = _Outer()
    fczero.parallelize(outer.enc, _mesh())
    loss = outer(torch.randn(3, 8))
    with pytest.raises(
        RuntimeError,
        match=r"backward reached the old tensor of parameter "
        r"'fc1.weight'.*Parallelize the module that contains every user",
    ):
        loss.backward()


def test_param_shared_with_a_model_parallelized_before(fake_pg):
    outer = _Outer()
    fczero.parallelize(outer.enc, _mesh())
    with pytest.raises(
        ValueError,
        match=r"parameter 'weight' was already replaced by an earlier "
        r"parallelize \(as 'fc1.weight'\)",
    ):
        fczero.parallelize(outer.dec, _mesh())
    assert not isinstance(outer.dec.weight, DTensor)
