"""Models whose params are read a data-dependent number of times: mixture-of-experts
layers that skip idle experts, and a branch taken on some ranks only. With per-read
gathering the ranks would issue different collectives; with units they may not.

Routing is fixed by the token ids (``expert = id % experts`` and the next expert along),
so the tests choose which experts idle on which rank: ``moe_batches`` gives rank 1's half
of each batch only ids that route to experts 0 and 1, while rank 0's half reaches all four.
The gate weights still come from a learned router, so every param gets a gradient.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, FFN, EXPERTS = 32, 16, 24, 4


def _route(ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 by hash of the token id: (N, 2) expert indices and their (N, 2) gate weights."""
    first = ids % EXPERTS
    chosen = torch.stack([first, (first + 1) % EXPERTS], dim=-1)  # (N, 2)
    gates = torch.softmax(logits, dim=-1).gather(-1, chosen)  # (N, 2)
    return chosen, gates


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, FFN, bias=False)
        self.down = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class LoopExperts(nn.Module):
    """One ``nn.Module`` per expert, run only on the tokens routed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        chosen, gates = _route(ids, self.router(x))  # x: (N, D)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:  # an idle expert: its params are never read
                continue
            out = out.index_add(0, token, expert(x[token]) * gates[token, slot, None])
        return out


class PackedExperts(nn.Module):
    """All experts' weights in two packed params, indexed per expert inside the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.up = nn.Parameter(torch.randn(EXPERTS, FFN, DIM) * DIM**-0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, DIM, FFN) * FFN**-0.5)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        chosen, gates = _route(ids, self.router(x))
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            h = F.silu(x[token] @ self.up[e].t()) @ self.down[e].t()  # one read per active expert
            out = out.index_add(0, token, h * gates[token, slot, None])
        return out


class MoEBlock(nn.Module):
    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.moe = PackedExperts() if packed else LoopExperts()

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x), ids)


class TinyMoE(nn.Module):
    """Embedding, two MoE blocks, a head: (B, T) token ids -> (B, T, VOCAB) logits."""

    def __init__(self, packed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MoEBlock(packed) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        ids = tokens.flatten()  # (N,)
        x = self.embed(ids)  # (N, D)
        for layer in self.layers:
            x = layer(x, ids)
        return self.head(x).view(b, t, VOCAB)


def loop_moe() -> TinyMoE:
    return TinyMoE(packed=False)


def packed_moe() -> TinyMoE:
    return TinyMoE(packed=True)


class BranchBlock(nn.Module):
    """A submodule run only when the input's sum is positive (on some ranks only)."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.main(h))
        if x.sum() > 0:  # x: the model's input
            h = h + self.extra(h)
        return h


class BranchModel(nn.Module):
    """``parts``: the batch runs as that many slices, each with its own branch decision
    (the single-process reference of 2 ranks runs 2; a rank runs its slice as 1)."""

    def __init__(self, parts: int = 1) -> None:
        super().__init__()
        self.parts = parts
        self.inp = nn.Linear(5, DIM)
        self.blocks = nn.ModuleList(BranchBlock() for _ in range(2))
        self.out = nn.Linear(DIM, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._slice(part) for part in x.chunk(self.parts)])

    def _slice(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, x)
        return self.out(h)


def moe_batches(steps: int = 3, batch: int = 4, seq: int = 8):
    """Next-token batches; in each, the second half of the rows (rank 1's slice at world
    size 2) holds only ids that route to experts 0 and 1."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        toks = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        half = batch // 2
        toks[half:] = (toks[half:] // EXPERTS) * EXPERTS  # ids = 0 mod 4: experts 0 and 1
        out.append((toks[:, :-1], toks[:, 1:]))
    return out


def branch_batches(steps: int = 3, batch: int = 8):
    """Regression batches whose first half sums positive and second half negative: at
    world size 2 rank 0 takes the branch and rank 1 does not; one process takes it."""
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 5, generator=g)
        x[: batch // 2] = x[: batch // 2].abs() * 3
        x[batch // 2 :] = -x[batch // 2 :].abs() * 3
        out.append((x, torch.randn(batch, 13, generator=g)))
    return out
