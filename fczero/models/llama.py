"""A Llama-style decoder: RMSNorm, fused QKV, causal SDPA with RoPE, SwiGLU MLP,
untied embedding and output (optionally tied). The benchmark model of
``shared/BENCHMARK.md`` is ``LlamaConfig.benchmark()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Sizes of the decoder."""

    vocab_size: int = 256
    """Token vocabulary (256: bytes, as the main job's tokenizer uses)."""
    dim: int = 128
    """Model (residual stream) width."""
    n_layers: int = 2
    """Number of decoder blocks."""
    n_heads: int = 4
    """Attention heads; ``dim`` must divide evenly by it."""
    ffn_dim: int = 344
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int = 2048
    """Longest sequence the rotary table covers."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output projection."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}.")

    @classmethod
    def benchmark(cls) -> LlamaConfig:
        """The 953M-parameter model of shared/BENCHMARK.md."""
        return cls(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, ffn_dim=5632)

    def num_params(self) -> int:
        block = 4 * self.dim * self.dim + 3 * self.dim * self.ffn_dim + 2 * self.dim
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * block + emb + self.dim

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per matmul weight plus attention (forward and backward)."""
        matmul = self.n_layers * (4 * self.dim * self.dim + 3 * self.dim * self.ffn_dim)
        matmul += self.vocab_size * self.dim
        attention = self.n_layers * 6 * seq_len * self.dim  # QK^T and PV, causal halves x2 fwd+bwd
        return 6 * matmul + attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def _rope_tables(head_dim: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); rotate pairs (even, odd) by the position's angle.
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # (B, H, T, hd/2) each
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.wqkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, D))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Decoder-only transformer; ``forward(tokens)`` returns logits (B, T, vocab)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.embed.weight
        cos, sin = _rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.dim**-0.5
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=1.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hd/2)
        x = self.embed(tokens)  # (B, T, D)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))  # (B, T, V)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy over ``tokens`` (B, T+1)."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
