"""A flash persist reaches the remote: the RAM snapshot a SIGKILLed training process leaves
behind is a checkpoint on the remote too, whether another attempt follows or not.

Real processes under ``smartckpt run --remote s3://...`` against a real S3 API (moto's server),
a real SIGKILL of the training process, RAM snapshots every 0.3 s and the disk every 1,000 steps,
so the only copy of the work done is the RAM snapshot the supervisor persists. A restart follows:
the next attempt's uploader ships the flash-persisted checkpoint with its own. None follows
(``max_restarts`` 0, or an error that ``no_restart_on`` stops): the supervisor ships it itself
before the run ends. Either way the remote's copy verifies (every blob downloaded and re-hashed),
and where it is the newest, an empty node restores it from the remote and trains on bit-exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from smartckpt_cli.ops.verify import verify
from smartckpt_cli.remote.check import connect, reach
from tests._s3 import MotoServer, client, free_port, s3_env
from tests._state import assert_same_state

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SUPERVISED = ROOT / "tests" / "scripts" / "supervised_train.py"


@pytest.fixture(scope="module")
def moto():
    server = MotoServer(free_port()).start()
    yield server
    server.stop()


@pytest.fixture
def s3(moto, monkeypatch):
    """A fresh bucket on the module's server; the AWS_* variables set in this process too."""
    bucket = f"b-{uuid.uuid4().hex[:16]}"
    env = s3_env(moto.port)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    client(moto.port).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run", env


