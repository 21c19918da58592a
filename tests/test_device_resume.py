"""Kill and resume, bit for bit, on every device this machine has: the CPU always, a CUDA device
when torch sees one (those cases carry the ``cuda`` marker: ``pytest -m cuda`` runs only them;
without a device they are skipped with the reason).

The training child (``tests/scripts/device_train.py``) is deterministic on both devices
(``torch.use_deterministic_algorithms(True)``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, TF32 off) and
draws from the device's RNG every step. Its uninterrupted run, with no smartckpt at all, is the
reference; a run SIGKILLed mid-way and started again must end with the same loss at every step,
the same weights, optimizer moments, scheduler, CPU and CUDA RNG states:

(a) through the API (``CheckpointManager``), killed from outside by the test;
(b) zero-code under ``smartckpt run`` (only ``start_step()`` in the script), killed by a real
    SIGKILL it sends itself, restarted by the supervisor.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._output import child_lines
from tests._state import assert_same_state

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "device_train.py"
TOTAL, EVERY = 30, 5
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="needs a CUDA device: torch.cuda.is_available() is False on this machine",
            ),
        ],
    ),
]


def _env(child_env: dict[str, str]) -> dict[str, str]:
    env = dict(child_env)
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env["SMARTCKPT_RESTART_BACKOFF"] = "0.1"
    return env


def _cmd(device: str, mode: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--device", device, "--mode", mode, "--total", str(TOTAL),
            "--out", str(out), *extra]  # fmt: skip


def _trace(text: str) -> dict[int, str]:
    out = {}
    for ln in child_lines(text):
        if ln.startswith("step "):
            _, n, _, hexloss = ln.split()
            out[int(n)] = hexloss
    return out


def _final(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_same_run(state: dict, ref: dict) -> None:
    assert_same_state(state, ref)
    assert ("cuda_rng" in state) == ("cuda_rng" in ref)
    if "cuda_rng" in ref:
        assert torch.equal(state["cuda_rng"], ref["cuda_rng"]), "CUDA RNG state differs at the end"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per device, the uninterrupted run without smartckpt: (loss trace, final state)."""
    done: dict[str, tuple[dict[int, str], dict]] = {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")

    def get(device: str) -> tuple[dict[int, str], dict]:
        if device not in done:
            out = tmp_path_factory.mktemp(f"ref-{device}") / "final.pt"
            proc = subprocess.run(
                _cmd(device, "plain", out), env=env, capture_output=True, text=True, timeout=300
            )
            assert proc.returncode == 0, proc.stderr[-2000:]
            trace = _trace(proc.stdout)
            assert sorted(trace) == list(range(1, TOTAL + 1))
            done[device] = trace, _final(out)
        return done[device]

    return get


@pytest.mark.parametrize("device", DEVICES)
def test_api_sigkill_and_resume_is_bit_exact(tmp_path, child_env, reference, device):
    ref_trace, ref_state = reference(device)
    kill_at = random.Random(time.time_ns()).randrange(12, TOTAL - 3)
    # a step takes 20 ms of sleep: the background commit of a save has time to land
    cmd = _cmd(device, "api", tmp_path / "final.pt", "--dir", str(tmp_path / "store"),
               "--save-every", str(EVERY), "--step-time", "0.02")  # fmt: skip
    proc = subprocess.Popen(cmd, env=_env(child_env), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f"step {kill_at} "):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.stdout.close()
    assert proc.wait() == -signal.SIGKILL
    killed = _trace("".join(seen))
    assert killed == {n: ref_trace[n] for n in killed}, "the first run already differs from the reference"

    res = subprocess.run(cmd, env=_env(child_env), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    start = int(res.stdout.splitlines()[0].split()[1])
    # a save every 5 steps, written in the background: the kill loses at most the one in flight
    assert start % EVERY == 0 and (kill_at // EVERY - 1) * EVERY <= start <= kill_at and start > 0, (
        start,
        kill_at,
    )
    trace = _trace(res.stdout)
    assert sorted(trace) == list(range(start + 1, TOTAL + 1))
    assert trace == {n: ref_trace[n] for n in trace}, "loss trace after the resume differs"
    _assert_same_run(_final(tmp_path / "final.pt"), ref_state)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_code_under_smartckpt_run_sigkill_and_resume_is_bit_exact(
    tmp_path, child_env, reference, device
):
    ref_trace, ref_state = reference(device)
    kill_at = random.Random(time.time_ns()).randrange(12, TOTAL - 3)
    cmd = [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", str(EVERY),
           *_cmd(device, "zero-code", tmp_path / "final.pt", "--kill-at", str(kill_at), "--step-time", "0.02")[1:]]  # fmt: skip
    res = subprocess.run(
        cmd, cwd=tmp_path, env=_env(child_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:]
    (record,) = (tmp_path / "ck" / "runs").glob("*.json")
    rec = json.loads(record.read_text())
    assert rec["outcome"] == "finished" and rec["restarts"] == 1, res.stdout[-3000:]
    first = rec["attempts"][0]
    assert first["cause"] == "killed by SIGKILL" and first["max_step"] == kill_at
    start = first["restart_from"]
    assert start % EVERY == 0 and 0 < start <= kill_at, (start, kill_at)
    assert f"start {start}" in res.stdout
    # Both attempts print their steps; every printed loss is the reference's, the resumed
    # attempt's included (steps start+1 .. TOTAL are printed twice up to kill_at).
    lines = [ln for ln in child_lines(res.stdout) if ln.startswith("step ") and len(ln.split()) == 4]
    for ln in lines:
        _, n, _, hexloss = ln.split()
        assert hexloss == ref_trace[int(n)], f"step {n}: {hexloss} != {ref_trace[int(n)]}"
    assert len(lines) == kill_at + (TOTAL - start)
    _assert_same_run(_final(tmp_path / "final.pt"), ref_state)
