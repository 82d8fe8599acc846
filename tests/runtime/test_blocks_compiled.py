"""Blocks compiled on their own ([Note: blocks compiled alone] in fczero/runtime/units.py):
``block.compile()`` after ``parallelize`` compiles the block's body once for every block of
its class, leaves the gathers eager (recorded, prefetched), recompiles at most once when the
batch or the sequence changes, and still lets a whole-model ``torch.compile`` trace the
gathers. Parity with the one-process reference: tests/e2e/test_numerics.py (gloo),
tests/e2e/test_gpu.py (NCCL), tests/e2e/test_hf_llama.py (Hugging Face's checkpointing)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo.testing
import torch.utils.checkpoint
from torch.distributed.device_mesh import init_device_mesh

import fczero
from fczero.models import Llama, LlamaConfig
from fczero.testing import parity
from fczero.testing.backends import recording
from fczero.testing.distributed import run_on_ranks
from fczero.testing.graphs import collective_sequence
from tests.cases import FP32

FOUR_BLOCKS = LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=2, ffn_dim=40)


def _parallel_llama(cfg: LlamaConfig = FOUR_BLOCKS) -> Llama:
    torch.manual_seed(0)
    return fczero.parallelize(Llama(cfg), init_device_mesh("cpu", (2,)))


def _step(model: Llama, batch: int, seq: int) -> None:
    tokens = torch.randint(0, 64, (batch, seq))
    model(tokens).float().pow(2).mean().backward()


def test_every_block_of_a_class_shares_one_compiled_body_without_gathers(fake_pg):
    model = _parallel_llama()
    graphs: list = []
    counter = torch._dynamo.testing.CompileCounterWithBackend(recording(graphs))
    for block in model.layers:
        block.compile(backend=counter)
    for _ in range(3):  # the first forward records the gathers, later ones prefetch
        _step(model, 2, 8)
    assert counter.frame_count == 1  # four blocks, three steps: one compile
    assert graphs, "the block body was never compiled"
    for graph in graphs:  # the body's graphs hold no collective: the unit gathers eagerly
        assert collective_sequence(graph) == [], collective_sequence(graph)


#: batch x sequence per step: a short last batch, then shorter sequences, twice over
SHAPES = [(4, 8), (4, 8), (3, 8), (4, 6), (4, 8), (3, 5), (4, 7)]


def test_a_changed_batch_or_sequence_compiles_once_per_changed_size(fake_pg):
    """Dynamo compiles static sizes first, makes a size dynamic when it changes (one
    recompile each for the batch and the sequence), and reuses that body from then on, in
    every block. (A batch of one would compile once more: Dynamo specializes sizes 0 and 1.
    The whole-model compile: tests/e2e/test_recompiles.py.)"""
    model = _parallel_llama()
    counter = torch._dynamo.testing.CompileCounterWithBackend(recording())
    for block in model.layers:
        block.compile(backend=counter)
    counts = []
    for batch, seq in SHAPES * 2:
        _step(model, batch, seq)
        counts.append(counter.frame_count)
    assert counts[: len(SHAPES)] == [1, 1, 2, 3, 3, 3, 3]
    assert counts[len(SHAPES) :] == [3] * len(SHAPES)  # the second pass compiles nothing


def _whole_model_collectives(compile_blocks_first: bool) -> list[str]:
    torch._dynamo.reset()
    model = _parallel_llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=40))
    if compile_blocks_first:
        for block in model.layers:
            block.compile(backend="eager")
    graphs: list = []
    compiled = torch.compile(model, backend=recording(graphs), fullgraph=True)
    compiled(torch.randint(0, 64, (2, 8))).float().pow(2).mean().backward()
    return [c for graph in graphs for c in collective_sequence(graph)]


def test_whole_model_compile_still_traces_the_gathers_after_block_compile(fake_pg):
    """``torch.compile(model)`` ignores the blocks' own compile: the gathers and reduces stay
    in its graphs, where the passes place them, as without it."""
    with_blocks = _whole_model_collectives(compile_blocks_first=True)
    assert any("all_gather" in c for c in with_blocks), with_blocks
    assert with_blocks == _whole_model_collectives(compile_blocks_first=False)


def test_a_block_compiled_before_parallelize_is_told_to_compile_after(fake_pg, caplog):
    torch.manual_seed(0)
    model = Llama(FOUR_BLOCKS)
    for block in model.layers:
        block.compile(backend="eager")
    with caplog.at_level(logging.WARNING, logger="fczero"):
        fczero.parallelize(model, init_device_mesh("cpu", (2,)))
    said = [r.getMessage() for r in caplog.records if "compiled before parallelize" in r.getMessage()]
    assert len(said) == 1, said  # one line for all four blocks
    assert "4 unit(s)" in said[0] and "layers.0" in said[0] and "after parallelize" in said[0]
    _step(model, 2, 8)  # and it still trains, its gathers traced into its graph


def test_compiling_blocks_says_once_what_does_not_apply(fake_pg, caplog):
    model = _parallel_llama()
    with caplog.at_level(logging.INFO, logger="fczero"):
        for block in model.layers:
            block.compile(backend="eager")
    said = [r.getMessage() for r in caplog.records if "compiles on its own" in r.getMessage()]
    assert len(said) == 1 and "graph passes" in said[0], said


def test_blocks_run_uncompiled_under_a_selective_checkpoint_and_say_so_once(fake_pg, caplog):
    """fczero's Llama with selective checkpointing runs each block under an eager selective
    checkpoint, in forward and in the recompute: the blocks then run their plain forward
    (the compiled body raised a CheckpointError there on 4 x H200), with one warning; with
    full checkpointing the compiled body runs."""
    if torch.cuda.is_available():  # (else the first compile, inside a checkpoint that keeps
        torch.cuda.init()  # the RNG state, initializes CUDA there, which the checkpoint refuses)
    for mode, compiled_frames in (("selective", 0), ("full", 1)):
        model = _parallel_llama(LlamaConfig(**{**FOUR_BLOCKS.__dict__, "checkpointing": mode}))
        counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
        for block in model.layers:
            block.compile(backend=counter)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fczero"):
            for _ in range(2):
                _step(model, 2, 8)
        said = [r.getMessage() for r in caplog.records if "runs uncompiled" in r.getMessage()]
        assert counter.frame_count == compiled_frames, mode
        assert len(said) == (1 if mode == "selective" else 0), said
        if said:
            assert "'layers.0'" in said[0] and "torch.compile(model)" in said[0]


# ---- fczero.compile_blocks: the one call that finds the blocks and compiles each ----


class _Holder(torch.nn.Module):
    """A wrapper around a parallelized model (the user's loss module, say)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model


def test_compile_blocks_compiles_every_block_once_and_leaves_the_rest_eager(fake_pg):
    model = _parallel_llama()
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    paths = fczero.compile_blocks(_Holder(model), backend=counter)
    assert paths == [f"model.layers.{i}" for i in range(4)]
    for _ in range(2):
        _step(model, 2, 8)
    assert counter.frame_count == 1  # one body for the four blocks
    compiled = {path: module.__dict__["_fczero"].unit.compiled is not None
                for path, module in model.named_modules()
                if getattr(module.__dict__.get("_fczero"), "unit", None) is not None}  # fmt: skip
    assert compiled == {"embed": False, "norm": False, "output": False,
                        **{f"layers.{i}": True for i in range(4)}}, compiled  # fmt: skip


def test_compile_blocks_leaves_the_experts_inside_a_block_to_the_block(fake_pg):
    """Experts named as units inside the blocks (a class of several, in an nn.ModuleList)
    go with their block's compiled body. (Both stacks of an encoder-decoder:
    tests/e2e/test_encoder_decoder.py.)"""
    from tests.models.moe import loop_moe

    torch.manual_seed(0)
    moe = loop_moe()
    expert_class = type(moe.layers[0].moe.experts[0])
    fczero.parallelize(moe, init_device_mesh("cpu", (2,)),
                       units=[type(moe.layers[0]), expert_class])  # fmt: skip
    paths = fczero.compile_blocks(moe, backend="eager")
    assert paths == [f"layers.{i}" for i in range(len(moe.layers))], paths


def _refusal(model: torch.nn.Module) -> str:
    """The message of the ValueError that ``compile_blocks(model)`` raises."""
    with pytest.raises(ValueError) as caught:
        fczero.compile_blocks(model)
    return str(caught.value)


def test_compile_blocks_says_what_to_do_with_a_model_it_cannot_serve(fake_pg):
    said = _refusal(Llama(FOUR_BLOCKS))  # never parallelized
    assert "not parallelized" in said and "fczero.parallelize(model, mesh)" in said
    per_read = fczero.parallelize(Llama(FOUR_BLOCKS), init_device_mesh("cpu", (2,)), units=None)
    said = _refusal(per_read)  # no units
    assert "units=None" in said and "units='auto'" in said
    no_blocks = fczero.parallelize(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.LayerNorm(4)),
        init_device_mesh("cpu", (2,)),
    )
    said = _refusal(no_blocks)
    assert "Linear, LayerNorm" in said or "LayerNorm, Linear" in said, said
    assert "torch.compile(model)" in said and "units=[YourBlockClass]" in said
    assert all(getattr(m.__dict__.get("_fczero"), "unit", None) is None
               or m.__dict__["_fczero"].unit.compiled is None
               for m in no_blocks.modules())  # nothing compiled  # fmt: skip


