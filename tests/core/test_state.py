"""fczero's state: one ``_fczero`` attribute per module, model and optimizer, and the
records behind it point at the right params."""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib
import inspect
import pkgutil
import weakref

import pytest
import torch
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

import fczero
from fczero.core.state import ModuleState, ParamState, module_state, optimizer_state, root_state
from fczero.testing import backends
from fczero.testing.distributed import run_on_ranks
from tests.models import ThreeBlocks, TwoLayer, UnevenTiedMLP


def _fczero_names(obj: object) -> set[str]:
    return {k for k in vars(obj) if k.startswith("_fczero")}


def test_one_attribute_on_modules_and_optimizers(fake_pg):
    model = fczero.parallelize(UnevenTiedMLP(), init_device_mesh("cpu", (2,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    names = set().union(*(_fczero_names(m) for m in model.modules()), _fczero_names(opt))
    assert names == {"_fczero"}
    assert not any(k.startswith("_fczero") for cls in type(model).__mro__ for k in vars(cls))
    assert optimizer_state(opt).params  # the step hooks looked its params up once


def test_module_states_point_at_their_own_sharded_params(fake_pg):
    model = fczero.parallelize(UnevenTiedMLP(), init_device_mesh("cpu", (2,)))
    root = root_state(model)
    assert root is not None and root_state(model.inp) is None
    assert module_state(model).params.keys() == {"scale"}  # the root owns a param too
    seen: dict[int, ParamState] = {}
    for module in model.modules():
        record = module_state(module)
        if record is None:
            continue
        assert isinstance(record, ModuleState)
        for name, state in record.params.items():
            assert state.param is module._parameters[name]
            assert state.root is root
            seen.setdefault(id(state.param), state)
            assert seen[id(state.param)] is state  # a tied param has one state
    assert [id(s.param) for s in root.params] == list(seen)  # registration order
    assert len(root.params) == len(list(model.parameters()))


def test_a_submodule_is_not_a_root(fake_pg):
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)))
    assert root_state(model) is not None
    assert all(root_state(m) is None for m in model.blocks)
    assert module_state(model.blocks[0]).root is None


def test_an_optimizer_of_other_params_gets_no_attribute(fake_pg):
    fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)))  # the global hooks exist
    other = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert _fczero_names(opt) == set()


def test_compiled_graphs_differentiate_plain_leaves_not_dtensors(gloo_one_rank):
    """[Note: what a compiled graph differentiates]: Dynamo sees no DTensor input (no
    per-param DTensor guard, flatten or rewrap), and every grad still reaches its sharded
    param as a DTensor of the param's spec, accumulating over backwards without zero_grad
    as AccumulateGrad would, equal to the plain model's."""
    torch.manual_seed(0)
    ref = UnevenTiedMLP()
    model = fczero.parallelize(copy.deepcopy(ref), init_device_mesh("cpu", (1,)))
    inputs: list[object] = []

    def recording(gm, example_inputs):  # Dynamo's inputs, then AOT autograd as usual
        inputs.extend(example_inputs)
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(model, backend=recording)
    batches = [torch.randn(4, 5) for _ in range(2)]
    for x in batches:  # two backwards, no zero_grad in between
        compiled(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    assert inputs and not any(isinstance(t, DTensor) for t in inputs)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        if not p.requires_grad:
            assert p.grad is None
            continue
        assert isinstance(p.grad, DTensor), name
        assert p.grad._spec is p._spec  # the param's own spec: no object per grad per step
        assert p.grad.placements == p.placements and p.grad.shape == p.shape
        assert p.grad.dtype == p.dtype and p.grad._local_tensor.is_contiguous()
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-6, atol=1e-7)
    leaves = [s.leaf for s in root_state(model).params]
    assert all(leaf.grad is None for leaf in leaves)  # handed over, not kept twice
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()  # the leaves share the shards' storage: the next graph reads the update
    assert all(
        leaf.data_ptr() == s.param._local_tensor.data_ptr()
        for leaf, s in zip(leaves, root_state(model).params)
    )


def test_a_dropped_compiled_model_frees_its_leaves(gloo_one_rank):
    """The leaf's grad hook holds its state weakly: a hook lives in C++, where the garbage
    collector cannot break a cycle, and a strong one kept every dropped model's shards."""
    import gc
    import weakref

    model = fczero.parallelize(UnevenTiedMLP(), init_device_mesh("cpu", (1,)))
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(4, 5)).sum().backward()
    leaf = weakref.ref(root_state(model).params[0].leaf)
    del model, compiled
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    assert leaf() is None


