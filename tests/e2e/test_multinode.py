"""The main job as two torchrun "nodes" (two launchers, c10d rendezvous on 127.0.0.1).

Each launcher starts 2 processes; torchrun numbers a node's processes consecutively,
so with ``--replicate 2`` the shard axis stays within a node and HSDP's replicate
axis runs across the two nodes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fczero import train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(port: int, json_path: Path, *train_args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"fczero-test-{port}",
        "-m",
        "fczero.train",
        "--device",
        "cpu",
        "--json",
        str(json_path),
        *train_args,
    ]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.slow
def test_main_job_hsdp_on_two_launchers(tmp_path):
    port = _free_port()
    args = ("--replicate", "2", "--steps", "20", "--log-every", "10")
    launchers = [_launcher(port, tmp_path / f"node{i}.json", *args) for i in range(2)]
    outputs = []
    for proc in launchers:
        try:
            outputs.append(proc.communicate(timeout=300))
        except subprocess.TimeoutExpired:
            for p in launchers:
                p.kill()
            raise
    for proc, (out, err) in zip(launchers, outputs):
        assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    # rank 0 (on whichever launcher the rendezvous made node 0) wrote the summary
    summaries = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("node*.json"))]
    assert len(summaries) == 1, [o for o, _ in outputs]
    summary = summaries[0]
    stdout = "".join(o for o, _ in outputs)
    assert "4 ranks" in stdout and "HSDP 2 replicas x 2 shards" in stdout, stdout
    assert summary["world_size"] == 4 and summary["args"]["replicate"] == 2
    assert summary["first_loss"] > 5.0, summary  # about ln(256) before training
    assert summary["last_loss"] < summary["first_loss"] - 1.5, summary


def test_replicate_must_divide_the_process_count(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as excinfo:
        train.main(["--device", "cpu", "--nproc", "2", "--replicate", "3"])
    assert excinfo.value.code == 2
    assert "--replicate 3 must divide the number of processes (2)" in capsys.readouterr().err
