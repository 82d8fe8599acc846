"""Models built on the meta device: ``parallelize`` initializes them module by module.

Every sharded param must equal, element for element, the same init run on a
materialized copy of the model from the same RNG state (``model.apply(init_fn)``, or
the constructor's ``reset_parameters`` calls), and training from it must match the
single-process reference. With ``meta_init="shard"`` no whole param may be allocated, and
the values follow the rules of [Note: meta-device init, shard by shard].
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fczero
from fczero.models.llama import Llama, RMSNorm, _rope_tables
from fczero.testing import parity
from fczero.testing.distributed import run_on_ranks
from tests.models import TINY_LLAMA, TwoLayer, UnevenTiedMLP, tiny_llama, token_batches

INIT_SEED = 7


class Stack(nn.Module):
    """Only layers whose constructors init through reset_parameters (no custom init)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 9)
        self.norm = nn.LayerNorm(9)
        self.head = nn.Linear(9, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(self.embed(x))))


def init_uneven(module: nn.Module) -> None:
    """An init for UnevenTiedMLP: default layer init, custom values for the root's own."""
    if isinstance(module, nn.Linear):
        module.reset_parameters()
    elif isinstance(module, UnevenTiedMLP):
        nn.init.uniform_(module.scale, 0.5, 1.5)
        module.shift.copy_(torch.linspace(-0.1, 0.1, 7))