# ---- nothing mutable at module level ------------------------------------------------


class _Fails(nn.Module):
    """Raises in the middle of its forward (after one layer's gathers) while ``fail``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.fail:
            raise ValueError("fails after one layer")
        return self.fc2(h)


class _Calls(nn.Module):
    """A root whose forward calls another root (held outside its module tree)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.inner = [inner]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner[0](self.inp(x))


def _innermost_saved_tensor_hooks() -> tuple | None:
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def test_a_forward_that_raises_closes_its_context(gloo_one_rank):
    """[Note: the eager context of a forward]: the root's forward hook closes what its
    pre-hook opened even when the forward raised (alone, or inside another root's forward):
    no context, reshard hooks or prefetched gather is left behind, and the next forward is
    the plain model's."""
    torch.manual_seed(0)
    ref = _Fails()
    ref.fail = False
    mesh = init_device_mesh("cpu", (1,))
    model = fczero.parallelize(copy.deepcopy(ref), mesh)
    model.fail = True
    outer = fczero.parallelize(_Calls(model), mesh)
    root, outer_root = root_state(model), root_state(outer)
    x = torch.randn(3, 8)
    for step in range(2):  # the second forward replays the (cut short) recorded order
        for caller in (model, outer):
            with pytest.raises(ValueError, match="fails after one layer"):
                caller(x)
            assert root.context is None and not root.in_forward, (step, caller)
            assert outer_root.context is None and not outer_root.forwards
            assert _innermost_saved_tensor_hooks() is None  # the reshard hooks are gone
            assert root.prefetch._ready == {} and outer_root.prefetch._ready == {}
    fczero.set_requires_gradient_sync(model, False)  # allowed: no forward is running
    fczero.set_requires_gradient_sync(model, True)
    model.fail = False
    out = model(x)
    assert root.context is None
    torch.testing.assert_close(out, ref(x), rtol=1e-6, atol=1e-7)
    out.sum().backward()
    ref(x).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-6, atol=1e-7)


#: What a training step may change at module level: the per-process CUDA copy streams and
#: pending copy events of ``fczero.core.streams`` (docs/design.md, "What still lives at
#: module level, and why"). Nothing changes them on a CPU mesh.
MAY_CHANGE = {
    "fczero.core.streams._side_streams",
    "fczero.core.streams._writeback_streams",
    "fczero.core.streams._pending",
    "fczero.passes.timing._total",  # seconds spent in the passes (bench.compile_time)
}

_MAPPINGS = (dict, weakref.WeakKeyDictionary, weakref.WeakValueDictionary, WeakIdKeyDictionary)
_COLLECTIONS = (set, frozenset, weakref.WeakSet, list, tuple, collections.deque)


def _fingerprint(value: object) -> tuple:
    """What would differ if ``value`` were rebound or its contents changed (one level)."""
    if isinstance(value, _MAPPINGS):
        return (id(value), frozenset((id(k), id(v)) for k, v in list(value.items())))
    if isinstance(value, _COLLECTIONS):
        return (id(value), tuple(sorted(id(v) for v in list(value))))
    attrs = getattr(value, "__dict__", None)
    if type(value).__module__.startswith("fczero") and isinstance(attrs, dict):
        return (id(value), frozenset((k, id(v)) for k, v in attrs.items()))
    return (id(value),)


