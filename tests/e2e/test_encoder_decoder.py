"""PyTorch's own encoder-decoder, ``nn.Transformer`` (its ``nn.MultiheadAttention`` reads
``in_proj_weight`` inside ``F.multi_head_attention_forward``), on 2 gloo ranks: eager,
compiled whole and with each encoder block compiled, against a single-process reference.
Hugging Face's T5: tests/e2e/test_hf_models.py."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from fczero.runtime.units import auto_unit_paths
from fczero.testing import parity
from fczero.testing.distributed import run_on_ranks
from tests.cases import FP32, compile_blocks
from tests.models import token_batches

MODES = ("eager", "whole", "blocks")


class Seq2Seq(nn.Module):
    """An embedding, ``nn.Transformer`` (2 + 2 layers) on the same tokens, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.transformer = nn.Transformer(
            d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
            dim_feedforward=40, dropout=0.0, batch_first=True,
        )  # fmt: skip
        self.head = nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(self.transformer(x, x))


def _train(rank: int, world: int) -> dict[str, parity.Trace]:
    blocks = functools.partial(compile_blocks, backend="aot_eager")
    return {
        mode: parity.train_parallel(
            rank, world, Seq2Seq, token_batches(steps=3), parity.cross_entropy,
            finish=blocks if mode == "blocks" else None,
            compile_backend="aot_eager" if mode == "whole" else None,
        )  # fmt: skip
        for mode in MODES
    }


def test_each_layer_of_both_stacks_is_a_unit():
    assert [u for u in auto_unit_paths(Seq2Seq()) if ".layers." in u] == [
        f"transformer.{stack}.layers.{i}" for stack in ("encoder", "decoder") for i in (0, 1)
    ]


@pytest.fixture(scope="module")
def traces():
    return run_on_ranks(_train, 2)[0]


@pytest.mark.parametrize("mode", MODES)
def test_trains_like_one_process(traces, mode):
    expected = parity.train_reference(Seq2Seq, token_batches(steps=3), parity.cross_entropy)
    parity.assert_close(traces[mode], expected, **FP32)
