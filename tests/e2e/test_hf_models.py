"""Hugging Face models fczero was not tuned on (random weights from small configs, no
download), on 2 gloo ranks, eagerly, compiled whole and with each block compiled, against
a single-process reference:

- an encoder-decoder, ``T5ForConditionalGeneration``: one embedding tied to both stacks'
  inputs and to the head; the first block of each stack owns the relative attention bias
  the others reuse; module names that hold digits (``t5``), which ``units="auto"`` must
  read as names, not indices;
- a mixture of experts, ``MixtralForCausalLM``: its sparse block loops only over the
  experts that got tokens, each reading its slice of one 3-d param per projection
  (transformers 5 stores the experts so), so the experts a rank skips change its grads,
  not its collectives. (fczero's own models with one module per expert, whose collectives
  would change: tests/runtime/test_units.py.)
- a GPT-2, ``GPT2LMHeadModel``: ``Conv1D`` projections (weights stored transposed), learned
  position embeddings, the head tied to the token embedding;
- an encoder, ``BertForMaskedLM``: bidirectional attention, token-type and position
  embeddings, the masked-LM head's decoder tied to the embedding, LayerNorm everywhere;
- ``AlbertForMaskedLM``: one layer group whose params every layer reuses (the same unit
  runs three times in each forward), a factorized embedding projected up to the width;
- ``BartForConditionalGeneration``: an encoder-decoder with learned positions, the shared
  embedding read by both stacks and tied to the head, cross-attention.

Three more with Hugging Face's own ``gradient_checkpointing_enable()``, compiled whole:
``Qwen2MoeForCausalLM`` (routed and shared experts, grouped-query attention, tied),
``OPTForCausalLM`` (learned positions at an offset) and ``M2M100ForConditionalGeneration``
(sinusoidal positions, one embedding for both stacks and the head).

Compiled whole, the graphs go through fczero's passes as under Inductor (AOT autograd, the
passes, then run eagerly): buckets, prefetch, and with a vocabulary of 1021 the token
embeddings' lookups and grads by touched rows. Skipped when ``transformers`` is not installed.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch._decomp.decompositions import embedding_dense_backward

from fczero.comm.graph_ops import op_name
from fczero.passes.graph_utils import static_sizes
from fczero.passes.matching import NOT_A_PARAM_COLLECTIVE
from fczero.runtime.units import auto_unit_paths
from fczero.testing import parity
from fczero.testing.backends import recording
from fczero.testing.distributed import run_on_ranks
from tests.cases import compile_blocks
from tests.models import token_batches

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (a test extra: pip install -e .[test])"
)

aten = torch.ops.aten
FP32 = {"rtol": 1e-5, "atol": 1e-6}
#: wide enough that a rank's tokens and their rows are under a quarter of each token
#: embedding's bytes, so compiled whole the lookups and grads go by touched rows (pass 0a,
#: fczero/passes/touched_rows.py); odd, so the tables are padded at 2 ranks
VOCAB = 1021
MODES = ("eager", "whole", "blocks")


class T5(nn.Module):
    """``T5ForConditionalGeneration`` returning logits; the tokens feed both stacks."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_decoder_layers=2,
            num_heads=4, dropout_rate=0.0, tie_word_embeddings=True,
            decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        self.t5 = transformers.T5ForConditionalGeneration(config)

    def forward(self, tokens):
        return self.t5(input_ids=tokens, decoder_input_ids=tokens, use_cache=False).logits


def _traceable_experts() -> dict:
    """Experts (Mixtral's, Qwen2-MoE's) as a compiled graph can trace them. Under ``torch.compile`` in fp32,
    transformers runs its grouped matmul through a fallback op, whose backward in 5.17 loops
    in Python over ``offs.tolist()``: AOT autograd cannot trace it, and with fczero's gather
    in the graph Dynamo raises instead of falling back to eager (troubleshooting.md, "A model
    that compiles alone fails to compile under fczero"). Later versions (5.24) make that
    backward an op of its own; with 5.17 the experts take transformers' eager loop."""
    import transformers.integrations.moe  # noqa: F401  (defines the transformers ops)

    if hasattr(torch.ops.transformers, "grouped_mm_fallback_backward"):
        return {}
    return {"experts_implementation": "eager"}


