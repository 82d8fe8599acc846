"""The offload/reload custom ops: schemas (opcheck), eager and compiled use, and the CUDA path.

On the CPU the copies are synchronous, so values must come back bitwise equal; the
graph tests check that the waits survive tracing and dead-code elimination and that
every reader of a reloaded tensor comes after its wait.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs

from fczero.core import streams
from fczero.core.memory import op_name
from fczero.offload import ops

OPS = {
    "offload": lambda: (torch.randn(3, 5, requires_grad=True),),
    "offload_wait": lambda: (torch.randn(7), torch.randn(7)),
    "reload": lambda: (torch.randn(2, 3, requires_grad=True), torch.device("cpu")),
    "reload_wait": lambda: (torch.randn(4, 2),),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_opcheck(name):
    op = getattr(torch.ops.fczero, name).default
    results = torch.library.opcheck(op, OPS[name]())
    assert set(results.values()) == {"SUCCESS"}, results


def test_schemas_declare_fresh_outputs_and_mutating_waits():
    assert str(torch.ops.fczero.offload.default._schema) == "fczero::offload(Tensor src) -> Tensor"
    assert "Tensor(a0!) host" in str(torch.ops.fczero.offload_wait.default._schema)
    assert "Tensor(a0!) dest" in str(torch.ops.fczero.reload_wait.default._schema)
    assert torch.ops.fczero.reload_wait.default._schema.is_mutable


def _roundtrip(x: torch.Tensor) -> torch.Tensor:
    host = ops.offload(x)
    ops.offload_wait(host, x)
    back = ops.reload(host, x.device)
    ops.reload_wait(back)
    return back


def test_eager_roundtrip_is_bitwise_and_fresh():
    x = torch.randn(6, 4).t()  # non-contiguous source
    back = _roundtrip(x)
    assert torch.equal(back, x)
    assert back.is_contiguous()
    assert back.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert streams.pending_count() == 0


def test_gradients_flow_through_offload_and_reload():
    x = torch.randn(3, 3, requires_grad=True)
    (_roundtrip(x) * torch.arange(9.0).view(3, 3)).sum().backward()
    assert torch.equal(x.grad, torch.arange(9.0).view(3, 3))


def _through_graph(x: torch.Tensor) -> torch.Tensor:
    y = x * 3
    host = torch.ops.fczero.offload(y)
    torch.ops.fczero.offload_wait(host, y)
    back = torch.ops.fczero.reload(host, x.device)
    torch.ops.fczero.reload_wait(back)
    return back.neg()


def test_compiled_graph_keeps_every_op_and_orders_the_wait():
    backend = AotEagerAndRecordGraphs()
    x = torch.randn(5, 5, requires_grad=True)
    out = torch.compile(_through_graph, backend=backend, fullgraph=True)(x)
    out.sum().backward()
    assert torch.equal(out, _through_graph(x))
    expected_grad = torch.full_like(x, -3.0)
    assert torch.equal(x.grad, expected_grad)
    (fw,) = backend.fw_graphs
    names = [op_name(n) for n in fw.graph.nodes if n.op == "call_function"]
    # The mutating waits are functionalized into auto_functionalized_v2 nodes; their
    # first argument names the wait.
    waits = [
        n.args[0].name()
        for n in fw.graph.nodes
        if n.op == "call_function" and "auto_functionalized" in str(n.target)
    ]
    assert "offload" in names and "reload" in names
    assert waits == ["fczero::offload_wait", "fczero::reload_wait"]
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    neg = next(n for n in fw.graph.nodes if op_name(n) == "neg")
    wait = next(
        n
        for n in fw.graph.nodes
        if "auto_functionalized" in str(n.target) and n.args[0].name() == "fczero::reload_wait"
    )
    assert order[wait] < order[neg]


@pytest.mark.slow
def test_inductor_keeps_the_waits():
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(8, 8)
    out, (code, *_) = run_and_get_code(torch.compile(_through_graph, fullgraph=True), x)
    assert torch.equal(out, _through_graph(x))
    for name in ("offload", "offload_wait", "reload", "reload_wait"):
        assert f"torch.ops.fczero.{name}.default(" in code
    # the generated kernel computing neg is called after the wait
    calls = [m.start() for m in re.finditer(r"\n\s+\w*neg\w*\(", code)]
    assert calls and code.index("fczero.reload_wait.default(") < calls[-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_roundtrip_overlaps_on_the_side_stream():
    x = torch.randn(1024, 1024, device="cuda")
    host = ops.offload(x)
    assert host.device.type == "cpu" and host.is_pinned()
    back = ops.reload(host, x.device)
    ops.reload_wait(back)
    assert torch.equal(back, x)
    ops.offload_wait(host, x)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(host, x.cpu())
    assert streams.pending_count() == 0
