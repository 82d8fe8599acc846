"""The main job's data (fczero/data/__init__.py): the shipped corpus, the byte tokenizer
and the per-rank window sampler."""

from __future__ import annotations

import pytest
import torch

from fczero.data import VOCAB_SIZE, WindowSampler, decode, encode, load_corpus


def test_corpus_round_trips_through_the_byte_tokenizer():
    text = load_corpus()
    assert len(text) > 20_000
    tokens = encode(text)
    assert tokens.dtype == torch.long and tokens.dim() == 1
    assert 0 <= int(tokens.min()) and int(tokens.max()) < VOCAB_SIZE
    assert decode(tokens) == text
    assert decode(encode("naïve café")) == "naïve café"  # multi-byte UTF-8


def test_window_sampler_shapes_and_contiguity():
    tokens = encode(load_corpus())
    batch = WindowSampler(tokens, batch_size=4, seq_len=16, seed=3).next_batch()
    assert batch.shape == (4, 17) and batch.dtype == torch.long
    text = load_corpus()
    for row in batch:
        assert decode(row) in text  # a window is a contiguous slice of the corpus


def test_window_sampler_is_deterministic_per_seed_and_rank():
    tokens = encode(load_corpus())

    def batches(seed: int, rank: int) -> list[torch.Tensor]:
        sampler = WindowSampler(tokens, batch_size=8, seq_len=32, seed=seed, rank=rank)
        return [sampler.next_batch() for _ in range(3)]

    same = batches(seed=0, rank=1)
    assert all(torch.equal(a, b) for a, b in zip(same, batches(seed=0, rank=1)))
    assert not torch.equal(same[0], batches(seed=0, rank=0)[0])  # ranks see different data
    assert not torch.equal(same[0], batches(seed=5, rank=1)[0])


def test_window_sampler_covers_the_last_window():
    tokens = torch.arange(10)
    batch = WindowSampler(tokens, batch_size=256, seq_len=9).next_batch()  # only one window fits
    assert torch.equal(batch, tokens.expand(256, 10))
    with pytest.raises(ValueError, match="too few"):
        WindowSampler(tokens, batch_size=1, seq_len=10)


def test_window_sampler_skip_continues_the_stream():
    tokens = encode(load_corpus())
    whole = WindowSampler(tokens, batch_size=4, seq_len=8, seed=2, rank=1)
    batches = [whole.next_batch() for _ in range(5)]
    resumed = WindowSampler(tokens, batch_size=4, seq_len=8, seed=2, rank=1)
    resumed.skip(3)
    assert torch.equal(resumed.next_batch(), batches[3])
    assert torch.equal(resumed.next_batch(), batches[4])
    with pytest.raises(ValueError, match=">= 0"):
        resumed.skip(-1)
