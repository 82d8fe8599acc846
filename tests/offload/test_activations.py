"""Activation offload: graphs, numerics against the run without offload, and the planner.

Graph tests compile a parallelized model under the fake process group with the
``aot_eager_with_passes`` backend (whose partitioner is fczero's); numerics run two
gloo ranks and compare bitwise with the same training without offload; planner tests
call ``offload_activations`` on forward/backward pairs of a plain MLP.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn as nn
from functorch.compile import aot_function, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.comm.graph_ops import op_name
from fczero.offload.activations import offload_activations, planned_peak
from fczero.passes import registry
from fczero.testing import backends
from fczero.testing.distributed import run_on_ranks
from tests.models import ThreeBlocks
from tests.snapshots import SNAPSHOT_TORCH, FakeGroupTestCase

MEMORY_OPS = {"offload", "offload_wait", "reload", "reload_wait", "all_gather_into_tensor",
              "all_gather_into_tensor_out", "mm"}  # fmt: skip

#: every activation of any size to host memory
OFFLOAD_ALL = fczero.OffloadPolicy(activations="all", activation_min_bytes=0)


def sequence(gm: torch.fx.GraphModule) -> str:
    """Memory ops and matmuls in graph order, with what each reads (a compact snapshot)."""
    lines = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and op_name(n) in MEMORY_OPS:
            args = ", ".join(a.name for a in n.args if isinstance(a, torch.fx.Node))
            lines.append(f"{n.name} = {op_name(n)}({args})")
    return "\n".join(lines)


class GraphTest(FakeGroupTestCase):
    def setUp(self) -> None:
        super().setUp()

    def compile(self, **options) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        torch._dynamo.reset()  # a second model must compile afresh (not reuse the first's code)
        graphs: list[torch.fx.GraphModule] = []
        torch.manual_seed(0)
        model = fczero.parallelize(ThreeBlocks(64), init_device_mesh("cpu", (2,)), **options)
        self.model = model
        out = torch.compile(model, backend=backends.recording(graphs))(torch.randn(8, 64))
        out.sum().backward()
        fw, bw = graphs
        return fw, bw

    def check_structure(self, bw: torch.fx.GraphModule) -> None:
        # every wait comes after its reload and before any other reader of the reloaded tensor
        pos = {n: i for i, n in enumerate(bw.graph.nodes)}
        reloads = bw.graph.find_nodes(op="call_function", target=torch.ops.fczero.reload.default)
        for reload in reloads:
            (wait,) = [u for u in reload.users if op_name(u) == "reload_wait"]
            readers = [u for u in reload.users if u is not wait]
            assert readers and pos[reload] < pos[wait] < min(pos[u] for u in readers)
        (plan,) = registry.settings_of("0").plans
        assert len(plan.offloaded) == 3 and plan.hoisted == 2
        assert plan.peak_after < plan.peak_before
        assert {name for name, _ in plan.offloaded} == {"relu", "relu_1", "relu_2"}

    def test_all_offloads_every_activation_and_reloads_ahead(self):
        fw, bw = self.compile(offload_policy=OFFLOAD_ALL)
        self.check_structure(bw)
        if not torch.__version__.startswith(SNAPSHOT_TORCH):
            pytest.skip(f"snapshots recorded with torch {SNAPSHOT_TORCH}")
        self.assertExpectedInline(
            sequence(fw),
            """\
all_gather_into_tensor_out_default = all_gather_into_tensor_out(copy__default)
all_gather_into_tensor_out_default_1 = all_gather_into_tensor_out(copy__default_1)
offload_default = offload(relu)
all_gather_into_tensor_out_default_2 = all_gather_into_tensor_out(copy__default_2)
offload_default_1 = offload(relu_1)
offload_wait_default = offload_wait(offload_default, relu)
offload_default_2 = offload(relu_2)
offload_wait_default_1 = offload_wait(offload_default_1, relu_1)
mm = mm(relu_2, t_3)
offload_wait_default_2 = offload_wait(offload_default_2, relu_2)""",
        )

        self.assertExpectedInline(
            sequence(bw),
            """\
