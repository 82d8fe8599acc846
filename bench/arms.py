"""The arms of shared/BENCHMARK.md: one builder each, model + optimizer + step function.

Every builder takes an :class:`ArmContext` and returns an :class:`Arm` whose
``step(tokens)`` runs forward, backward and one AdamW step on a (B, T+1) batch and
returns the detached loss. All arms build the same ``Llama`` from the same seed
(on the target device, so every rank starts from the same weights; with ``ctx.hf``, Hugging
Face's ``LlamaForCausalLM`` of the same shape, ``bench.hf_model``) and train it
with ``AdamW(lr, betas=(0.9, 0.95), weight_decay=0)`` (``fused=True`` on CUDA):

| arm | precision | parallelism |
| --- | --- | --- |
| floor | bf16 autocast, fp32 params | none: whole model ``torch.compile``'d on each GPU |
| fsdp2-eager | bf16 params, fp32 reduce | ``fully_shard`` on each block and the root |
| fsdp2-compiled | same | same, each block ``.compile()``'d |
| ddp | bf16 autocast, fp32 params | ``DistributedDataParallel`` |
| fczero-eager | bf16 params, fp32 reduce | ``fczero.parallelize`` (stage 3) |
| fczero-compiled | same | same, then ``torch.compile`` of the whole model |
| deepspeed-zero3 | DeepSpeed bf16 | ZeRO-3, ``overlap_comm`` |
| deepspeed-deepcompile | DeepSpeed bf16 | ZeRO-3 + DeepCompile (``engine.compile()``) |
| fsdp2-cpuoffload | bf16 params, fp32 reduce | FSDP2 eager with ``CPUOffloadPolicy`` |
| fczero-memory-eager | same | fczero eager, optimizer states offloaded, step in 512 MiB chunks |
| fczero-memory | same | fczero compiled, activation offload ``all``, states offloaded |
| fczero-adaptive-eager | same | fczero eager, AdamW states offloaded only where the default budget has no room (``device_bytes="auto"``), step in 512 MiB chunks |
| fczero-adaptive | same | the same compiled, activation offload ``auto`` |
| fczero-params-offload | same | fczero compiled, activation offload ``all``, ``offload_params``, AdamW stepped on the GPU in 512 MiB chunks |
| fczero-params-offload-cpu-step | same | the same, AdamW stepped on the CPU |
| fczero-params-offload-eager | same | fczero eager, ``offload_params``, AdamW stepped on the GPU in 512 MiB chunks |
| deepspeed-offload | DeepSpeed bf16 | ZeRO-3, ``offload_param`` and ``offload_optimizer`` on the CPU (pinned), ``DeepSpeedCPUAdam`` |

The last nine (group ``memory``, not in ``all``) are for ``bench.capacity``, with the same
optimizer settings. FSDP2's ``CPUOffloadPolicy`` arm and the ``-cpu-step`` arm step AdamW on
the CPU (``torch.optim.AdamW``); ``fczero-params-offload`` streams shards, grads and states
through the GPU for the step (``offload_optimizer_states`` over offloaded params);
DeepSpeed steps its own CPU Adam (a C++ op built at first use; where it does not build,
the arm says why in its note and steps ``torch.optim.AdamW`` on the CPU instead). Every arm
builds the model on the GPU from the same seed, so all start from the same weights: the
offload arms then move it to host memory param by param, and the GPU holds the whole fp32
model only while it is built (4 bytes a param: 80 GB covers 20B params, more than host
memory holds for any offload arm here). Building in host memory instead would draw the
weights from the CPU's generator, one thread: about 2 minutes per arm for a 4B model.

DeepSpeed is imported inside its builders only: it is a benchmark-only dependency. An
arm whose optional package is missing raises :class:`ArmUnavailable` and is recorded as
skipped, with the reason.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from bench.hf_model import HFLlama
from bench.metrics import StepFn
from fczero.models.llama import Llama, LlamaConfig

logger = logging.getLogger("fczero.bench")

BF16 = torch.bfloat16


class ArmUnavailable(RuntimeError):
    """This arm cannot run here (an optional package is missing): skipped, with the reason."""


@dataclass(frozen=True, kw_only=True)
class ArmContext:
    """What every builder needs; the same for all arms of one regime."""

    cfg: LlamaConfig
    mesh: DeviceMesh
    device: torch.device
    batch: int
    """Sequences per rank per step."""
    seq_len: int
    seed: int = 0
    lr: float = 3e-4
    compile_backend: str = "inductor"
    """Backend for the compiled arms (``inductor``; ``eager``/``aot_eager`` to debug on CPU)."""
    hf: bool = False
    """Build Hugging Face's ``LlamaForCausalLM`` of ``cfg``'s shape (``bench.hf_model``)
    instead of fczero's ``Llama``."""


@dataclass(kw_only=True)
class Arm:
    """A built arm: the step function and what to release afterwards."""

    step: StepFn
    keep: list[object] = field(default_factory=list)
    """Objects that hold the arm's memory; dropped after the arm."""
    close: Callable[[], None] | None = None
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class ArmSpec:
    name: str
    label: str
    build: Callable[[ArmContext], Arm]
    communicates: bool = True
    """False for the floor: it trains on local gradients, so its loss is not compared."""
    min_warmup: int = 1
    """Warm-up steps this arm needs at least (DeepCompile recompiles at step 5)."""
    needs_cuda: bool = False
    """True for CUDA-graph arms: left out of a CPU run."""
    host_init: bool = False
    """True where the model is built in host memory: the CPU's generator gives other
    initial weights than the GPU's (same seed), so its loss is compared with the first
    such arm's, not with FSDP2 eager's."""


