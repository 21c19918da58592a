"""A node comes back with a wiped disk while the remote is down: the run's checkpoints are on the
remote, and an outage at start must never cost them.

Real processes under ``smartckpt run``, a real S3 API (moto's server) behind a gate that refuses
connections (nothing listens while it is shut): a first run trains to step 30 and uploads; the
node's disk is wiped; the second start finds the remote down for 20 s, waits for it, resumes from
step 30. Down for longer than ``remote_start_wait``: the start is refused in one line with exit
code 5 and no store id is minted; ``--remote-start-fresh`` starts a new store at step 0, saying so.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from smartckpt_cli.remote.start_wait import next_move
from smartckpt_cli.supervise.policy import AttemptEnd, classify
from tests._s3 import Gate, MotoServer, client, free_port, s3_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "zero_code_train.py"


def test_waiting_for_the_remote_is_decided_purely():
    assert next_move(0.0, 300.0, 1, False) == ("retry", 1.0)
    assert next_move(10.0, 300.0, 4, False) == ("retry", 8.0)
    assert next_move(200.0, 300.0, 12, False) == ("retry", 30.0)  # capped
    assert next_move(295.0, 300.0, 12, False) == ("retry", 5.0)  # never past the limit
    assert next_move(300.0, 300.0, 13, False) == ("refuse", 0.0)
    assert next_move(0.0, 300.0, 1, True) == ("fresh", 0.0)


def test_a_refused_start_stops_smartckpt_run_with_its_own_exit_code():
    end = AttemptEnd(
        1, False, {"type": "smartckpt_cli.errors.RemoteStartRefused", "message": "remote s3://b unreachable"}
    )
    out = classify(end)
    assert (out.action, out.category, out.exit_code) == ("stop", "remote-unreachable", 5)


@pytest.fixture(scope="module")
def s3():
    server = MotoServer(free_port()).start()
    gate = Gate(server.port).open()
    client(server.port).create_bucket(Bucket="bkt")
    yield gate, {**s3_env(server.port), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{gate.port}"}
    gate.shut()
    server.stop()


def _run(
    tmp: Path, env: dict[str, str], total: int, *extra: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", "5",
         "--remote", "s3://bkt/run", *extra, str(SCRIPT), "--total", str(total)],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _waiting(store: Path) -> bool:
    """Whether a training process under ``store``'s run directory beats "waiting for the remote"."""
    from smartckpt_cli.hooks import _smartckpt_protocol as proto

    for path in store.glob("runs/*/heartbeat.*"):
        beat = proto.read_heartbeat(str(path), 0)
        if beat is not None and beat.state == proto.WAITING:
            return True
    return False


def _start_line(out: str) -> int:
    return int(next(line for line in out.splitlines() if line.startswith("start ")).split()[1])


@pytest.mark.slow
def test_a_wiped_node_starting_during_an_outage_resumes_from_the_remote(s3, tmp_path, child_env):
    gate, s3vars = s3
    env = {**child_env, **s3vars, "SMARTCKPT_REMOTE_CLOSE_WAIT": "60"}
    first = _run(tmp_path, env, 30)
    assert first.returncode == 0, first.stdout + first.stderr

    shutil.rmtree(tmp_path / "ck")  # the node's disk is gone
    gate.shut()  # and S3 refuses connections: for 20 s from the moment the start waits for it
    waited: list[float] = []
    stop = threading.Event()

    def reopen_20_s_after_the_wait_began() -> None:
        while not stop.is_set():
            if _waiting(tmp_path / "ck"):
                waited.append(time.monotonic())
                stop.wait(20.0)
                break
            stop.wait(0.1)
        gate.open()

    watcher = threading.Thread(target=reopen_20_s_after_the_wait_began, daemon=True)
    watcher.start()
    try:
        second = _run(tmp_path, env, 40)
    finally:
        stop.set()
        watcher.join()
    out = second.stdout + second.stderr
    assert second.returncode == 0, out
    assert waited, "the start never showed it was waiting for the remote (heartbeat state WAITING)"
    assert _start_line(second.stdout) == 30, out  # resumed from the remote, not from step 0
    assert "waiting for it" in out and "answers again" in out, out
    print(f"remote outage at start (20 s): waited, resumed from step {_start_line(second.stdout)}")


@pytest.mark.slow
def test_an_outage_longer_than_remote_start_wait_refuses_the_start(s3, tmp_path, child_env):
    gate, s3vars = s3
    env = {**child_env, **s3vars, "SMARTCKPT_REMOTE_START_WAIT": "6", "SMARTCKPT_REMOTE_CLOSE_WAIT": "2"}
    elsewhere = tmp_path / "fresh"
    elsewhere.mkdir()
    gate.shut()
    try:
        refused = _run(tmp_path, env, 10)
        fresh = _run(elsewhere, env, 10, "--remote-start-fresh")
    finally:
        gate.open()
    out = refused.stdout + refused.stderr
    assert refused.returncode == 5, out
    lines = [line for line in out.splitlines() if "unreachable for" in line]
    assert "Traceback" not in out, out
    assert lines and "--remote-start-fresh" in lines[-1] and "s3://bkt/run" in lines[-1], out
    assert "start 0" not in refused.stdout, "it must not train from step 0"
    assert not (tmp_path / "ck" / "journal.jsonl").exists(), (
        "no store id may be minted while the remote is down"
    )
    print(f"remote down past remote_start_wait: exit {refused.returncode}: {lines[-1]}")

    out = fresh.stdout + fresh.stderr
    assert fresh.returncode == 0, out
    assert _start_line(fresh.stdout) == 0 and "as asked (remote_start_fresh)" in out, out