class Mixtral(nn.Module):
    """``MixtralForCausalLM`` returning logits: 8 experts, one per token."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
            num_experts_per_tok=1, max_position_embeddings=64, **_traceable_experts(),
        )  # fmt: skip
        self.lm = transformers.MixtralForCausalLM(config)

    def forward(self, tokens):
        return self.lm(input_ids=tokens, use_cache=False).logits


class GPT2(nn.Module):
    """``GPT2LMHeadModel`` returning logits."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        self.lm = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens):
        return self.lm(input_ids=tokens, use_cache=False).logits


class _MaskedLM(nn.Module):
    """A ``*ForMaskedLM`` returning logits (no mask: every position is predicted)."""

    def __init__(self, model_class, config) -> None:
        super().__init__()
        self.mlm = model_class(config)

    def forward(self, tokens):
        return self.mlm(input_ids=tokens).logits


def Bert() -> nn.Module:
    """``BertForMaskedLM``, 2 layers."""
    return _MaskedLM(transformers.BertForMaskedLM, transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))  # fmt: skip


def Albert() -> nn.Module:
    """``AlbertForMaskedLM``: 3 layers sharing one layer's params."""
    return _MaskedLM(transformers.AlbertForMaskedLM, transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, intermediate_size=40,
        num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))  # fmt: skip


class Bart(nn.Module):
    """``BartForConditionalGeneration`` returning logits; the tokens feed both stacks."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=40,
            decoder_ffn_dim=40, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0,
        )  # fmt: skip
        self.bart = transformers.BartForConditionalGeneration(config)

    def forward(self, tokens):
        return self.bart(input_ids=tokens, decoder_input_ids=tokens, use_cache=False).logits


class _WithItsCheckpointing(nn.Module):
    """A model with Hugging Face's own ``gradient_checkpointing_enable()`` (non-reentrant),
    returning logits; ``both``: the tokens feed an encoder-decoder's two stacks."""

    def __init__(self, model_class, config, both: bool = False) -> None:
        super().__init__()
        self.hf = model_class(config)
        kwargs = {"use_reentrant": False}
        self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.hf.train()
        self.both = both

    def forward(self, tokens):
        stacks = {"decoder_input_ids": tokens} if self.both else {}
        return self.hf(input_ids=tokens, use_cache=False, **stacks).logits


def Qwen2Moe() -> nn.Module:
    """``Qwen2MoeForCausalLM``: 4 routed experts (top 1) and a shared expert per block,
    grouped-query attention, tied embeddings."""
    return _WithItsCheckpointing(transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=1,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        max_position_embeddings=64, tie_word_embeddings=True, **_traceable_experts(),
    ))  # fmt: skip


def Opt() -> nn.Module:
    """``OPTForCausalLM``: learned positions read at an offset of 2, the head tied."""
    return _WithItsCheckpointing(transformers.OPTForCausalLM, transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=40, num_hidden_layers=2,
        num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0,
    ))  # fmt: skip


