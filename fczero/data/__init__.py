"""The main job's data: a small English corpus shipped with fczero, a byte-level tokenizer,
and per-rank sampling of random training windows.

``corpus.txt`` is original prose written for fczero (short descriptive pieces, about
27 KB of ASCII), free to use for anything. Tokens are bytes, so the vocabulary is 256
and ``decode(encode(text)) == text`` for any UTF-8 string.

A batch is ``batch_size`` random windows of ``seq_len + 1`` consecutive tokens,
(B, T+1): the model reads ``[:, :-1]`` and predicts ``[:, 1:]``. Every rank draws
from its own seeded generator (``seed + rank``), so ranks see different batches and a
rerun with the same seed sees the same ones; ``skip(n)`` moves a fresh sampler past
the first ``n`` batches, which is how a resumed run continues its data where it stopped.
"""

from __future__ import annotations

from importlib import resources

import torch

__all__ = ["VOCAB_SIZE", "WindowSampler", "decode", "encode", "load_corpus"]

#: Byte-level vocabulary: one token per byte value.
VOCAB_SIZE = 256

_CORPUS = "corpus.txt"


def load_corpus() -> str:
    """The text of the corpus shipped with fczero (``fczero/data/corpus.txt``)."""
    return resources.files(__package__).joinpath(_CORPUS).read_text(encoding="utf-8")


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-d ``int64`` tensor of token ids in ``[0, 256)``."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    """Inverse of :func:`encode` (invalid UTF-8 byte runs become U+FFFD)."""
    return bytes(tokens.flatten().tolist()).decode("utf-8", errors="replace")


class WindowSampler:
    """Random (B, T+1) windows of a 1-d token tensor, from a generator seeded per rank.

    Args:
        tokens: 1-d token ids (e.g. ``encode(load_corpus())``), kept on the CPU.
        batch_size: windows per batch (B).
        seq_len: tokens the model reads per window (T); each window holds T+1.
        seed: base seed; the generator is seeded with ``seed + rank``.
        rank: this process's rank (0 in a single process).
        device: where batches are returned.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        rank: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-d, got shape {tuple(tokens.shape)}.")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}.")
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"the corpus has {tokens.numel()} tokens, too few for windows of "
                f"seq_len + 1 = {seq_len + 1}; lower --seq-len."
            )
        self.tokens = tokens.cpu()
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed + rank)
        self._offsets = torch.arange(seq_len + 1)  # (T+1,)

    def next_batch(self) -> torch.Tensor:
        """The next (B, T+1) batch of token ids (``int64``) on ``device``."""
        n_starts = self.tokens.numel() - self.seq_len  # every start whose window fits
        starts = torch.randint(n_starts, (self.batch_size,), generator=self.generator)  # (B,)
        batch = self.tokens[starts[:, None] + self._offsets]  # (B, T+1)
        return batch.to(self.device, non_blocking=True)

    def skip(self, batches: int) -> None:
        """Advance past ``batches`` batches without building them (a resumed run's data)."""
        if batches < 0:
            raise ValueError(f"batches must be >= 0, got {batches}.")
        n_starts = self.tokens.numel() - self.seq_len
        for _ in range(batches):  # the same draws as next_batch, so the stream continues exactly
            torch.randint(n_starts, (self.batch_size,), generator=self.generator)
