"""One rank's error reaches every rank at once: no rank waits out a collective's timeout.

Real ranks (torchrun, gloo on CPU), real faults: rank 1 raises a MemoryError while it loads its part
of the checkpoint a multi-rank restore tries (as an elastic N→1 read of a large checkpoint can);
every rank stops within seconds with one line naming rank 1 and the error, instead of rank 0
waiting 900 s in the next gather.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "ddp_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _torchrun(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TORCHRUN, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_an_error_on_one_rank_during_a_restore_stops_every_rank_at_once(tmp_path: Path, child_env) -> None:
    first = _torchrun(["--dir", "ck", "--every", "5", "--total", "10"], tmp_path, child_env)
    assert first.returncode == 0, first.stdout + first.stderr
    faulty = {
        **child_env,
        "SMARTCKPT_TEST_FAULTS": "1",
        "SMARTCKPT_FAULT": "rank.restore",
        "SMARTCKPT_FAULT_RANK": "1",
        "SMARTCKPT_FAULT_MODE": "memory",
        "SMARTCKPT_RANK_TIMEOUT": "600",  # well above what the test allows: the error must not wait for it
    }
    t0 = time.monotonic()
    second = _torchrun(["--dir", "ck", "--every", "5", "--total", "20"], tmp_path, faulty)
    took = time.monotonic() - t0
    out = second.stdout + second.stderr
    assert second.returncode != 0, out
    assert took < 120, f"{took:.0f} s: a rank waited for a timeout"
    # both ranks stopped with the same line naming the rank and the error
    lines = [line for line in out.splitlines() if "rank 1: MemoryError: injected allocation failure" in line]
    assert len(lines) >= 2, out  # rank 0 names rank 1's error too
    assert "rank 0 start" not in out and "rank 1 start" not in out, "no rank may train on"
    print(f"rank 1's MemoryError during a restore stopped both ranks in {took:.1f} s")