def M2M100() -> nn.Module:
    """``M2M100ForConditionalGeneration``: sinusoidal positions, scaled token embeddings
    shared by both stacks and the head."""
    config = transformers.M2M100Config(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=40,
        decoder_ffn_dim=40, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return _WithItsCheckpointing(transformers.M2M100ForConditionalGeneration, config, both=True)


#: with their own checkpointing, compiled whole only (fczero's passes on checkpointed graphs)
CHECKPOINTED = {"qwen2moe": Qwen2Moe, "opt": Opt, "m2m100": M2M100}

#: name -> the model; SGD: AdamW's step turns the router's rounding-level grad differences
#: (about 1e-9) into param differences above the fp32 tolerance
MODELS = {"t5": T5, "mixtral": Mixtral, "gpt2": GPT2, "bert": Bert, "albert": Albert, "bart": Bart}
ALL_MODELS = {**MODELS, **CHECKPOINTED}


def _batches():
    return token_batches(steps=3, vocab=VOCAB)


def _with_passes(graphs: list):
    """AOT autograd with fczero's passes, as Inductor runs them, the embedding's backward
    lowered as Inductor lowers it (so the touched-rows pass sees what it sees there); the
    rewritten graphs are appended to ``graphs``."""
    decompositions = {aten.embedding_dense_backward.default: embedding_dense_backward}
    return recording(graphs, decompositions=decompositions)


def _train(rank: int, world: int) -> dict[tuple[str, str], parity.Trace]:
    out = {}
    runs = [(name, mode) for name in MODELS for mode in MODES]
    blocks = functools.partial(compile_blocks, backend="aot_eager")
    for name, mode in runs + [(name, "whole") for name in CHECKPOINTED]:
        # each run compiles a new model with a new backend: without a reset the frames the
        # runs share (fczero's root hooks, transformers' checkpointed layer) reach Dynamo's
        # recompile limit after eight runs and the rest would run them eagerly, uncompiled
        torch._dynamo.reset()
        graphs: list = []
        out[name, mode] = parity.train_parallel(
            rank, world, ALL_MODELS[name], _batches(), parity.cross_entropy,
            finish=blocks if mode == "blocks" else None,
            compile_backend=_with_passes(graphs) if mode == "whole" else None,
        )  # fmt: skip
        out[name, "rows"] = out.get((name, "rows"), 0) + sum(
            1 for g in graphs for n in g.graph.nodes if n.meta.get(NOT_A_PARAM_COLLECTIVE)
        )
        out[name, "symbolic lookups"] = out.get((name, "symbolic lookups"), 0) + sum(
            1
            for g in graphs
            for n in g.graph.nodes
            if n.op == "call_function" and op_name(n) == "embedding" and not static_sizes(n)
        )
    return out


def test_the_blocks_of_both_stacks_are_units():
    units = auto_unit_paths(T5())
    blocks = [u for u in units if ".block." in u]
    assert blocks == [f"t5.{stack}.block.{i}" for stack in ("encoder", "decoder") for i in (0, 1)]


def test_gpt2_bert_albert_and_bart_blocks_are_units():
    assert {"lm.transformer.h.0", "lm.transformer.h.1"} <= set(auto_unit_paths(GPT2()))
    assert {"mlm.bert.encoder.layer.0", "mlm.bert.encoder.layer.1"} <= set(auto_unit_paths(Bert()))
    # ALBERT's one layer group is the unit every layer runs
    assert "mlm.albert.encoder.albert_layer_groups.0" in auto_unit_paths(Albert())
    bart = {f"bart.model.{stack}.layers.{i}" for stack in ("encoder", "decoder") for i in (0, 1)}
    assert bart <= set(auto_unit_paths(Bart()))


@pytest.fixture(scope="module")
def traces():
    # 21 trainings in one set of ranks: 2 min alone on a 2-core machine, 3.5 to over 5 min
    # beside another test worker (past run_on_ranks' default limit of 300 s once)
    return run_on_ranks(_strict_train, 2, timeout_s=900)[0]


def _strict_train(rank: int, world: int) -> dict[tuple[str, str], parity.Trace]:
    """``_train``, where a frame that reaches Dynamo's recompile limit fails the run instead
    of running uncompiled."""
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        return _train(rank, world)


def _opt_traces_its_layers() -> bool:
    """Whether this transformers' OPT decoder draws for layerdrop only when layerdrop is on:
    5.17 draws ``torch.rand([])`` and branches on it at every layer in training, even at
    ``layerdrop=0.0``, and so breaks the compiled graph there (5.24 checks first)."""
    import inspect

    from transformers.models.opt.modeling_opt import OPTDecoder

    return "self.layerdrop > 0" in inspect.getsource(OPTDecoder.forward)


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_compiled_whole_their_embeddings_go_by_touched_rows(traces, name):
    """The lookups and grads of each model's token embedding are rewritten (so the parity
    test below checks the rewrite on each of them): two all-gathers each at least."""
    if name == "opt" and not _opt_traces_its_layers():
        pytest.skip("this transformers' OPT breaks the graph at each layer (its layerdrop draw)")
    if not traces[name, "rows"] and traces[name, "symbolic lookups"]:
        pytest.skip(  # ([Note: the passes leave symbolic sizes alone])
            "its lookups were compiled with symbolic sizes here, which the rewrite leaves alone"
        )
    assert traces[name, "rows"] >= 4


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_trains_like_one_process(traces, name, mode):
    expected = parity.train_reference(MODELS[name], _batches(), parity.cross_entropy)
    parity.assert_close(traces[name, mode], expected, **FP32)


@pytest.mark.parametrize("name", list(CHECKPOINTED))
def test_with_their_own_checkpointing_compiled_whole_trains_like_one_process(traces, name):
    expected = parity.train_reference(CHECKPOINTED[name], _batches(), parity.cross_entropy)
    parity.assert_close(traces[name, "whole"], expected, **FP32)
