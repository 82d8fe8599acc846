"""A Llama-style decoder: RMSNorm, fused QKV (grouped-query when ``n_kv_heads`` is set),
causal SDPA with RoPE, SwiGLU MLP, untied embedding and output (optionally tied), and
activation checkpointing per block (``checkpointing``). The 953M benchmark model is
``LlamaConfig.benchmark()``; the realistic regime's Llama-3.2-3B shape is
``LlamaConfig.llama3_3b()``, the scale run's Llama-3-8B shape ``LlamaConfig.llama3_8b()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

CHECKPOINTING = ("none", "full", "selective")


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
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: ``n_heads``. Divides ``n_heads``."""
    ffn_dim: int = 344
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int = 2048
    """Longest sequence the rotary table covers."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output projection."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    checkpointing: str = "none"
    """Activation checkpointing of each block (``torch.utils.checkpoint``, non-reentrant):
    "none", "full" (recompute the whole block in backward) or "selective" (keep the
    outputs of matmuls and attention, recompute the rest)."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}.")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}."
            )
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(
                f"checkpointing={self.checkpointing!r}; pick one of {', '.join(CHECKPOINTING)}."
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): ``kv_heads`` heads of ``dim / n_heads``."""
        return self.kv_heads * (self.dim // self.n_heads)

    @classmethod
    def benchmark(cls) -> LlamaConfig:
        """The 953M-parameter model of the benchmark's regimes M and C (docs/benchmarks.md)."""
        return cls(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, ffn_dim=5632)

    @classmethod
    def llama3_3b(cls, checkpointing: str = "full") -> LlamaConfig:
        """The realistic regime's model: Llama-3.2-3B's shape (3.2B params, tied embeddings,
        8 KV heads), sequences up to 4096, each block checkpointed."""
        return cls(
            vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
            max_seq_len=4096, tie_embeddings=True, checkpointing=checkpointing,
        )  # fmt: skip

    @classmethod
    def llama3_8b(cls, checkpointing: str = "selective") -> LlamaConfig:
        """The scale run's model: Llama-3-8B's shape (8.03B params, untied embeddings, 8 KV
        heads), sequences up to 8192, selective checkpointing (as torchtitan's 8B recipe).
        RoPE's base is this file's 10000 for every preset (Llama 3 uses 500000: same shapes,
        same step time)."""
        return cls(
            vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
            max_seq_len=8192, tie_embeddings=False, checkpointing=checkpointing,
        )  # fmt: skip

    def num_params(self) -> int:
        attention = 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim
        block = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * block + emb + self.dim

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per matmul weight plus attention (forward and backward)."""
        attention = 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim
        matmul = self.n_layers * (attention + 3 * self.dim * self.ffn_dim)
        matmul += self.vocab_size * self.dim
        attention = self.n_layers * 6 * seq_len * self.dim  # QK^T and PV, causal halves x2 fwd+bwd
        return 6 * matmul + attention


_SAVED_BY_SELECTIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _keep_matmul_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in _SAVED_BY_SELECTIVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def keep_matmuls():
    """Selective checkpointing: matmul and attention outputs kept, the rest recomputed."""
    return create_selective_checkpoint_contexts(_keep_matmul_outputs)


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
        self.n_heads, self.kv_heads = cfg.n_heads, cfg.kv_heads
        self.wqkv = nn.Linear(cfg.dim, cfg.dim + 2 * cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        hd = D // self.n_heads
        if self.kv_heads == self.n_heads:
            q, k, v = self.wqkv(x).view(B, T, 3, self.n_heads, hd).unbind(2)
        else:  # grouped-query: (D, kv, kv) columns; each kv head serves n_heads / kv_heads
            q, k, v = self.wqkv(x).split([D, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
            q, k, v = q.view(B, T, -1, hd), k.view(B, T, -1, hd), v.view(B, T, -1, hd)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H or KV, T, hd)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        if self.kv_heads != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.kv_heads, dim=1)  # (B, H, T, hd)
            v = v.repeat_interleave(self.n_heads // self.kv_heads, dim=1)
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
        mode = self.cfg.checkpointing
        for layer in self.layers:
            if mode == "none":
                x = layer(x, cos, sin)
            else:  # the block's own call inside the region, as HF's checkpointing does
                selective = {"context_fn": keep_matmuls} if mode == "selective" else {}
                x = checkpoint(layer, x, cos, sin, use_reentrant=False, **selective)
        return self.output(self.norm(x))  # (B, T, V)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy over ``tokens`` (B, T+1)."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
