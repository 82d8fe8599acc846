"""Small models the tests share, their batches, and ``train_steps`` (a few optimizer steps
on random inputs for the 5-input models); all importable by the ranks' processes."""

from __future__ import annotations

import functools
import io

import torch
import torch.nn as nn

from fczero.models import Llama, LlamaConfig


class UnevenTiedMLP(nn.Module):
    """Uneven dim 0 (13 rows), 1-d and 0-d params, a frozen param, a tied weight, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 13)  # weight (13, 5): 13 rows over 2 or 4 ranks is uneven
        self.hidden = nn.Linear(13, 7)  # bias of 7 elements: uneven 1-d
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d
        self.frozen = nn.Linear(7, 7, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.out = nn.Linear(7, 5)
        self.back = nn.Linear(5, 13, bias=False)
        self.back.weight = self.inp.weight  # tied: one param owned by two modules
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # (B, 13)
        h = torch.tanh(self.hidden(h) + self.shift) * self.scale  # (B, 7)
        y = self.out(self.frozen(h))  # (B, 5)
        return self.back(y)  # (B, 13)


class GraphBreakMLP(nn.Module):
    """A print and a data-dependent branch: torch.compile splits forward into pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 13)
        self.sink = io.StringIO()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        print(f"hidden {tuple(h.shape)}", file=self.sink)  # graph break
        if self.fc2.weight.abs().sum() > 0:  # data-dependent, but the same on every rank
            h = torch.tanh(self.fc2(h))
        return self.fc3(h)


class TwoLayer(nn.Module):
    """The 2-layer model of the graph snapshots."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


TINY_LLAMA = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=40)
tiny_llama = functools.partial(Llama, TINY_LLAMA)


def tiny_gqa(checkpointing: str = "full", vocab: int = 64) -> Llama:
    """Grouped-query attention, tied embeddings, each block checkpointed (``"full"`` or
    ``"selective"``): the realistic recipe's Llama, tiny."""
    return Llama(LlamaConfig(
        vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40,
        tie_embeddings=True, checkpointing=checkpointing,
    ))  # fmt: skip


def frozen_gqa() -> Llama:
    """``tiny_gqa("full")`` with some params frozen in every block (the queries and the
    feed-forward norm), as a partly fine-tuned model has them."""
    model = tiny_gqa("full")
    for name, param in model.named_parameters():
        if ".attn.wq." in name or ".mlp_norm." in name:
            param.requires_grad_(False)
    return model


def mlp_batches(steps: int = 5, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Regression onto a fixed smooth function of the input, so the loss can fall."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(5, 13, generator=g)
    xs = [torch.randn(batch, 5, generator=g) for _ in range(steps)]
    return [(x, torch.sin(x @ w)) for x in xs]


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, between=None) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(6, 5, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if between is not None:
            between()


def token_batches(steps: int = 5, batch: int = 8, seq: int = 16, vocab: int = 64):
    """Arithmetic sequences (random start and stride) modulo ``vocab``: learnable in a few steps."""
    g = torch.Generator().manual_seed(1)
    positions = torch.arange(seq + 1)
    toks = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        toks.append((start + stride * positions) % vocab)
    return [(t[:, :-1], t[:, 1:]) for t in toks]


class ThreeBlocks(nn.Module):
    """Three blocks in a ModuleList (each 1 MiB of fp32 weight: one bucket per block)."""

    def __init__(self, dim: int = 512) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.head = nn.Linear(dim, 8, bias=False)

        self.skip: set[int] = set()  # blocks to leave out of forward (a changed gather order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x = torch.relu(block(x))
        return self.head(x)


def block_batches(
    steps: int = 4, batch: int = 8, dim: int = 512
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(batch, dim, generator=g), torch.randn(batch, 8, generator=g))
        for _ in range(steps)
    ]