def _run(tmp: Path, env: dict[str, str], url: str, *script_args: str) -> tuple[int, str, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", "1000",
         "--ram-every", "0.3", "--remote", url, str(SUPERVISED), "--total", "60", "--step-time", "0.03",
         "--out", "final.pt", *script_args],
        # two RAM slots: a kill at any moment finds a whole snapshot to flash-persist
        cwd=tmp, env=dict(env, SMARTCKPT_RESTART_BACKOFF="0.1", SMARTCKPT_RAM_DIR=str(tmp), SMARTCKPT_RAM_SLOTS="2"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (path,) = (tmp / "ck" / "runs").glob("*.json")
    return out.returncode, out.stdout + out.stderr, json.loads(path.read_text())


def _remote_checks(url: str, step: int) -> tuple[list[int], list]:
    """The remote's live steps, and ``step``'s copy verified there (every blob re-hashed)."""
    _, _, state = connect(url)
    live = sorted(r.step for r in state.live())
    return live, verify(reach(url), step=step).results


def test_a_restart_follows_its_uploader_ships_the_flash_persisted_checkpoint(tmp_path, child_env, s3):
    url, s3vars = s3
    # 120 steps: the restarted attempt outlives the flash persist behind it (about a second)
    code, said, rec = _run(tmp_path, {**child_env, **s3vars}, url, "--kill-at", "45", "--total", "120")
    assert code == 0, said
    first, second = rec["attempts"]
    step = first["flash_persisted"]
    assert first["cause"] == "killed by SIGKILL" and step is not None and 0 < step <= 45, said
    assert second["start_step"] == step and second["restored_from"] == "ram", said
    live, checks = _remote_checks(url, step)
    assert step in live, f"the flash-persisted step {step} is not on the remote (live: {live})\n{said}"
    assert len(checks) == 1 and checks[0].ok, checks
    # shipped by the next attempt's uploader: the supervisor found it there and had nothing to do;
    # it ships it itself only when the flash persist ended after that attempt had finished (a
    # loaded machine), and never leaves it off the remote
    assert "is not on the remote" not in said, said
    if "is on the remote" in said:
        lines = said.splitlines()
        persisted = next(i for i, ln in enumerate(lines) if "is a checkpoint of the store now" in ln)
        assert persisted > lines.index("done 120"), said
    assert "Traceback" not in said, said


@pytest.mark.parametrize("end", ["gave-up", "stopped"])
def test_no_restart_follows_the_supervisor_ships_it_and_an_empty_node_restores_it(
    tmp_path, child_env, s3, end
):
    """``gave-up``: SIGKILL with ``max_restarts`` 0 (the flash persist runs behind, the run ends);
    ``stopped``: an error ``no_restart_on`` names (the flash persist runs at once)."""
    url, s3vars = s3
    env = {**child_env, **s3vars}
    ref = tmp_path / "reference"
    ref.mkdir()
    subprocess.run(
        [sys.executable, str(SUPERVISED), "--total", "60", "--out", str(ref / "final.pt"), "--step-time", "0"],
        env=dict(child_env, SMARTCKPT_DIR=str(ref / "store")), check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    if end == "gave-up":
        code, said, rec = _run(tmp_path, dict(env, SMARTCKPT_MAX_RESTARTS="0"), url, "--kill-at", "45")
        assert code == 3 and rec["outcome"] == "gave-up", said
    else:
        code, said, rec = _run(
            tmp_path, dict(env, SMARTCKPT_NO_RESTART_ON="injected failure"), url, "--fail-at", "45"
        )
        assert code == 1 and rec["outcome"] == "failed", said
    (only,) = rec["attempts"]
    step = only["flash_persisted"]
    assert step is not None and 0 < step <= 45, said
    live, checks = _remote_checks(url, step)
    assert live and max(live) == step, (
        f"the flash-persisted step {step} is not on the remote (live: {live})\n{said}"
    )
    assert len(checks) == 1 and checks[0].ok, checks
    assert f"flash persist: step {step} is on the remote s3://" in said, said
    if end == "gave-up":  # (the other one's traceback is the script's own)
        assert "Traceback" not in said, said

    # another node, nothing local: it restores the flash-persisted step from the remote
    fresh = tmp_path / "fresh"
    out = subprocess.run(
        [sys.executable, str(SUPERVISED), "--total", "60", "--out", str(fresh / "final.pt"), "--step-time", "0"],
        env=dict(env, SMARTCKPT_DIR=str(fresh / "store"), SMARTCKPT_REMOTE=url, SMARTCKPT_EVERY_STEPS="1000"),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"start {step}\n" in out.stdout, out.stdout + out.stderr
    assert_same_state(
        torch.load(fresh / "final.pt", weights_only=True), torch.load(ref / "final.pt", weights_only=True)
    )


DDP = ROOT / "tests" / "scripts" / "ddp_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def test_two_ranks_no_restart_follows_both_parts_reach_the_remote(tmp_path, child_env, s3):
    """Two DDP ranks, rank 1 SIGKILLs itself, ``max_restarts`` 0: the flash persist is a
    checkpoint of two parts; the supervisor ships both (one uploader per rank, rank 0's commit
    once both are marked) and the remote's copy verifies."""
    url, s3vars = s3
    out = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", "1000", "--ram-every",
         "0.3", "--remote", url, "--", *TORCHRUN, str(DDP), "--mode", "ddp", "--total", "40", "--kill-at", "30",
         "--kill-rank", "1", "--step-time", "0.05"],
        cwd=tmp_path, env={**child_env, **s3vars, "OMP_NUM_THREADS": "1", "SMARTCKPT_MAX_RESTARTS": "0",
                           "SMARTCKPT_RAM_DIR": str(tmp_path)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    said = out.stdout + out.stderr
    assert out.returncode == 3, said
    (path,) = (tmp_path / "ck" / "runs").glob("*.json")
    (only,) = json.loads(path.read_text())["attempts"]
    step = only["flash_persisted"]
    assert step is not None and 0 < step <= 30, said
    _, _, state = connect(url)
    (rec,) = [r for r in state.live() if r.step == step]
    assert rec.world_size == 2, rec
    (check,) = verify(reach(url), step=step).results
    assert check.ok, check
    assert f"flash persist: step {step} is on the remote s3://" in said, said
