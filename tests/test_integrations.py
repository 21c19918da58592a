"""Framework integrations end to end: a Hugging Face Trainer and a Lightning Trainer, with no
smartckpt code in their scripts, SIGKILLed mid-run under ``smartckpt run`` and restarted by it.

Each resumed run must finish at its last step with the loss trace of an uninterrupted run (the
largest difference is printed; on this deterministic CPU setup it is 0), and the checkpoints on
disk must be smartckpt's alone: no ``checkpoint-*`` folders, no ``.ckpt`` files.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

HF_SCRIPT = ROOT / "tests" / "scripts" / "hf_train.py"
PL_SCRIPT = ROOT / "tests" / "scripts" / "lightning_train.py"


def _losses(out: str) -> dict[int, float]:
    """``loss STEP HEX`` lines; a step run twice (before and after a restart) keeps its last value."""
    found: dict[int, float] = {}
    for line in out.splitlines():
        if line.startswith("loss "):
            _, step, value = line.split()
            found[int(step)] = float.fromhex(value)
    return found


def _reference(script: Path, tmp: Path, env: dict[str, str], *args: str) -> dict[int, float]:
    out = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp / "ref"), *args],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return _losses(out.stdout)


def _supervised(script: Path, tmp: Path, env: dict[str, str], every: int, *args: str) -> tuple[str, dict]:
    run_env = dict(env, SMARTCKPT_RESTART_BACKOFF="0.1")
    proc = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", str(every),
         str(script), "--out", str(tmp / "out"), *args],
        env=run_env, cwd=tmp, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    (record,) = (tmp / "ck" / "runs").glob("*.json")
    return out, json.loads(record.read_text())


def _compare(reference: dict[int, float], resumed: dict[int, float], total: int) -> float:
    assert sorted(reference) == sorted(resumed) == list(range(1, total + 1))
    diff = max(abs(reference[s] - resumed[s]) for s in reference)
    print(f"max |loss difference| over {total} steps: {diff:.3g}")
    assert diff <= 1e-6
    return diff


# (every, kill_at): the resume lands in the middle of an epoch (batches skipped, RNG restored after
# the first batch) or on an epoch boundary (RNG restored before the epoch's iterator is made).
@pytest.mark.parametrize(("every", "kill_at", "restored"), [(5, 13, 10), (6, 15, 12)])
def test_hf_trainer_sigkilled_under_run_resumes_to_max_steps(tmp_path, child_env, every, kill_at, restored):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    steps = 24  # 12 per epoch
    reference = _reference(HF_SCRIPT, tmp_path, child_env, "--max-steps", str(steps))
    out, record = _supervised(HF_SCRIPT, tmp_path, child_env, every, "--max-steps", str(steps),
                              "--kill-at", str(kill_at))  # fmt: skip
    assert record["restarts"] == 1 and record["attempts"][0]["cause"] == "killed by SIGKILL", out
    assert record["attempts"][0]["restart_from"] == restored, out
    assert f"global_step {steps}" in out and out.count("\ndone") == 1
    _compare(reference, _losses(out), steps)
    # save_strategy="steps", save_steps=5 in the script: the Trainer's own saves were suppressed.
    assert not list((tmp_path / "out").glob("checkpoint-*")), list((tmp_path / "out").iterdir())
    assert list((tmp_path / "ck" / "manifests").glob("*.json"))


def test_hf_trainer_loss_under_gradient_accumulation_is_the_steps_loss(tmp_path, child_env):
    """The loss smartckpt reads (trace, heartbeat, status line) is the step's loss as the Trainer
    logs it (the sum of what its micro-steps return), not the last micro-step's share."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    env = dict(child_env, SMARTCKPT_EVAL_EVERY="1")
    out, record = _supervised(HF_SCRIPT, tmp_path, env, 100, "--max-steps", "6", "--grad-accum", "2")
    assert record["outcome"] == "finished" and "no heartbeat" not in out
    logged: dict[int, float] = {}  # the Trainer's own log line ends each step's micro-step lines
    step = 0
    for line in out.splitlines():
        if line.startswith("loss "):
            step = int(line.split()[1])
        elif (m := re.match(r"\{'loss': '?([-+.\deE]+)", line)) and step:
            logged[step] = float(m.group(1))
    assert sorted(logged) == list(range(1, 7)), out
    rows = {}
    for path in (tmp_path / "ck" / "traces").glob("*.csv"):
        lines = path.read_text().splitlines()
        head = lines[0].split(",")
        for ln in lines[1:]:
            cells = dict(zip(head, ln.split(","), strict=True))
            rows[int(cells["step"])] = float(cells["raw_loss"])
    assert len(rows) >= 3, out
    for n, raw in rows.items():
        assert raw == pytest.approx(logged[n], rel=1e-3), (n, raw, logged[n])


