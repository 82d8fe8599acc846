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


def test_grouped_query_attention_shares_each_kv_head_among_its_query_heads():
    """n_kv_heads=2 of 4: the fused projection is (D + 2 * kv) wide; with each kv head's
    weights copied from a full-attention model's first head of its group, the outputs agree."""
    torch.manual_seed(0)
    gqa = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=40))
    full = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, ffn_dim=40))
    assert gqa.layers[0].attn.wqkv.weight.shape == (32 + 2 * 16, 32)
    assert gqa.cfg.num_params() == sum(p.numel() for p in gqa.parameters())
    state = {k: v for k, v in gqa.state_dict().items() if "wqkv" not in k}
    q, k, v = gqa.layers[0].attn.wqkv.weight.detach().split([32, 16, 16])
    hd = 8  # each kv head (8 rows) serves query heads 2i and 2i + 1
    k_full, v_full = (t.view(2, hd, 32).repeat_interleave(2, dim=0).reshape(32, 32) for t in (k, v))
    state["layers.0.attn.wqkv.weight"] = torch.cat([q, k_full, v_full])
    full.load_state_dict(state)
    tokens = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(gqa(tokens), full(tokens))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_changes_no_number(mode):
    def grads(checkpointing: str):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40,
                          checkpointing=checkpointing)  # fmt: skip
        model = Llama(cfg)
        model.loss(torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    expected, actual = grads("none"), grads(mode)
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, msg=name)


def test_the_realistic_preset_is_llama_3_2_3b_shaped():
    cfg = LlamaConfig.llama3_3b()
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.ffn_dim) == (3072, 28, 24, 8, 8192)
    assert cfg.tie_embeddings and cfg.vocab_size == 128256 and cfg.checkpointing == "full"
    assert round(cfg.num_params() / 1e9, 2) == 3.21
    with pytest.raises(ValueError, match="n_kv_heads=5 must divide n_heads=4"):
        LlamaConfig(dim=32, n_heads=4, n_kv_heads=5)
    with pytest.raises(ValueError, match="checkpointing='some'"):
        LlamaConfig(checkpointing="some")


def test_the_scale_preset_is_llama_3_8b_shaped():
    """Llama-3-8B's 8,030,261,248 params, counted by hand from the shape and on the meta device."""
    cfg = LlamaConfig.llama3_8b()
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.ffn_dim) == (4096, 32, 32, 8, 14336)
    assert not cfg.tie_embeddings and cfg.vocab_size == 128256 and cfg.checkpointing == "selective"
    kv = 8 * (4096 // 32)  # 8 KV heads of 128
    attention = 4096 * (4096 + 2 * kv) + 4096 * 4096  # fused wqkv, wo
    block = attention + 3 * 4096 * 14336 + 2 * 4096  # + SwiGLU w1 w3 w2, two RMSNorms
    expected = 32 * block + 2 * 128256 * 4096 + 4096  # + embedding, output, final norm
    assert expected == 8_030_261_248
    with torch.device("meta"):
        model = Llama(cfg)
    assert sum(p.numel() for p in model.parameters()) == expected == cfg.num_params()
    assert model.output.weight is not model.embed.weight