def init_llama(module: nn.Module) -> None:
    """fczero's Llama init, one module at a time (Llama.reset_parameters recurses)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=TINY_LLAMA.dim**-0.5)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=1.0)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)
    elif isinstance(module, Llama):
        cos, sin = _rope_tables(module.cfg.dim // module.cfg.n_heads, module.cfg.max_seq_len)
        module.rope_cos.copy_(cos)
        module.rope_sin.copy_(sin)


def _whole_reference(build, init_fn):
    """The same init on a materialized model from the same RNG state."""
    torch.manual_seed(0)
    model = build()
    if init_fn is None:
        return model  # built from seed 0, each layer's reset_parameters in its constructor
    torch.manual_seed(INIT_SEED)
    model.apply(init_fn)
    return model


def _meta_parallel(rank: int, world_size: int, build, init_fn):
    mesh = init_device_mesh("cpu", (world_size,))  # the same default group every call
    with torch.device("meta"):
        model = build()
    seen_whole = []  # per init call: how many params of the model were real (not meta)

    def counting(module: nn.Module) -> None:
        real = {
            id(p)
            for m in model.modules()
            for p in m._parameters.values()
            if p is not None and p.device.type != "meta"
        }
        seen_whole.append(
            (len(real), len([p for p in module._parameters.values() if p is not None]))
        )
        if init_fn is None:
            module.reset_parameters()
        else:
            init_fn(module)

    torch.manual_seed(0 if init_fn is None else INIT_SEED)
    fczero.parallelize(model, mesh, init_fn=counting)
    after = torch.rand(4)  # the RNG must have advanced exactly as the whole init's did
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    local_rows = {
        n: p.to_local().shape[0] if p.dim() else None for n, p in model.named_parameters()
    }
    return params, buffers, after, seen_whole, local_rows


VALUE_CASES = [(Stack, None), (UnevenTiedMLP, init_uneven), (tiny_llama, init_llama)]


TRAIN_BACKENDS = [None, "aot_eager"]


def _meta_parallel_all(rank: int, world_size: int):
    values = [_meta_parallel(rank, world_size, build, fn) for build, fn in VALUE_CASES]
    traces = []
    for backend in TRAIN_BACKENDS:
        torch._dynamo.reset()
        traces.append(_train_meta(rank, world_size, token_batches(steps=3), backend))
    return values, traces


@pytest.fixture(scope="module")
def meta_ranks():
    return run_on_ranks(_meta_parallel_all, 2)  # one spawn for every case of this file


@pytest.mark.parametrize(
    "index",
    range(len(VALUE_CASES)),
    ids=["reset_parameters", "uneven-tied-init_fn", "llama-init_fn"],
)
def test_values_equal_whole_init(meta_ranks, index):
    build, init_fn = VALUE_CASES[index]
    ranks = [values[index] for values, _ in meta_ranks]
    ref = _whole_reference(build, init_fn)
    ref_after = torch.rand(4)
    expected = dict(ref.named_parameters())
    for params, buffers, after, seen_whole, local_rows in ranks:
        assert params.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(
                params[name], value.detach(), rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
            )
        for name, value in ref.named_buffers():
            torch.testing.assert_close(buffers[name], value, rtol=0, atol=0)
        torch.testing.assert_close(after, ref_after, rtol=0, atol=0)
        # while a module was initialized, only its own params were whole (nothing else real)
        for real, own in seen_whole:
            assert real <= own, seen_whole
    if build is UnevenTiedMLP:
        assert [r[4]["inp.weight"] for r in ranks] == [7, 6]  # 13 rows: uneven shards
        assert "back.weight" not in ranks[0][0]  # the tie survived: one param


def _meta_llama() -> nn.Module:
    with torch.device("meta"):
        model = tiny_llama()
    torch.manual_seed(INIT_SEED)
    return model


def _reference_llama() -> nn.Module:
    model = tiny_llama()
    torch.manual_seed(INIT_SEED)
    model.apply(init_llama)
    return model


def _train_meta(rank: int, world_size: int, batches, backend):
    return parity.train_parallel(
        rank,
        world_size,
        _meta_llama,
        batches,
        parity.cross_entropy,
        optimizer="adamw",
        lr=1e-3,
        compile_backend=backend,
        init_fn=init_llama,
    )


@pytest.mark.parametrize("index", range(len(TRAIN_BACKENDS)), ids=["eager", "aot_eager"])
def test_meta_llama_trains_like_reference(meta_ranks, index):
    trace = meta_ranks[0][1][index]
    expected = parity.train_reference(
        _reference_llama, token_batches(steps=3), parity.cross_entropy, optimizer="adamw", lr=1e-3
    )
    parity.assert_close(trace, expected, rtol=1e-5, atol=1e-6)


def _meta(build):
    with torch.device("meta"):
        return build()


def test_missing_reset_parameters_is_refused(fake_pg):
    model = _meta(UnevenTiedMLP)  # the root owns a 0-d param and a buffer, no reset_parameters
    with pytest.raises(ValueError, match=r"module\(s\) 'UnevenTiedMLP' own meta .* init_fn=fn"):
        fczero.parallelize(model, init_device_mesh("cpu", (2,)))
    assert not fczero.is_parallelized(model)
    assert model.inp.weight.device.type == "meta"  # nothing changed


def test_init_fn_errors(fake_pg):
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(TypeError, match="init_fn must be a function"):
        fczero.parallelize(_meta(TwoLayer), mesh, init_fn="normal")
    with pytest.raises(ValueError, match="nothing for it to initialize"):
        fczero.parallelize(TwoLayer(), mesh, init_fn=init_uneven)
    mixed = _meta(TwoLayer)
    mixed.fc1.bias = nn.Parameter(torch.zeros(16))
    with pytest.raises(ValueError, match="'fc1' has params both on the meta device and on a real"):
        fczero.parallelize(mixed, mesh)

    def replaces(module: nn.Module) -> None:
        module.weight = nn.Parameter(torch.zeros(module.weight.shape))

    with pytest.raises(ValueError, match="replaced its param 'weight'; the init must fill"):
        fczero.parallelize(_meta(TwoLayer), mesh, init_fn=replaces)


# --- meta_init="shard": no whole param, values from per-rank streams ----------------------


class _WholeShapes(TorchDispatchMode):
    """Every real (non-meta) plain tensor an op produces, by shape (a DTensor's shape is
    global: its storage is its local tensor, which the mode sees on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if type(t) in (torch.Tensor, nn.Parameter) and t.device.type != "meta":
                self.shapes.add(tuple(t.shape))
        return out


def test_shard_mode_never_allocates_a_whole_param(fake_pg):
    model = _meta(Stack)
    whole = {tuple(p.shape) for p in model.parameters()}
    with _WholeShapes() as seen:
        fczero.parallelize(model, init_device_mesh("cpu", (2,)), meta_init="shard")
    assert not whole & seen.shapes, whole & seen.shapes
    local = [tuple(p.to_local().shape) for p in model.parameters()]
    assert local == [(6, 6), (5, 6), (5,), (5,), (5,), (6, 9), (6,)]
    with _WholeShapes() as seen:  # the module-by-module default does allocate them
        fczero.parallelize(_meta(Stack), init_device_mesh("cpu", (2,)))
    assert whole <= seen.shapes


def _shard_init(rank: int, world_size: int):
    out = []
    for build, init_fn in [(Stack, None), (UnevenTiedMLP, init_uneven), (Stack, None)]:
        torch.manual_seed(INIT_SEED)
        model = fczero.parallelize(
            _meta(build), init_device_mesh("cpu", (world_size,)), init_fn=init_fn, meta_init="shard"
        )
        after = torch.rand(4)
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
        out.append((params, after))
    trace = parity.train_parallel(
        rank,
        world_size,
        _meta_llama,
        token_batches(steps=3),
        parity.cross_entropy,
        optimizer="adamw",
        lr=1e-3,
        init_fn=init_llama,
        meta_init="shard",
    )
    model = fczero.parallelize(  # the same init again, to give the reference its values
        _meta_llama(), init_device_mesh("cpu", (world_size,)), init_fn=init_llama, meta_init="shard"
    )
    start = {n: p.full_tensor() for n, p in model.named_parameters()}
    return out, trace, start


def test_shard_mode_values(meta_shards):
    values = [v for v, _, _ in meta_shards]
    (stack, after), (uneven, _), (again, _) = values[0]
    torch.manual_seed(INIT_SEED)
    torch.randint(0, 2**62, ())  # the one draw the shard init takes from the default generator
    torch.testing.assert_close(after, torch.rand(4), rtol=0, atol=0)
    for rank_values in values[1:]:  # every rank ends with the same full tensors
        for (a, _), (b, _) in zip(values[0], rank_values):
            for name in a:
                torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
    for name in stack:  # deterministic from the seed
        torch.testing.assert_close(stack[name], again[name], rtol=0, atol=0)
    fc = stack["fc.weight"]  # [9, 6]: rows 0-4 from rank 0, rows 5-8 from rank 1
    assert fc.abs().max() <= 6**-0.5  # Linear's init bound from the global fan-in (6)
    assert not torch.equal(fc[:4], fc[5:9])  # the ranks' streams differ
    assert torch.equal(stack["norm.weight"], torch.ones(9))  # deterministic inits: exact
    assert torch.equal(stack["norm.bias"], torch.zeros(9))
    whole = _whole_reference(Stack, None)
    assert not torch.equal(fc, whole.fc.weight.detach())  # not the whole init's numbers
    assert 0.5 <= uneven["scale"].item() <= 1.5  # 0-d: rank 0's draw, on every rank


@pytest.fixture(scope="module")
def meta_shards():
    return run_on_ranks(_shard_init, 2)


def test_shard_mode_llama_trains_like_reference_from_the_same_values(meta_shards):
    _, trace, start = meta_shards[0]

    def build() -> nn.Module:
        model = tiny_llama()
        model.load_state_dict(start, strict=False)  # params; the rope buffers are built
        return model

    expected = parity.train_reference(
        build, token_batches(steps=3), parity.cross_entropy, optimizer="adamw", lr=1e-3
    )
    parity.assert_close(trace, expected, rtol=1e-5, atol=1e-6)
    reference_init = _reference_llama().layers[0].attn.wqkv.weight.detach()
    assert not torch.equal(start["layers.0.attn.wqkv.weight"], reference_init)


def test_shard_mode_errors(fake_pg):
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(ValueError, match="meta_init must be 'module' .* or 'shard'"):
        fczero.parallelize(_meta(TwoLayer), mesh, meta_init="rows")
    with pytest.raises(ValueError, match="meta_init='shard' is given but no param"):
        fczero.parallelize(TwoLayer(), mesh, meta_init="shard")

    def plain_copy(module: nn.Module) -> None:
        module.weight.copy_(torch.ones(module.weight.shape))
        module.bias.zero_()

    model = _meta(TwoLayer)
    with pytest.raises(RuntimeError, match="'fc1' with meta_init='shard' failed .* nn.init"):
        fczero.parallelize(model, mesh, init_fn=plain_copy, meta_init="shard")
    assert not fczero.is_parallelized(model)


def _shard_init_cuda(rank: int, world_size: int):
    mesh = init_device_mesh("cuda", (world_size,))
    out = []
    for _ in range(2):  # the same seed twice: the same values
        torch.manual_seed(INIT_SEED)
        model = fczero.parallelize(_meta(Stack), mesh, meta_init="shard")
        assert all(p.to_local().is_cuda for p in model.parameters())
        out.append({n: p.full_tensor().cpu() for n, p in model.named_parameters()})
    loss = model(torch.randint(0, 11, (4, 3), device="cuda")).float().pow(2).mean()
    loss.backward()  # the initialized model trains: grads come back sharded
    grads = [p.grad is not None and p.grad.to_local().is_cuda for p in model.parameters()]
    return out, grads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shard_mode_on_a_gpu_mesh():
    """On CUDA the shards are filled by DTensor's RNG tracker ([Note: meta-device init,
    shard by shard]): deterministic from the seed, inside the init's bounds, the same on
    every rank once gathered, deterministic inits exact."""
    from fczero.testing.distributed import gpu_world_size

    results = run_on_ranks(_shard_init_cuda, gpu_world_size(), backend="nccl")
    (first, again), grads = results[0]
    assert all(grads)
    for name in first:
        torch.testing.assert_close(first[name], again[name], rtol=0, atol=0)
        for (other, _), _ in results[1:]:
            torch.testing.assert_close(first[name], other[name], rtol=0, atol=0)
    fc = first["fc.weight"]
    assert fc.abs().max() <= 6**-0.5
    assert fc.std() > 0.05  # drawn, not left empty or zero
    assert torch.equal(first["norm.weight"], torch.ones(9))
    assert torch.equal(first["norm.bias"], torch.zeros(9))
    assert first["embed.weight"].std() > 0.5  # N(0, 1)