class LossModule(nn.Module):
    """``forward(tokens)`` is ``model.loss(tokens)``: what DDP, DeepSpeed and ``torch.compile`` call.

    With ``autocast_dtype`` the loss runs under ``torch.autocast`` (fp32 params, bf16 matmuls).
    """

    def __init__(self, model: Llama | HFLlama, autocast_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.model = model
        self.autocast_dtype = autocast_dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: (B, T+1)
        if self.autocast_dtype is None:
            return self.model.loss(tokens)
        with torch.autocast(tokens.device.type, dtype=self.autocast_dtype):
            return self.model.loss(tokens)


def build_model(ctx: ArmContext, device: torch.device | None = None) -> Llama | HFLlama:
    """The same initial weights on every rank and in every arm (on ``device``, default the arm's)."""
    torch.manual_seed(ctx.seed)
    with torch.device(device or ctx.device):
        return HFLlama(ctx.cfg) if ctx.hf else Llama(ctx.cfg)


def adamw(params: object, ctx: ArmContext, *, fused: bool = True) -> torch.optim.Optimizer:
    """The arms' AdamW: fused on CUDA unless ``fused=False`` (then torch's default kernels)."""
    return torch.optim.AdamW(
        params,
        lr=ctx.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        fused=True if fused and ctx.device.type == "cuda" else None,  # type: ignore[arg-type]
    )


class TrainStep:
    """One optimizer step: ``module(tokens)`` is the loss; then backward, step, zero_grad.

    ``cuda_graphs``: the module was compiled with ``mode="reduce-overhead"``; each step
    then opens a new CUDA-graph generation and clones the loss out of the graph's pool
    (the next replay overwrites it). ``phases`` (``bench.phases``) times the three parts.
    """

    def __init__(
        self,
        module: Callable[[torch.Tensor], torch.Tensor],
        opt: torch.optim.Optimizer,
        cuda_graphs: bool = False,
    ) -> None:
        self.module, self.opt, self.cuda_graphs = module, opt, cuda_graphs

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self.module(tokens)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        loss = self.forward(tokens)
        self.backward(loss)
        self.update()
        return loss.detach().clone() if self.cuda_graphs else loss.detach()


def train_step(
    module: Callable[[torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    cuda_graphs: bool = False,
) -> TrainStep:
    return TrainStep(module, opt, cuda_graphs)


CUDA_GRAPHS = "reduce-overhead"
"""``torch.compile`` mode of the CUDA-graph arms (Inductor's CUDA-graph trees)."""


def _floor(ctx: ArmContext, *, mode: str | None = None) -> Arm:
    root = LossModule(build_model(ctx), autocast_dtype=BF16)
    opt = adamw(root.parameters(), ctx)
    compiled = torch.compile(root, backend=ctx.compile_backend, mode=mode)
    return Arm(step=train_step(compiled, opt, mode == CUDA_GRAPHS), keep=[root, compiled, opt])


def build_floor(ctx: ArmContext) -> Arm:
    return _floor(ctx)


def build_floor_eager(ctx: ArmContext) -> Arm:
    """The model's own eager step (autocast, no comm): no eager system that runs the
    model's ops one by one can step faster."""
    root = LossModule(build_model(ctx), autocast_dtype=BF16)
    opt = adamw(root.parameters(), ctx)
    return Arm(step=train_step(root, opt), keep=[root, opt])


def build_floor_cuda_graphs(ctx: ArmContext) -> Arm:
    return _floor(ctx, mode=CUDA_GRAPHS)


def build_floor_per_block(ctx: ArmContext) -> Arm:
    """The floor with each block compiled on its own (``block.compile()``), the rest eager:
    the faster floor on some checkpointed models (the realistic regime takes the better)."""
    model = build_model(ctx)
    root = LossModule(model, autocast_dtype=BF16)
    for block in model.layers:
        block.compile(backend=ctx.compile_backend)
    opt = adamw(root.parameters(), ctx)
    return Arm(step=train_step(root, opt), keep=[root, opt])


def wrap_blocks_for_checkpointing(model: Llama, mode: str) -> None:
    """Each block of fczero's Llama in a checkpoint wrapper (``mode`` full or selective), as
    torchtitan applies it: FSDP2's hooks then sit outside the checkpointed region, so its
    recompute sees the bf16 inputs the forward saw (with the model's own checkpointing the
    hooks run inside the region, and torch 2.11's FSDP2 does not cast in the recompute)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fczero.models.llama import keep_matmuls

    selective = {"context_fn": keep_matmuls} if mode == "selective" else {}
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, **selective)


def _fsdp2(ctx: ArmContext, *, compile_blocks: bool, compile_whole: bool = False) -> Arm:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    own_checkpointing = not ctx.hf and ctx.cfg.checkpointing != "none"
    if own_checkpointing:  # torchtitan's order: checkpoint wrapper, then compile, then shard
        model = build_model(replace(ctx, cfg=replace(ctx.cfg, checkpointing="none")))
        wrap_blocks_for_checkpointing(model, ctx.cfg.checkpointing)
    else:
        model = build_model(ctx)
    root = LossModule(model)
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=ctx.mesh, mp_policy=mp)
    fully_shard(root, mesh=ctx.mesh, mp_policy=mp)
    if compile_blocks:
        for block in model.layers:
            block.compile(backend=ctx.compile_backend)
    opt = adamw(root.parameters(), ctx)
    step = torch.compile(root, backend=ctx.compile_backend) if compile_whole else root
    return Arm(step=train_step(step, opt), keep=[root, step, opt])


def build_fsdp2_eager(ctx: ArmContext) -> Arm:
    return _fsdp2(ctx, compile_blocks=False)


def build_fsdp2_compiled(ctx: ArmContext) -> Arm:
    return _fsdp2(ctx, compile_blocks=True)


def build_fsdp2_compiled_whole(ctx: ArmContext) -> Arm:
    return _fsdp2(ctx, compile_blocks=False, compile_whole=True)


def build_ddp(ctx: ArmContext) -> Arm:
    from torch.nn.parallel import DistributedDataParallel

    root = LossModule(build_model(ctx), autocast_dtype=BF16)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(root, device_ids=device_ids, process_group=ctx.mesh.get_group())
    opt = adamw(ddp.parameters(), ctx)
    return Arm(step=train_step(ddp, opt), keep=[ddp, root, opt])


def _comm(**fields: object):
    import fczero

    return fczero.CommPolicy(**fields)


def _fczero_mp():  # bf16 compute, fp32 reduce: what every fczero arm runs
    import fczero

    return fczero.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)


def _fczero(
    ctx: ArmContext,
    *,
    compiled: bool,
    inductor_options: dict[str, object] | None = None,
    mode: str | None = None,
    **options: object,
) -> Arm:
    import fczero

    root = LossModule(build_model(ctx))
    fczero.parallelize(root, ctx.mesh, mp_policy=_fczero_mp(), **options)
    opt = adamw(root.parameters(), ctx)
    module = root
    if compiled:
        module = torch.compile(
            root, backend=ctx.compile_backend, options=inductor_options, mode=mode
        )
    return Arm(step=train_step(module, opt, mode == CUDA_GRAPHS), keep=[root, module, opt])


def build_fczero_eager(ctx: ArmContext) -> Arm:
    return _fczero(ctx, compiled=False)


def build_fczero_compiled(ctx: ArmContext) -> Arm:
    return _fczero(ctx, compiled=True)


def build_fczero_cuda_graphs(ctx: ArmContext) -> Arm:
    return _fczero(ctx, compiled=True, mode=CUDA_GRAPHS)


def build_fczero_per_block(ctx: ArmContext, **options: object) -> Arm:
    """fczero with each block compiled on its own after ``parallelize`` (torchtitan's way),
    the rest eager: one block's compile for the first step, whatever the depth; the gathers
    stay eager around each compiled body, recorded and prefetched a block ahead, in forward
    and in the recompute of a checkpointed block ([Note: blocks compiled alone])."""
    import fczero

    model = build_model(ctx)
    root = LossModule(model)
    fczero.parallelize(root, ctx.mesh, mp_policy=_fczero_mp(), **options)
    fczero.compile_blocks(root, backend=ctx.compile_backend)
    opt = adamw(root.parameters(), ctx)
    return Arm(step=train_step(root, opt), keep=[root, opt])


def build_fczero_compiled_reuse(ctx: ArmContext) -> Arm:
    """Whole-model compile with ``units.REUSE_BLOCKS``: one compiled body for every block of
    a class, the gathers outside it (experimental; restored when the arm closes)."""
    import torch._functorch.config as functorch_config

    from fczero.runtime import units

    before, units.REUSE_BLOCKS = units.REUSE_BLOCKS, True
    donated = functorch_config.donated_buffer  # (parallelize turns it off for the regions)
    arm = _fczero(ctx, compiled=True)

    def close() -> None:
        units.REUSE_BLOCKS = before
        functorch_config.donated_buffer = donated

    return Arm(step=arm.step, keep=arm.keep, close=close)


def build_fczero_eager_per_read(ctx: ArmContext) -> Arm:
    """Units off (``units=None``): each read gathers on its own, as before units."""
    return _fczero(ctx, compiled=False, units=None)


def build_fczero_compiled_per_read(ctx: ArmContext) -> Arm:
    return _fczero(ctx, compiled=True, units=None)


def build_fczero_cuda_graphs_per_read(ctx: ArmContext) -> Arm:
    return _fczero(ctx, compiled=True, mode=CUDA_GRAPHS, units=None)


def build_fczero_cuda_graphs_auto(ctx: ArmContext) -> Arm:
    """CUDA graphs with ``keep_unsharded="auto"``: blocks stay gathered from forward to
    backward where the memory budget has room (planned after the second step)."""
    return _fczero(ctx, compiled=True, mode=CUDA_GRAPHS, comm_policy=_comm(keep_unsharded="auto"))


def build_fczero_cuda_graphs_keep_all(ctx: ArmContext) -> Arm:
    """CUDA graphs without resharding after forward: what backward's regathers cost."""
    return _fczero(ctx, compiled=True, mode=CUDA_GRAPHS, reshard_after_forward=False)


def build_fczero_compiled_no_passes(ctx: ArmContext) -> Arm:
    return _fczero(ctx, compiled=True, comm_policy=_comm(compile_passes=False))


def build_fczero_compiled_two_blocks(ctx: ArmContext) -> Arm:
    """256 MiB buckets (two benchmark blocks each), against the default 128 MiB (one block)."""
    return _fczero(ctx, compiled=True, comm_policy=_comm(bucket_bytes=256 * 2**20))


def build_fczero_keep_all(ctx: ArmContext) -> Arm:
    """No resharding after forward: every unsharded param lives until backward."""
    return _fczero(ctx, compiled=True, reshard_after_forward=False)


def build_fczero_regather(ctx: ArmContext) -> Arm:
    """Every gathered param freed after forward and gathered again in backward, as FSDP2
    does (``keep_unsharded=0``; the default keeps one shard's worth)."""
    return _fczero(ctx, compiled=True, comm_policy=_comm(keep_unsharded=0))


def build_fczero_per_block_regather(ctx: ArmContext) -> Arm:
    """Each block compiled on its own, every gathered param freed after forward and gathered
    again in backward, as FSDP2 does (``keep_unsharded=0``)."""
    return build_fczero_per_block(ctx, comm_policy=_comm(keep_unsharded=0))


def build_fczero_unshard_512mib(ctx: ArmContext) -> Arm:
    """Selective unsharding: the last blocks (head, norm, about three decoder blocks of the
    benchmark model) stay gathered from forward to backward."""
    return _fczero(ctx, compiled=True, comm_policy=_comm(keep_unsharded=512 * 2**20))


_OVERLAP = "aten_distributed_optimizations.enable_overlap_scheduling"


def _inductor_overlap_options() -> dict[str, object]:
    """Inductor's own overlap scheduler (GPU only; it also buckets), if this torch has it."""
    group = getattr(torch._inductor.config, "aten_distributed_optimizations", None)
    if group is None or not hasattr(group, "enable_overlap_scheduling"):
        raise RuntimeError(
            f"this torch ({torch.__version__}) has no inductor config {_OVERLAP!r}; "
            "the Inductor-overlap arms need a newer torch."
        )
    return {_OVERLAP: True}


def build_fczero_inductor_overlap(ctx: ArmContext) -> Arm:
    """fczero's passes off; Inductor's overlap scheduler buckets and reorders instead."""
    return _fczero(
        ctx,
        compiled=True,
        comm_policy=_comm(compile_passes=False),
        inductor_options=_inductor_overlap_options(),
    )


def build_fczero_symm_mem(ctx: ArmContext) -> Arm:
    """fczero's passes, then every bucket's collective swapped for Inductor's copy-engine
    symmetric-memory variant (``enable_low_contention_collectives``)."""
    group = getattr(torch._inductor.config, "aten_distributed_optimizations", None)
    if group is None or not hasattr(group, "enable_low_contention_collectives"):
        raise RuntimeError(
            f"this torch ({torch.__version__}) has no Inductor low-contention collectives; "
            "the symmetric-memory arm needs a newer torch."
        )
    prefix = "aten_distributed_optimizations."
    options = {
        prefix + "enable_low_contention_collectives": True,
        prefix + "low_contention_skip_overlap_check": True,
        prefix + "low_contention_min_bytes_per_rank": 0,
    }
    return _fczero(ctx, compiled=True, inductor_options=options)


class _ThenPeerCopyGathers:
    """fczero's post-grad passes, then every all-gather they leave swapped for torch's
    low-contention all-gather (``symm_mem._low_contention_all_gather``: each rank copies its
    peers' shards out of a symmetric-memory workspace on the copy engines, no NCCL kernel).
    Torch 2.11 has the op but not Inductor's pass that uses it, so this measures the lever
    there. No uuid: Inductor's FX graph cache is bypassed for this arm."""

    def __init__(self) -> None:
        from fczero.passes.install import FczeroPostGradPass

        self.fczero = FczeroPostGradPass([])

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        self.fczero(graph)
        c10d = torch.ops._c10d_functional
        gathers = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default)
        copy_gather = torch.ops.symm_mem._low_contention_all_gather.default
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in gathers:
                continue
            group_name = node.args[2]
            enable_symm_mem_for_group(group_name)
            with graph.inserting_before(node):
                swapped = graph.call_function(copy_gather, (node.args[0], group_name))
            swapped.meta = dict(node.meta)
            node.replace_all_uses_with(swapped)
            graph.erase_node(node)

    def uuid(self) -> None:
        return None


def build_fczero_peer_copy(ctx: ArmContext) -> Arm:
    """fczero compiled with its all-gathers on the copy engines (``_ThenPeerCopyGathers``)."""
    import torch.distributed._symmetric_memory  # noqa: F401 (defines the symm_mem ops)
    from torch._inductor.custom_graph_pass import CustomGraphPass

    chain = type("PeerCopyPass", (_ThenPeerCopyGathers, CustomGraphPass), {})()
    return _fczero(ctx, compiled=True, inductor_options={"post_grad_custom_post_pass": chain})


def build_fczero_whole_table(ctx: ArmContext) -> Arm:
    """fczero compiled, every embedding's grad reduce-scattered whole (no touched rows)."""
    return _fczero(ctx, compiled=True, comm_policy=_comm(sparse_embedding_grads=False))


def build_fczero_separate_reduce(ctx: ArmContext) -> Arm:
    """fczero compiled, the reduce-scatters on a communicator of their own."""
    return _fczero(ctx, compiled=True, comm_policy=_comm(separate_reduce_group=True))


def build_fczero_cuda_graphs_separate_reduce(ctx: ArmContext) -> Arm:
    return _fczero(
        ctx, compiled=True, mode=CUDA_GRAPHS, comm_policy=_comm(separate_reduce_group=True)
    )


def build_fczero_passes_then_overlap(ctx: ArmContext) -> Arm:
    """fczero's passes, then Inductor's overlap scheduler (it runs after custom post-grad passes)."""
    return _fczero(ctx, compiled=True, inductor_options=_inductor_overlap_options())

def build_fsdp2_cpuoffload(ctx: ArmContext) -> Arm:
    """FSDP2 keeping sharded params, grads and AdamW state in pinned host memory (step on CPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = build_model(ctx)  # fully_shard moves each shard to pinned host memory
    root = LossModule(model)
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True)
    for block in model.layers:
        fully_shard(block, mesh=ctx.mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(root, mesh=ctx.mesh, mp_policy=mp, offload_policy=offload)
    opt = torch.optim.AdamW(root.parameters(), lr=ctx.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return Arm(step=train_step(root, opt), keep=[root, opt])


def _fczero_offloading(
    ctx: ArmContext, *, compiled: bool, offload, states: dict | None, fused: bool = True
) -> Arm:
    """fczero with ``offload`` (an ``OffloadPolicy``) and, unless ``states`` is None, its
    AdamW states offloaded (``states``: ``offload_optimizer_states``'s keywords).

    Built on the GPU: parallelize swaps one param at a time for its shard (or moves it to
    pinned host memory, under param offload), so the build peaks at the fp32 model (no more
    than training needs), while a host build would need the whole model in host memory once
    per rank next to the offloaded states. ``fused=False``: AdamW's default kernels (params
    in host memory)."""
    import fczero

    root = LossModule(build_model(ctx))
    fczero.parallelize(root, ctx.mesh, mp_policy=_fczero_mp(), offload_policy=offload)
    opt = adamw(root.parameters(), ctx, fused=fused)
    handle = None if states is None else fczero.offload_optimizer_states(opt, **states)
    module = torch.compile(root, backend=ctx.compile_backend) if compiled else root
    return Arm(step=train_step(module, opt), keep=[root, module, opt, handle])


def _fczero_memory(ctx: ArmContext, *, compiled: bool) -> Arm:
    """Every AdamW state offloaded. Eager: the step in 512 MiB chunks of params (no step
    holds every state on the GPU); compiled: one whole step (the configuration measured on
    2 x H200, docs/memory.md), activations offloaded too."""
    from fczero import OffloadPolicy

    offload = OffloadPolicy(activations="all" if compiled else "off")
    chunk = None if compiled else 512 * 2**20
    return _fczero_offloading(ctx, compiled=compiled, offload=offload, states={"chunk_bytes": chunk})


def _fczero_adaptive(ctx: ArmContext, *, compiled: bool) -> Arm:
    """What a user of fczero's memory features runs: only what does not fit moves off the
    GPU. AdamW states stay on the GPU as far as the default budget (90% of the device) has
    room above forward and backward's peak, the rest are in pinned host memory, and the step
    streams them in 512 MiB chunks of params; compiled, activations are offloaded as far
    as the planned peak needs to fit the same budget."""
    from fczero import OffloadPolicy

    offload = OffloadPolicy(activations="auto" if compiled else "off")
    states = {"device_bytes": "auto", "chunk_bytes": 512 * 2**20}
    return _fczero_offloading(ctx, compiled=compiled, offload=offload, states=states)


def build_fczero_adaptive_eager(ctx: ArmContext) -> Arm:
    return _fczero_adaptive(ctx, compiled=False)


def build_fczero_adaptive(ctx: ArmContext) -> Arm:
    return _fczero_adaptive(ctx, compiled=True)


def _fczero_params_offload(ctx: ArmContext, *, device_step: bool, compiled: bool = True) -> Arm:
    """Shards, grads and AdamW state in pinned host memory (``OffloadPolicy(params=True)``): what FSDP2's
    CPUOffloadPolicy keeps off the GPU; compiled, activations too. ``device_step``: AdamW
    runs on the GPU, 512 MiB of params at a time."""
    from fczero import OffloadPolicy

    offload = OffloadPolicy(params=True, activations="all" if compiled else "off")
    states = {"chunk_bytes": 512 * 2**20} if device_step else None
    return _fczero_offloading(ctx, compiled=compiled, offload=offload, states=states, fused=False)


def build_fczero_params_offload(ctx: ArmContext) -> Arm:
    return _fczero_params_offload(ctx, device_step=True)


def build_fczero_params_offload_cpu_step(ctx: ArmContext) -> Arm:
    return _fczero_params_offload(ctx, device_step=False)


def build_fczero_params_offload_eager(ctx: ArmContext) -> Arm:
    return _fczero_params_offload(ctx, device_step=True, compiled=False)


def build_fczero_memory_eager(ctx: ArmContext) -> Arm:
    return _fczero_memory(ctx, compiled=False)


def build_fczero_memory(ctx: ArmContext) -> Arm:
    return _fczero_memory(ctx, compiled=True)


def deepspeed_config(batch: int, *, deepcompile: bool) -> dict[str, object]:
    """ZeRO-3, bf16, overlapped communication; DeepCompile on top when asked."""
    config: dict[str, object] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if deepcompile:
        config["compile"] = {"deepcompile": True}
    return config


def fix_cuda_arch_list(device: torch.device) -> None:
    """DeepSpeed's op builder cannot parse arch suffixes (``9.0a``): name plain ``9.0``.

    The GPU machine sets ``TORCH_CUDA_ARCH_LIST=9.0a``; DeepSpeed's builder fails on it with
    "invalid literal for int() ... '0a'" (shared/BENCHMARK.md). Only JIT-built extensions
    read this variable.
    """
    current = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if current is None:
        major, minor = torch.cuda.get_device_capability(device)
        fixed = f"{major}.{minor}"
    else:
        fixed = re.sub(r"(\d+\.\d+)[a-zA-Z]+", r"\1", current)
    if fixed != current:
        logger.info("TORCH_CUDA_ARCH_LIST=%s for DeepSpeed's op builder (was %s)", fixed, current)
        os.environ["TORCH_CUDA_ARCH_LIST"] = fixed


def _deepspeed(ctx: ArmContext, *, deepcompile: bool) -> Arm:
    if ctx.device.type != "cuda":
        raise RuntimeError("the DeepSpeed arms run on CUDA GPUs only")
    fix_cuda_arch_list(ctx.device)
    import deepspeed  # benchmark-only dependency, carried as wheels to the GPU machine

    root = LossModule(build_model(ctx))
    opt = adamw(root.parameters(), ctx)
    engine, _, _, _ = deepspeed.initialize(
        model=root, optimizer=opt, config=deepspeed_config(ctx.batch, deepcompile=deepcompile)
    )
    if deepcompile:
        engine.compile()
    return _engine_arm(engine, [root, opt], f"deepspeed {deepspeed.__version__}")


def _engine_arm(engine, keep: list[object], note: str) -> Arm:
    """A DeepSpeed engine as an arm: its own forward, backward and step."""

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    def close() -> None:
        if hasattr(engine, "destroy"):
            engine.destroy()

    return Arm(step=step, keep=[engine, *keep], close=close, note=note)


def deepspeed_offload_config(ctx: ArmContext, *, cpu_adam: bool = True) -> dict[str, object]:
    """ZeRO-3 with params and optimizer state offloaded to pinned CPU memory, bf16, and the
    AdamW of the other arms named in the config (so DeepSpeed builds its CPU Adam for it;
    ``cpu_adam=False``: ``torch.optim.AdamW`` on the CPU instead)."""
    adamw_params: dict[str, object] = {
        "lr": ctx.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0
    }  # fmt: skip
    if not cpu_adam:
        adamw_params["torch_adam"] = True
    offload = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": ctx.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": adamw_params},
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            "offload_param": dict(offload), "offload_optimizer": dict(offload),
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _load_cpu_adam() -> tuple[str | None, float]:
    """Build (JIT, at first use; cached for later processes on the machine) and load
    DeepSpeed's CPU Adam op: (None, seconds) if it loaded, else (why not, seconds)."""
    start = time.perf_counter()
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
    except Exception as e:  # noqa: BLE001 - any build failure: the arm falls back and says so
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        return reason[:300] + (" ..." if len(reason) > 300 else ""), time.perf_counter() - start
    return None, time.perf_counter() - start


def build_deepspeed_offload(ctx: ArmContext) -> Arm:
    """DeepSpeed's ZeRO-Offload/Infinity on the CPU: what users pick to train a model larger
    than the GPU on one GPU. DeepSpeed casts the params to bf16 and partitions them into
    pinned host memory as ``initialize`` runs."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ArmUnavailable(
            "deepspeed is not importable here (carry it as wheels: shared/BENCHMARK.md)"
        )
    if ctx.device.type != "cuda":
        raise ArmUnavailable("DeepSpeed's offload arm runs on CUDA GPUs only")
    fix_cuda_arch_list(ctx.device)
    import deepspeed  # benchmark-only dependency, carried as wheels to the GPU machine

    failure, seconds = _load_cpu_adam()
    if failure is None:
        adam = f"DeepSpeedCPUAdam (built and loaded in {seconds:.0f} s)"
    else:
        adam = f"DeepSpeedCPUAdam did not build ({failure}); torch.optim.AdamW on the CPU instead"
        logger.warning("deepspeed-offload: %s", adam)
    root = LossModule(build_model(ctx))
    engine, _, _, _ = deepspeed.initialize(
        model=root,
        model_parameters=root.parameters(),
        config=deepspeed_offload_config(ctx, cpu_adam=failure is None),
    )
    return _engine_arm(engine, [root], f"deepspeed {deepspeed.__version__}; {adam}")


def build_deepspeed_zero3(ctx: ArmContext) -> Arm:
    return _deepspeed(ctx, deepcompile=False)


def build_deepspeed_deepcompile(ctx: ArmContext) -> Arm:
    return _deepspeed(ctx, deepcompile=True)


ARMS: dict[str, ArmSpec] = {
    spec.name: spec
    for spec in (
        ArmSpec(
            name="floor", label="floor (compiled, no comm)", build=build_floor, communicates=False
        ),
        ArmSpec(
            name="floor-cudagraphs",
            label="floor, CUDA graphs (reduce-overhead)",
            build=build_floor_cuda_graphs,
            communicates=False,
            needs_cuda=True,
        ),
        ArmSpec(
            name="floor-per-block",
            label="floor, each block compiled",
            build=build_floor_per_block,
            communicates=False,
        ),
        ArmSpec(
            name="floor-eager",
            label="floor eager (autocast, no comm)",
            build=build_floor_eager,
            communicates=False,
        ),
        ArmSpec(name="fsdp2-eager", label="FSDP2 eager", build=build_fsdp2_eager),
        ArmSpec(
            name="fsdp2-compiled", label="FSDP2 compiled per block", build=build_fsdp2_compiled
        ),
        ArmSpec(
            name="fsdp2-compiled-whole",
            label="FSDP2 per block, whole model compiled",
            build=build_fsdp2_compiled_whole,
        ),
        ArmSpec(name="ddp", label="DDP (autocast)", build=build_ddp),
        ArmSpec(name="fczero-eager", label="fczero eager", build=build_fczero_eager),
        ArmSpec(
            name="fczero-nopasses",
            label="fczero compiled, passes off",
            build=build_fczero_compiled_no_passes,
        ),
        ArmSpec(name="fczero-compiled", label="fczero compiled", build=build_fczero_compiled),
        ArmSpec(
            name="fczero-per-block",
            label="fczero, each block compiled",
            build=build_fczero_per_block,
        ),
        ArmSpec(
            name="fczero-per-block-regather",
            label="fczero, each block compiled, keep_unsharded=0",
            build=build_fczero_per_block_regather,
        ),
        ArmSpec(
            name="fczero-compiled-reuse",
            label="fczero compiled, each block class compiled once (REUSE_BLOCKS)",
            build=build_fczero_compiled_reuse,
        ),
        ArmSpec(
            name="fczero-eager-per-read",
            label="fczero eager, units=None (each read gathers)",
            build=build_fczero_eager_per_read,
        ),
        ArmSpec(
            name="fczero-compiled-per-read",
            label="fczero compiled, units=None (each read gathers)",
            build=build_fczero_compiled_per_read,
        ),
        ArmSpec(
            name="fczero-cudagraphs-per-read",
            label="fczero compiled, CUDA graphs, units=None (each read gathers)",
            build=build_fczero_cuda_graphs_per_read,
            needs_cuda=True,
        ),
        ArmSpec(
            name="fczero-cudagraphs",
            label="fczero compiled, CUDA graphs (reduce-overhead)",
            build=build_fczero_cuda_graphs,
            needs_cuda=True,
        ),
        ArmSpec(
            name="fczero-regather",
            label="fczero compiled, keep_unsharded=0",
            build=build_fczero_regather,
        ),
        ArmSpec(
            name="fczero-keep-all-cudagraphs",
            label="fczero compiled, CUDA graphs, no reshard after forward",
            build=build_fczero_cuda_graphs_keep_all,
            needs_cuda=True,
        ),
        ArmSpec(
            name="fczero-auto-cudagraphs",
            label="fczero compiled, CUDA graphs, keep_unsharded=auto",
            build=build_fczero_cuda_graphs_auto,
            needs_cuda=True,
            min_warmup=6,
        ),
        ArmSpec(
            name="fczero-256mib",
            label="fczero compiled, 256 MiB buckets",
            build=build_fczero_compiled_two_blocks,
        ),
        ArmSpec(
            name="fczero-unshard-512mib",
            label="fczero compiled, 512 MiB kept unsharded",
            build=build_fczero_unshard_512mib,
        ),
        ArmSpec(
            name="fczero-keep-all",
            label="fczero compiled, no reshard after forward",
            build=build_fczero_keep_all,
        ),
        ArmSpec(
            name="fczero-inductor-overlap",
            label="fczero compiled, Inductor overlap scheduler instead of passes",
            build=build_fczero_inductor_overlap,
        ),
        ArmSpec(
            name="fczero-passes+overlap",
            label="fczero compiled, passes then Inductor overlap scheduler",
            build=build_fczero_passes_then_overlap,
        ),
        ArmSpec(
            name="fczero-symm-mem",
            label="fczero compiled, symmetric-memory (copy engine) collectives",
            build=build_fczero_symm_mem,
        ),
        ArmSpec(
            name="fczero-peer-copy",
            label="fczero compiled, all-gathers as peer copies (symmetric memory, copy engines)",
            build=build_fczero_peer_copy,
        ),
        ArmSpec(
            name="fczero-whole-table",
            label="fczero compiled, embedding grads reduce-scattered whole",
            build=build_fczero_whole_table,
        ),
        ArmSpec(
            name="fczero-separate-reduce",
            label="fczero compiled, reduce-scatters on their own communicator",
            build=build_fczero_separate_reduce,
        ),
        ArmSpec(
            name="fczero-cudagraphs-separate-reduce",
            label="fczero compiled, CUDA graphs, reduce-scatters on their own communicator",
            build=build_fczero_cuda_graphs_separate_reduce,
            needs_cuda=True,
        ),
        ArmSpec(
            name="deepspeed-zero3",
            label="DeepSpeed ZeRO-3 (bf16, overlap_comm)",
            build=build_deepspeed_zero3,
        ),
        ArmSpec(
            name="deepspeed-deepcompile",
            label="DeepSpeed DeepCompile (ZeRO-3)",
            build=build_deepspeed_deepcompile,
            min_warmup=8,
        ),
        ArmSpec(
            name="fsdp2-cpuoffload",
            label="FSDP2 eager, CPUOffloadPolicy",
            build=build_fsdp2_cpuoffload,
        ),
        ArmSpec(
            name="fczero-memory-eager",
            label="fczero eager, optimizer states offloaded",
            build=build_fczero_memory_eager,
        ),
        ArmSpec(
            name="fczero-memory",
            label="fczero compiled, activation + optimizer offload",
            build=build_fczero_memory,
        ),
        ArmSpec(
            name="fczero-adaptive-eager",
            label="fczero eager, AdamW states offloaded where the budget has no room",
            build=build_fczero_adaptive_eager,
        ),
        ArmSpec(
            name="fczero-adaptive",
            label="fczero compiled, AdamW states and activations offloaded within the budget",
            build=build_fczero_adaptive,
        ),
        ArmSpec(
            name="fczero-params-offload",
            label="fczero compiled, param + activation offload (GPU step)",
            build=build_fczero_params_offload,
        ),
        ArmSpec(
            name="fczero-params-offload-cpu-step",
            label="fczero compiled, param + activation offload (CPU step)",
            build=build_fczero_params_offload_cpu_step,
        ),
        ArmSpec(
            name="fczero-params-offload-eager",
            label="fczero eager, param offload (GPU step)",
            build=build_fczero_params_offload_eager,
        ),
        ArmSpec(
            name="deepspeed-offload",
            label="DeepSpeed ZeRO-3, offload_param + offload_optimizer (CPU Adam)",
            build=build_deepspeed_offload,
        ),
    )
}
"""Every arm, in the order they run: the floor first (ratios), FSDP2 eager next (loss reference)."""

_OVERLAP_ARMS = [
    "fczero-inductor-overlap", "fczero-passes+overlap", "fczero-symm-mem",
    "fczero-separate-reduce", "fczero-cudagraphs-separate-reduce", "fczero-peer-copy",
    "fczero-whole-table",
]  # fmt: skip

MEMORY_ARMS = [
    "fsdp2-cpuoffload",
    "fczero-memory-eager",
    "fczero-memory",
    "fczero-adaptive-eager",
    "fczero-adaptive",
    "fczero-params-offload",
    "fczero-params-offload-cpu-step",
    "fczero-params-offload-eager",
    "deepspeed-offload",
]
"""Capacity arms (bench.capacity): left out of ``all`` (DeepSpeed's last: it patches torch)."""

GROUPS: dict[str, list[str]] = {
    "all": [name for name in ARMS if name not in MEMORY_ARMS],
    "memory": MEMORY_ARMS,
    "core": [
        n
        for n in ARMS
        if not n.startswith("deepspeed") and n not in _OVERLAP_ARMS and n not in MEMORY_ARMS
    ],
    "deepspeed": [n for n in ARMS if n.startswith("deepspeed") and n not in MEMORY_ARMS],
    "fczero": [
        "fczero-eager", "fczero-nopasses", "fczero-compiled", "fczero-cudagraphs", "fczero-256mib"
    ],
    "cudagraphs": ["floor-cudagraphs", "fczero-cudagraphs"],
    # units (the default) against each read gathering (units=None)
    "units": [
        "fczero-eager", "fczero-eager-per-read", "fczero-compiled", "fczero-compiled-per-read",
        "fczero-cudagraphs", "fczero-cudagraphs-per-read",
    ],
    # regime R (``--model llama3-3b`` or ``hf-llama3-3b``, ``--regimes R``): both floors,
    # FSDP2 both ways, fczero whole and per block
    "realistic": [
        "floor", "floor-per-block", "fsdp2-compiled", "fsdp2-compiled-whole", "fczero-compiled",
        "fczero-per-block", "fczero-cudagraphs",
    ],
    "unshard": [
        "fczero-regather", "fczero-unshard-512mib", "fczero-keep-all",
        "fczero-keep-all-cudagraphs", "fczero-auto-cudagraphs", "fczero-per-block-regather",
    ],
    "overlap": _OVERLAP_ARMS,
    "fsdp2": ["fsdp2-eager", "fsdp2-compiled"],
}
"""Names ``--arms`` accepts besides single arms."""


def select_arms(arms: str, skip: str = "", as_given: bool = False) -> list[ArmSpec]:
    """``"all"``, ``"core,deepspeed-zero3"``, ... minus ``skip``; in :data:`ARMS` order, or
    with ``as_given`` in the order ``arms`` names them (a group's arms in ``ARMS`` order where
    the group is named): running a pair both ways tells an arm's cost from its place."""
    wanted: set[str] = set()
    for name in _split(arms):
        if name in GROUPS:
            wanted.update(GROUPS[name])
        elif name in ARMS:
            wanted.add(name)
        else:
            raise ValueError(
                f"unknown arm {name!r}; pick from {', '.join([*GROUPS, *ARMS])} (comma-separated)."
            )
    for name in _split(skip):
        if name not in ARMS and name not in GROUPS:
            raise ValueError(f"unknown arm {name!r} in --skip; arms are {', '.join(ARMS)}.")
        wanted.difference_update(GROUPS.get(name, [name]))
    if not as_given:
        return [spec for name, spec in ARMS.items() if name in wanted]
    order: list[str] = []
    for name in _split(arms):
        for arm in GROUPS.get(name, [name]):
            if arm in wanted and arm not in order:
                order.append(arm)
    return [ARMS[name] for name in order]


def _split(names: str) -> list[str]:
    return [n.strip() for n in names.split(",") if n.strip()]