def _module_level_state() -> dict[str, tuple]:
    """Every module-level value of every fczero module, and every class-level value of
    the classes they define (methods, properties and dunders left out)."""
    found = {}
    for info in pkgutil.walk_packages(fczero.__path__, "fczero."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if name.startswith("__") or inspect.ismodule(value) or inspect.isroutine(value):
                continue
            if not inspect.isclass(value):
                found[f"{module.__name__}.{name}"] = _fingerprint(value)
            elif value.__module__ == module.__name__:
                for attr, member in vars(value).items():
                    if (
                        attr.startswith("__")
                        or callable(member)
                        or inspect.isdatadescriptor(member)
                    ):
                        continue
                    if isinstance(member, (staticmethod, classmethod)):
                        continue
                    found[f"{module.__name__}.{value.__qualname__}.{attr}"] = _fingerprint(member)
    return found


def _steps_touching_nothing_global(rank: int, world_size: int) -> tuple[list[str], int, int]:
    """Four models on one mesh, one step after another: a checked stage-3 model, a stage-1
    model (the eager reducer), a stage-3 model with eager prefetch and resharding, and a
    checked compiled one. The module-level state is compared with the state after
    ``parallelize`` in the middle of every forward, in backward, inside each optimizer step
    and after each step."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    checked = fczero.CheckPolicy(timeout_s=60.0)
    models = [
        fczero.parallelize(ThreeBlocks(16), mesh, check_policy=checked),
        fczero.parallelize(TwoLayer(), mesh, stage=1),
        fczero.parallelize(ThreeBlocks(16), mesh, comm_policy=fczero.CommPolicy(bucket_bytes=2048)),
        fczero.parallelize(TwoLayer(), mesh, check_policy=checked),
    ]
    runs = [*models[:3], torch.compile(models[3], backend=backends.aot_eager_with_passes)]
    inputs = [torch.randn(4, 16), torch.randn(4, 8), torch.randn(4, 16), torch.randn(4, 8)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    baseline = _module_level_state()
    changed: set[str] = set()
    probes = 0

    def probe(*_: object) -> None:
        nonlocal probes
        probes += 1
        now = _module_level_state()
        changed.update(k for k in baseline.keys() | now.keys() if baseline.get(k) != now.get(k))

    for model, opt in zip(models, optimizers):
        next(m for m in model.modules() if isinstance(m, nn.Linear)).register_forward_hook(probe)
        opt.register_step_pre_hook(probe)  # (after fczero's global pre-hook, in the step)
    for _ in range(3):  # record the gather order, then replay it
        losses = [run(x).square().mean() for run, x in zip(runs, inputs)]  # every forward first
        for loss in losses:
            loss.register_hook(probe)
            loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        probe()
    return sorted(changed - MAY_CHANGE), probes, len(baseline)


def test_training_steps_change_no_module_level_state():
    """Two models share nothing through a module: no module-level or class-level value of
    any fczero module is rebound or has its contents changed by a training step, except the
    per-process ones documented in docs/design.md (``MAY_CHANGE``)."""
    state = _module_level_state()
    assert MAY_CHANGE <= state.keys()  # the exceptions still exist under these names
    for changed, probes, seen in run_on_ranks(_steps_touching_nothing_global, 2):
        assert changed == [], "changed at module level: " + ", ".join(changed)
        assert probes == 3 * (4 + 4 + 4 + 1)  # per step: forwards, backwards, steps, after
        assert seen > 100


def test_the_traced_key_is_the_gather_constants_only_in_the_plain_case(fake_pg):
    """[Note: what a compiled gather reads]: ``ParamState.traced`` is the spec's gather
    constants exactly while the compiled getter may gather straight from them (stage 3,
    sync on, nothing accumulated, a kept param's reused gather dropped), else None, and
    follows each change."""
    mesh = init_device_mesh("cpu", (2,))
    model = fczero.parallelize(TwoLayer(), mesh)
    state = model.fc1._fczero.params["weight"]
    assert state.traced is state.spec.traced and state.traced[0]
    with fczero.no_sync(model):
        assert state.traced is None
    assert state.acc is not None and state.traced is None  # the next synced forward adds it
    state.acc = None
    assert state.traced is state.spec.traced
    state.sync = False
    assert state.traced is None
    state.sync = True
    assert state.traced is state.spec.traced
    state.whole = torch.zeros(state.spec.shape)
    assert state.traced is None
    state.whole = None
    plain = state.spec  # the automatic plan keeps a param by replacing its spec
    state.spec = dataclasses.replace(plain, keep_unsharded=True)
    assert state.traced is state.spec.traced and not state.traced[1]  # gathered, not recomputed
    state.reused = torch.zeros(state.spec.shape)  # left over from an accumulation: dropped first
    assert state.traced is None
    state.reused = None
    assert state.traced is state.spec.traced
    state.spec = plain
    assert state.traced is plain.traced
    kept = fczero.parallelize(TwoLayer(), mesh, comm_policy=fczero.CommPolicy(keep_unsharded=2**30))
    kept_state = kept.fc1._fczero.params["weight"]
    assert kept_state.spec.keep_unsharded and kept_state.traced is kept_state.spec.traced
    whole = fczero.parallelize(TwoLayer(), mesh, stage=2)
    assert whole.fc1._fczero.params["weight"].traced is None
