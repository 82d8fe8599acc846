"""The main job end to end (2 gloo processes), its command line, and its data module."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fczero import train
from fczero.data import VOCAB_SIZE, WindowSampler, decode, encode, load_corpus


def _run_main_job(*args: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    summary_path = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "fczero.train", "--nproc", "2", "--json", str(summary_path), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc, json.loads(summary_path.read_text())


def test_main_job_trains_on_two_processes(tmp_path):
    proc, summary = _run_main_job("--steps", "30", "--log-every", "10", tmp_path=tmp_path)
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("fczero.train: Llama"), proc.stdout
    assert [line.split("|")[0].strip() for line in lines[1:-1]] == [
        "step  1/30",
        "step 10/30",
        "step 20/30",
        "step 30/30",
    ], proc.stdout
    assert lines[-1].startswith("done: 30 steps | loss "), proc.stdout
    assert "tok/s" in lines[-1] and "max RSS" in lines[-1] and "wall" in lines[-1]
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert summary["steps"] == 30 and summary["tokens_per_s"] > 0
    first, last = summary["first_loss"], summary["last_loss"]
    assert first > 5.0, summary  # about ln(256) = 5.5 before training
    assert last < first - 1.5, summary  # the loss visibly falls
    assert f"loss {first:.4f} -> {last:.4f}" in lines[-1]


def test_cli_rejects_bad_flags_before_launching(capsys):
    with pytest.raises(SystemExit) as excinfo:
        train.main(["--dim", "130", "--heads", "4"])
    assert excinfo.value.code == 2
    assert "divisible" in capsys.readouterr().err


def test_lr_schedule_warms_up_then_decays():
    factor = train._lr_schedule(100)
    values = [factor(step) for step in range(100)]
    assert values[0] == pytest.approx(0.1)
    assert values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(values[9:]))
    assert values[-1] == pytest.approx(0.1, abs=1e-3)


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
