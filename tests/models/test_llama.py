"""The reference Llama (fczero/models/llama.py): its parameter count is what the config says,
attention is causal, RoPE rotates pairs by position, and tying shares one matrix."""

from __future__ import annotations

import math

import pytest
import torch

from fczero.models import Llama, LlamaConfig
from fczero.models.llama import _apply_rope, _rope_tables

SMALL = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16)


@pytest.mark.parametrize("tie", [False, True])
def test_the_config_counts_the_params_the_model_has(tie):
    cfg = LlamaConfig(**{**SMALL.__dict__, "tie_embeddings": tie})
    model = Llama(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert (model.output.weight is model.embed.weight) is tie


def test_logits_at_a_position_do_not_see_later_tokens():
    torch.manual_seed(0)
    model = Llama(SMALL)
    tokens = torch.randint(0, 64, (2, 8))
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 64
    logits, other = model(tokens), model(changed)
    assert logits.shape == (2, 8, 64)
    torch.testing.assert_close(logits[:, :5], other[:, :5])
    assert not torch.allclose(logits[:, 5:], other[:, 5:])


def test_rope_keeps_norms_and_leaves_position_zero_alone():
    cos, sin = _rope_tables(8, 4)
    x = torch.randn(1, 2, 4, 8)  # (B, heads, T, head_dim)
    rotated = _apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[:, :, 0], x[:, :, 0])
    assert not torch.allclose(rotated[:, :, 1], x[:, :, 1])


def test_the_loss_starts_near_uniform_and_a_bad_width_is_refused():
    torch.manual_seed(0)
    loss = Llama(SMALL).loss(torch.randint(0, 64, (4, 9)))
    assert abs(loss.item() - math.log(64)) < 1.0
    with pytest.raises(ValueError, match=r"dim=30 must be divisible by n_heads=4"):
        LlamaConfig(dim=30, n_heads=4)