def test_lightning_sigkilled_under_run_resumes_to_max_steps(tmp_path, child_env):
    pytest.importorskip("pytorch_lightning")
    pytest.importorskip("torchdata")
    # One epoch of 24 batches: the resume lands mid-epoch, where Lightning's loop state carries the
    # StatefulDataLoader's position. (After a mid-epoch resume, the order of the *next* epoch is
    # StatefulDataLoader's own business and differs even without smartckpt: tests/test_data_position.py.)
    steps = 24
    reference = _reference(PL_SCRIPT, tmp_path, child_env, "--max-steps", str(steps))
    assert list((tmp_path / "ref").rglob("*.ckpt")), "the script keeps Lightning's default ModelCheckpoint"
    out, record = _supervised(PL_SCRIPT, tmp_path, child_env, 5, "--max-steps", str(steps), "--kill-at", "17")
    assert record["restarts"] == 1 and record["attempts"][0]["cause"] == "killed by SIGKILL", out
    assert record["attempts"][0]["restart_from"] == 15, out
    assert f"global_step {steps}" in out and out.count("\ndone") == 1
    _compare(reference, _losses(out), steps)
    assert not list(tmp_path.rglob("*.ckpt")) or all("ref" in p.parts for p in tmp_path.rglob("*.ckpt"))
    assert list((tmp_path / "ck" / "manifests").glob("*.json"))


def test_lightning_slurm_auto_requeue_still_gets_its_signal(tmp_path, child_env):
    """Lightning installs its SLURM auto-requeue handler on SIGUSR1 only where none is installed;
    smartckpt's goes on top of it at on_train_start and hands the signal on after its blocking
    save. A real SIGUSR1: smartckpt commits a preemption checkpoint, then Lightning's handler
    saves its HPC checkpoint and calls ``scontrol requeue`` (a stand-in that records its
    arguments)."""
    pytest.importorskip("pytorch_lightning")
    pytest.importorskip("torchdata")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    env = dict(
        child_env,
        PATH=f"{bin_dir}{os.pathsep}{child_env.get('PATH', '')}",
        SLURM_JOB_ID="4242", SLURM_NTASKS="1", SLURM_JOB_NAME="train", SLURM_NODELIST="localhost",
        SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
    )  # fmt: skip
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, str(PL_SCRIPT), "--out", str(tmp_path / "out"), "--max-steps", "24",
         "--step-time", "0.2", "--ready", str(ready), "--smartckpt", str(tmp_path / "ck")],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the training never reached its first step"
        time.sleep(0.5)  # on_train_start has run: smartckpt's handler is on top of Lightning's
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"], out
    assert list((tmp_path / "out").glob("hpc_ckpt_*.ckpt")), "Lightning's own requeue handler did not run"
    reasons = [
        json.loads(p.read_text())["meta"]["reason"] for p in (tmp_path / "ck" / "manifests").glob("*.json")
    ]
    assert "preemption (SIGUSR1)" in json.dumps(reasons), reasons


def test_manager_read_then_apply_piece_by_piece(tmp_path):
    """What the callbacks build on: read() loads without applying, apply(names) loads only those."""
    import torch

    import smartckpt_cli as sc

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    with sc.CheckpointManager(tmp_path) as mgr:
        assert mgr.read() is None  # an empty store
        mgr.register(model=model, optimizer=opt)
        mgr.save(7, blocking=True)
    saved_weight = model.weight.detach().clone()
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(model=fresh, optimizer=fresh_opt)
        loaded = mgr.read()
        assert loaded is not None and loaded.record.step == 7
        assert not torch.equal(fresh.weight, saved_weight)  # read() applied nothing
        assert mgr.apply(loaded, ["model"]) == 7
        assert torch.equal(fresh.weight, saved_weight) and not fresh_opt.state  # only the model
        mgr.apply(loaded, ["optimizer"])
        assert torch.equal(
            fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
        )