def test_compile_blocks_takes_a_lone_block_and_leaves_a_sequentials_odd_members(fake_pg):
    one_block = fczero.parallelize(
        Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=40)),
        init_device_mesh("cpu", (2,)),
    )
    assert fczero.compile_blocks(one_block, backend="eager") == ["layers.0"]
    torch.manual_seed(0)
    stack = torch.nn.Sequential(
        torch.nn.Embedding(64, 32), *(Llama(FOUR_BLOCKS).layers[:2]), torch.nn.Linear(32, 64)
    )
    fczero.parallelize(stack, init_device_mesh("cpu", (2,)))
    assert fczero.compile_blocks(stack, backend="eager") == ["1", "2"]
    # two embeddings of one class outside any container (GPT-2's token and position
    # tables) are units of a repeated class, but not blocks
    two_tables = torch.nn.Module()
    two_tables.tok, two_tables.pos = torch.nn.Embedding(64, 32), torch.nn.Embedding(16, 32)
    two_tables.layers = Llama(FOUR_BLOCKS).layers[:2]
    fczero.parallelize(two_tables, init_device_mesh("cpu", (2,)))
    assert fczero.compile_blocks(two_tables, backend="eager") == ["layers.0", "layers.1"]


class _TiedAcrossBlocks(torch.nn.Module):
    """Three checkpointed blocks, the third's weight tied to the second's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.blocks[2].weight = self.blocks[1].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (no RNG state to keep: on a machine with CUDA, torch.compile's first call inside
        # the checkpoint initializes CUDA, which a checkpoint that keeps it refuses)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(
                _tanh_of, block, x, use_reentrant=False, preserve_rng_state=False
            )
        return x


def _tanh_of(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(block(x))


def _blocks_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)) for _ in range(3)]


def _train_blocks_compiled(
    rank: int, world: int, build: type[torch.nn.Module]
) -> tuple[list[str], parity.Trace]:
    """One rank trains ``build()`` with ``fczero.compile_blocks`` (aot_eager); the blocks it
    compiled and the trace."""
    compiled: list[str] = []

    def blocks(model: torch.nn.Module) -> None:
        compiled.extend(fczero.compile_blocks(model, backend="aot_eager"))

    trace = parity.train_parallel(
        rank, world, build, _blocks_batches(), parity.mse, finish=blocks
    )
    return compiled, trace


def test_a_weight_tied_across_checkpointed_blocks_compiled_alone_trains_like_one_process():
    """[Note: a tied param in a block compiled alone]: backward recomputes the third block,
    whose compiled body reads the second block's weight; nothing held it there, and the
    recompute traced another graph (CheckpointError) before the unit gathered it itself."""
    expected = parity.train_reference(_TiedAcrossBlocks, _blocks_batches(), parity.mse)
    for _, trace in run_on_ranks(_train_blocks_compiled, 2, _TiedAcrossBlocks):
        parity.assert_close(trace, expected, **FP32)


class _ParametrizedBlocks(torch.nn.Module):
    """Two linear blocks in a ModuleList, the first weight-normed, the second with a low-rank
    update on its weight (a LoRA made with ``torch.nn.utils.parametrize``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        torch.nn.utils.parametrizations.weight_norm(self.blocks[0])
        torch.nn.utils.parametrize.register_parametrization(self.blocks[1], "weight", _LowRank())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


class _LowRank(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(4, 16) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(16, 4) * 0.1)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.b @ self.a


def test_parametrized_blocks_are_blocks_and_train_like_one_process():
    """``torch.nn.utils.parametrize`` gives each parametrized module a class of its own; the
    blocks still count as blocks of their container (before, none did, and the refusal
    named one class for two)."""
    expected = parity.train_reference(_ParametrizedBlocks, _blocks_batches(), parity.mse)
    for compiled, trace in run_on_ranks(_train_blocks_compiled, 2, _ParametrizedBlocks):
        assert compiled == ["blocks.0", "blocks.1"]
        parity.assert_close(trace, expected, **FP32)
