"""An encoder-decoder: Hugging Face's ``T5ForConditionalGeneration`` (random weights from a
small config, no download) under fczero on 2 gloo ranks, eagerly, compiled whole and with
each block compiled, against a single-process reference.

T5 ties one embedding to the encoder's and the decoder's inputs and to the head, its
first block of each stack owns the relative attention bias the others reuse, and its
module names hold digits (``t5``), which ``units="auto"`` must read as names, not
indices. Skipped when ``transformers`` is not installed.
"""

from __future__ import annotations

import functools

import pytest
import torch.nn as nn

from fczero.runtime.units import auto_unit_paths
from fczero.testing import parity
from fczero.testing.distributed import run_on_ranks
from tests.cases import compile_blocks
from tests.models import token_batches

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (a test extra: pip install -e .[test])"
)

FP32 = {"rtol": 1e-5, "atol": 1e-6}
MODES = ("eager", "whole", "blocks")


class T5(nn.Module):
    """``T5ForConditionalGeneration`` returning logits; the tokens feed both stacks."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_decoder_layers=2,
            num_heads=4, dropout_rate=0.0, tie_word_embeddings=True,
            decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        self.t5 = transformers.T5ForConditionalGeneration(config)

    def forward(self, tokens):
        return self.t5(input_ids=tokens, decoder_input_ids=tokens, use_cache=False).logits


def _train(rank: int, world: int) -> dict[str, parity.Trace]:
    out = {}
    for mode in MODES:
        finish = functools.partial(compile_blocks, backend="aot_eager") if mode == "blocks" else None
        out[mode] = parity.train_parallel(
            rank, world, T5, token_batches(steps=3), parity.cross_entropy, optimizer="adamw",
            lr=1e-3, finish=finish, compile_backend="aot_eager" if mode == "whole" else None,
        )  # fmt: skip
    return out


def test_the_blocks_of_both_stacks_are_units():
    units = auto_unit_paths(T5())
    blocks = [u for u in units if ".block." in u]
    assert blocks == [f"t5.{stack}.block.{i}" for stack in ("encoder", "decoder") for i in (0, 1)]


@pytest.fixture(scope="module")
def traces():
    return run_on_ranks(_train, 2)[0]


@pytest.mark.parametrize("mode", MODES)
def test_t5_trains_like_one_process(traces, mode):
    expected = parity.train_reference(
        T5, token_batches(steps=3), parity.cross_entropy, optimizer="adamw", lr=1e-3
    )
    parity.assert_close(traces[mode], expected, **FP32)
