"""The main job (fczero/train.py) end to end on 2 gloo processes: its command line, its
learning-rate schedule, checkpoints and restarts, and its numbers against a reference.
Its data module is tested in tests/data/, its report in test_train_report.py."""

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
from fczero.data import WindowSampler, encode, load_corpus
from fczero.models import Llama

CPU = ("--device", "cpu", "--nproc", "2")  # gloo on 2 processes, also on a GPU machine


def _run_main_job(
    *args: str, tmp_path: Path, timeout: int = 180
) -> tuple[subprocess.CompletedProcess, dict]:
    summary_path = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "fczero.train", *CPU, "--json", str(summary_path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc, json.loads(summary_path.read_text())


def test_main_job_trains_on_two_processes(tmp_path):
    proc, summary = _run_main_job("--steps", "30", "--log-every", "10", tmp_path=tmp_path)
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("fczero.train: Llama"), proc.stdout
    assert lines[1].startswith("numbers: loss = mean over the steps in brackets and all ranks")
    assert [line.split("|")[0].strip() for line in lines[2:-1]] == [
        "step  1/30",
        "step 10/30",
        "step 20/30",
        "step 30/30",
    ], proc.stdout
    assert "(step 1, 2 ranks)" in lines[2], lines[2]
    assert "first step" in lines[2] and "compilation and warm-up included" in lines[2]
    assert "(steps 1-10, 2 ranks)" in lines[3] and "tok/s (steps 2-10)" in lines[3]
    assert "(steps 21-30, 2 ranks)" in lines[5] and "tok/s (steps 21-30)" in lines[5]
    assert lines[-1].startswith("done: 30 steps | loss "), proc.stdout
    assert "tok/s (steps 2-30) | first step" in lines[-1]
    assert "max RSS" in lines[-1] and "wall" in lines[-1]
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert summary["steps"] == 30 and summary["tokens_per_s"] > 0 and summary["first_step_s"] > 0
    first, last = summary["first_loss"], summary["last_loss"]
    assert first > 5.0, summary  # about ln(256) = 5.5 before training
    assert last < first - 1.5, summary  # the loss visibly falls
    assert f"loss {first:.4f} -> {last:.4f}" in lines[-1]


def test_cli_rejects_bad_flags_before_launching(capsys):
    with pytest.raises(SystemExit) as excinfo:
        train.main(["--dim", "130", "--heads", "4"])
    assert excinfo.value.code == 2
    assert "divisible" in capsys.readouterr().err
    with pytest.raises(SystemExit) as excinfo:
        train.main(["--compile", "--compile-blocks"])
    assert excinfo.value.code == 2
    assert "exclude each other" in capsys.readouterr().err


def test_cli_cuda_without_a_gpu_says_to_use_cpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as excinfo:
        train.main(["--device", "cuda"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda: " in err and "; use --device cpu (gloo), or run on a machine" in err


def test_cuda_without_cuda_fails_before_torch_does(monkeypatch):
    """train() called directly (not through the CLI's checks): fczero's message, not torch's
    "module 'torch._C' has no attribute '_cuda_setDevice'"."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("reached torch"))
    with pytest.raises(ValueError, match=r'a "cuda" mesh needs CUDA, .* init_device_mesh\("cpu"'):
        train._init_distributed("cuda")


def test_lr_schedule_warms_up_then_decays():
    factor = train._lr_schedule(100)
    values = [factor(step) for step in range(100)]
    assert values[0] == pytest.approx(0.1)
    assert values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(values[9:]))
    assert values[-1] == pytest.approx(0.1, abs=1e-3)


# -- checkpoints, restarts and long-run numerics --------------------------------------------

TINY = ("--dim", "32", "--layers", "1", "--heads", "2", "--seq-len", "16", "--batch-size", "4")


def _launch(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "fczero.train", *CPU, *TINY, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_killed_run_resumes_to_the_uninterrupted_losses(tmp_path):
    """SIGKILL of one rank after step 10; the restart from the step-8 checkpoint follows one
    process's uninterrupted run at every step after it. Then 4 ranks resume its checkpoint."""
    common = ("--steps", "12", "--log-every", "1")

    ckpt = str(tmp_path / "ckpt")
    killed = _launch(*common, "--save", ckpt, "--save-every", "4", "--crash-at-step", "10")
    assert killed.returncode != 0, killed.stdout
    assert "saved checkpoint of step 8" in killed.stdout, killed.stdout + killed.stderr
    assert "step 10/12" not in killed.stdout  # rank 1 died before step 10 was logged
    assert "rank 1 failed first (exit code -9)" in killed.stderr, killed.stderr

    proc, resumed = _run_main_job(
        *TINY, *common, "--resume", ckpt, "--save", ckpt, tmp_path=tmp_path
    )
    assert f"resumed from {ckpt} at step 8 (saved by 2 ranks)" in proc.stdout
    assert [step for step, _ in resumed["losses"]] == [9, 10, 11, 12]
    expected = dict(enumerate(_reference_losses(12), start=1))
    for step, loss in resumed["losses"]:
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    assert "saved checkpoint of step 12" in proc.stdout

    # the main job resumes the 2 ranks' checkpoint on 4 ranks (and says what changed)
    proc, wider = _run_main_job(
        *TINY,
        "--steps",
        "14",
        "--log-every",
        "1",
        "--nproc",
        "4",
        "--resume",
        ckpt,
        tmp_path=tmp_path,
    )
    assert f"resumed from {ckpt} at step 12 (saved by 2 ranks)" in proc.stdout
    assert "note: resumed with other settings than the saved run (--steps 12 -> 14)" in proc.stdout
    assert wider["world_size"] == 4 and [s for s, _ in wider["losses"]] == [13, 14]
    assert abs(wider["losses"][0][1] - expected[12]) < 0.5  # continues the curve, not from scratch


def test_resume_flags_are_checked_before_launching(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(["--resume", str(tmp_path / "none")])
    assert "no checkpoint there" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(["--save-every", "5"])
    assert "--save-every needs --save" in capsys.readouterr().err


def _reference_losses(steps: int, seed: int = 0, lr: float = 3e-3) -> list[float]:
    """The main job's recipe in one process on the 2 ranks' batches together (whole batch)."""
    args = train.build_parser().parse_args([*TINY, "--steps", str(steps)])
    torch.manual_seed(seed)
    model = Llama(train._model_config(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, train._lr_schedule(steps))
    tokens = encode(load_corpus())
    samplers = [
        WindowSampler(tokens, batch_size=args.batch_size, seq_len=args.seq_len, seed=seed, rank=r)
        for r in range(2)
    ]
    losses = []
    for _ in range(steps):
        batch = torch.cat([s.next_batch() for s in samplers])  # rank 0's rows, then rank 1's
        loss = train._next_token_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
    return losses


def test_logged_numbers_are_what_the_legend_says(tmp_path):
    """The first step's line: its own loss and time; then each line's loss is the mean over
    its --log-every window (step 1 included) and the ranks; the summary's tok/s is over
    steps 2..N, the same steps the lines' tok/s count."""
    proc, summary = _run_main_job(
        *TINY, "--steps", "10", "--log-every", "4", tmp_path=tmp_path
    )
    ref = _reference_losses(10)  # the whole batch: the mean over both ranks' halves

    def mean(a: int, b: int) -> float:  # steps a..b, counted from 1
        return sum(ref[a - 1 : b]) / (b - a + 1)

    expected = [(1, ref[0]), (4, mean(1, 4)), (8, mean(5, 8)), (10, mean(9, 10))]
    assert [step for step, _ in summary["losses"]] == [step for step, _ in expected]
    for (_, loss), (step, want) in zip(summary["losses"], expected):
        assert loss == pytest.approx(want, rel=1e-5), step
    assert summary["first_loss"] == summary["losses"][0][1]
    assert summary["last_loss"] == summary["losses"][-1][1]

    lines = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    windows = ["steps 2-4", "steps 5-8", "steps 9-10"]
    assert [line.split("tok/s (")[1].split(")")[0] for line in lines[1:]] == windows
    # the summary's tok/s is all tokens of steps 2..10 over the windows' summed time
    tokens = 4 * 16 * 2  # batch x seq x ranks, per step
    tok_s = [float(line.split("|")[2].split("tok/s")[0].replace(",", "")) for line in lines[1:]]
    seconds = sum(tokens * n / rate for n, rate in zip((3, 4, 2), tok_s))
    assert summary["tokens_per_s"] == pytest.approx(tokens * 9 / seconds, rel=1e-2)
    assert summary["first_step_s"] > 0.0
    assert f"first step {summary['first_step_s']:.2f} s" in lines[0]


_COMPILE_FLAGS = {
    "eager": (),
    "aot_eager": ("--compile", "--compile-backend", "aot_eager"),
    "blocks": ("--compile-blocks", "--compile-backend", "aot_eager"),
}


#: Steps per mode: the eager job runs the long curve; each compiled mode runs the same
#: recipe for long enough to show it follows that curve (its LR schedule scaled to the run)
_STEPS = {"eager": 200, "aot_eager": 60, "blocks": 60}


@pytest.mark.parametrize("mode", list(_STEPS))
def test_main_job_tracks_the_single_process_reference(mode, tmp_path):
    """The main job at world size 2 follows one process's loss curve: 200 steps eager, 60
    compiled (whole, or each block on its own with ``--compile-blocks``; aot_eager: stock
    Inductor under fczero is proven by tests/e2e/test_numerics.py and others); measured at
    most 1e-6 apart on torch 2.13 CPU."""
    steps = _STEPS[mode]
    _, summary = _run_main_job(
        *TINY,
        "--steps",
        str(steps),
        "--log-every",
        "1",
        *_COMPILE_FLAGS[mode],
        tmp_path=tmp_path,
        timeout=600,
    )
    assert summary["compiled_blocks"] == (["layers.0"] if mode == "blocks" else [])  # (1 layer)
    actual = [loss for _, loss in summary["losses"]]
    expected = _reference_losses(steps)
    assert [step for step, _ in summary["losses"]] == list(range(1, steps + 1))
    assert expected[-1] < expected[0] - 3.0  # the curve is not flat (6.1 -> 3.0 in 60 steps)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_relaunch_uses_a_free_rendezvous_port(monkeypatch):
    """Two main jobs on one machine must not meet on torchrun's default port 29500, which a
    single-node launch without --standalone binds in torchrun versions older than
    pytorch/pytorch#175699 (2026)."""
    import torch.distributed.run as torchrun

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen = []
    monkeypatch.setattr(torchrun, "run", lambda args: seen.append(args))
    assert train._launch(2, ["--steps", "1"]) == 0
    (args,) = seen
    assert args.standalone and args.nproc_per_node == "2" and args.module
    assert args.training_script == "fczero.train" and args.training_script_args == ["--steps", "1"]