reload_default_2 = reload(relu_2)
reload_default_1 = reload(relu_1)
reload_wait_default_2 = reload_wait(reload_default_2)
mm_1 = mm(t_4, reload_default_2)
all_gather_into_tensor_out_default = all_gather_into_tensor_out(copy__default)
all_gather_into_tensor_out_default_1 = all_gather_into_tensor_out(copy__default_1)
mm_2 = mm(tangents_1, t_6)
all_gather_into_tensor_out_default_2 = all_gather_into_tensor_out(copy__default_2)
mm_3 = mm(threshold_backward, t_8)
reload_default = reload(relu)
reload_wait_default_1 = reload_wait(reload_default_1)
mm_4 = mm(t_9, reload_default_1)
mm_5 = mm(threshold_backward_1, t_12)
reload_wait_default = reload_wait(reload_default)
mm_6 = mm(t_13, reload_default)
mm_7 = mm(t_16, primals_3)""",
        )

    def test_memory_report_lists_the_plan_and_plots_it(self):
        self.compile(offload_policy=OFFLOAD_ALL)
        report = fczero.memory_report(self.model)
        text = str(report)
        (plan,) = report.plans
        assert "activations='all'" in text and "offloaded relu_1" in text
        assert "not measured (CPU)" in text
        assert f"{plan.peak_before / 2**20:.2f} MiB -> {plan.peak_after / 2**20:.2f} MiB" in text
        # the curves are the memory model's: their maxima are the planned peaks
        assert max(plan.curve_after[0] + plan.curve_after[1]) == plan.peak_after
        assert max(plan.curve_before[0] + plan.curve_before[1]) == plan.peak_before
        with tempfile.TemporaryDirectory() as tmp:
            path = report.plot(os.path.join(tmp, "memory.png"))
            with open(path, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        with pytest.raises(ValueError, match="call fczero.parallelize"):
            fczero.memory_report(nn.Linear(2, 2))

    def test_a_new_model_starts_a_new_report_and_cpu_says_nothing_is_saved(self):
        self.compile()
        with self.assertWarnsRegex(RuntimeWarning, "no memory is saved"):
            self.compile(offload_policy=OFFLOAD_ALL)
        (plan,) = fczero.memory_report(self.model).plans
        assert plan.mode == "all" and plan.device_type == "cpu"

    @pytest.mark.slow
    def test_inductor_compiles_the_offload(self):
        from torch._inductor.utils import run_and_get_code

        torch.manual_seed(0)
        model = fczero.parallelize(
            ThreeBlocks(64),
            init_device_mesh("cpu", (2,)),
            offload_policy=fczero.OffloadPolicy(activations="all", activation_min_bytes=0),
        )
        compiled = torch.compile(model)

        def step():
            compiled(torch.randn(8, 64)).sum().backward()

        _, (fw_code, bw_code) = run_and_get_code(step)
        assert fw_code.count("torch.ops.fczero.offload.default(") == 3
        assert bw_code.count("torch.ops.fczero.reload.default(") == 3
        assert bw_code.count("torch.ops.fczero.reload_wait.default(") == 3

    def test_off_changes_nothing(self):
        fw, bw = self.compile()
        names = {op_name(n) for g in (fw, bw) for n in g.graph.nodes}
        assert not names & {"offload", "reload", "reload_wait"}
        (plan,) = registry.settings_of("0").plans  # recorded (for memory_report), empty
        assert plan.mode == "off" and not plan.offloaded and plan.peak_after == plan.peak_before


def _train(rank: int, world_size: int, offload: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = fczero.parallelize(
        ThreeBlocks(64),
        init_device_mesh("cpu", (world_size,)),
        offload_policy=fczero.OffloadPolicy(activations=offload, activation_min_bytes=0),
    )
    graphs: list[torch.fx.GraphModule] = []
    compiled = torch.compile(model, backend=backends.recording(graphs))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3 + rank)
    for _ in range(2):
        compiled(torch.randn(8, 64, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    names = {op_name(n) for g in graphs for n in g.graph.nodes}
    assert ("reload_wait" in names) == (offload == "all")
    return [p._local_tensor.clone() for p in model.parameters()]


def _both(rank: int, world_size: int) -> bool:
    plain = _train(rank, world_size, "off")
    torch._dynamo.reset()
    offloaded = _train(rank, world_size, "all")
    return all(torch.equal(a, b) for a, b in zip(plain, offloaded))


def test_training_with_offload_is_bitwise_equal_on_two_ranks():
    assert run_on_ranks(_both, 2) == [True, True]


# -- the planner on hand-built forward/backward pairs ------------------------------------


class MLP(nn.Module):
    """Activations of 4 KiB (relu, 16x64 fp32) and 8 KiB (the wider hidden layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 128)
        self.c = nn.Linear(128, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _pair():
    """The forward and backward graphs (and num_fwd_outputs) of MLP on a 16x32 batch."""
    captured = {}

    def capture(joint, inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        captured.update(fw=fw, bw=bw, n=kwargs["num_fwd_outputs"])
        return fw, bw

    model = MLP()
    params = [p.detach().requires_grad_() for p in model.parameters()]

    def fn(x, *ps):
        return torch.func.functional_call(
            model, dict(zip(dict(model.named_parameters()), ps)), (x,)
        )

    def boxed(gm, _):
        return make_boxed_func(gm.forward)

    compiled = aot_function(fn, fw_compiler=boxed, bw_compiler=boxed, partition_fn=capture)
    compiled(torch.randn(16, 32), *params).sum().backward()
    return captured["fw"], captured["bw"], captured["n"]


def test_planner_all_takes_everything_above_min_bytes():
    fw, bw, n = _pair()
    plan = offload_activations(fw, bw, n, mode="all", min_bytes=5000, budget=None)
    assert [size for _, size in plan.offloaded] == [8192]
    assert all(size < 5000 for _, size, why in plan.kept if "min_bytes" in why)


def test_planner_auto_without_budget_keeps_everything():
    fw, bw, n = _pair()
    before = (fw.code, bw.code)
    plan = offload_activations(fw, bw, n, mode="auto", min_bytes=0, budget=None)
    assert plan.offloaded == [] and (fw.code, bw.code) == before


def test_planner_auto_takes_largest_first_until_within_budget():
    fw, bw, n = _pair()
    peak = max(planned_peak(fw.graph), planned_peak(bw.graph))
    plan = offload_activations(fw, bw, n, mode="auto", min_bytes=0, budget=peak - 1)
    assert [size for _, size in plan.offloaded] == [8192]  # the largest one was enough
    assert plan.peak_after <= peak - 1 < plan.peak_before
    assert any(why == "the planned peak is within the budget" for *_, why in plan.kept)
    # the offloaded graphs still compute the same gradients
    assert {op_name(x) for x in bw.graph.nodes} >= {"reload", "reload_wait"}


def _two_outputs_graph(device: str) -> torch.fx.Graph:
    """``x -> (x * x on device, a copy of it in host memory)``, values as fake tensors: a
    device activation of 1,024 bytes and a host one of 4,096."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(256, device=device)
        on_device = torch.empty(256, device=device)
        on_host = torch.empty(1024, device="cpu")
    g = torch.fx.Graph()
    inp = g.placeholder("primals_1")
    inp.meta["val"] = x
    a = g.call_function(torch.ops.aten.mul.Tensor, (inp, inp))
    a.meta["val"] = on_device
    b = g.call_function(torch.ops.aten._to_copy.default, (a,))
    b.meta["val"] = on_host
    g.output((a, b))
    return g


def test_planned_peak_leaves_host_tensors_out_of_a_device_graph():
    """On a device graph a tensor in host memory costs no device bytes; on a CPU graph
    every tensor is device memory. (Graph inputs count in neither.)"""
    assert planned_peak(_two_outputs_graph("cuda")) == 1024
    assert planned_peak(_two_outputs_graph("cpu")) == 1024 + 4096


def test_planner_budget_below_minimum_names_it():
    fw, bw, n = _pair()
    with pytest.raises(ValueError, match=r"at least \d+ bytes .* Raise memory_budget to \d+"):
        offload_activations(fw, bw, n, mode="auto", min_bytes=0, budget=1)


def test_options_are_validated():
    with pytest.raises(ValueError, match="activations='some'; use 'off', 'auto'"):
        fczero.OffloadPolicy(activations="some")
    with pytest.raises(ValueError, match="activation_min_bytes=-1 is negative"):
        fczero.OffloadPolicy(activation_min_bytes=-1)
