"""The scripts in examples/ run as the README launches them: torchrun, 2 gloo ranks, few steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_gloo_example_trains_under_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # torchrun puts examples/ on the path, not the repo root: fczero from this checkout
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run"),
            *("--standalone", "--nproc-per-node", "2"),
            *(str(ROOT / "examples" / "cpu_gloo.py"), "--steps", "3"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"], lines
    assert all(0.0 < float(line.rsplit(" ", 1)[1]) < 10.0 for line in lines), lines
