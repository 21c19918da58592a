"""Every journal command as a real ``python -m smartckpt_cli.cli.app`` process, on a finished
store and on a store a real training process is writing at that moment.

The concurrent test starts the deterministic demo training (a checkpoint every 3 steps, its own
retention at keep_last 8) and, while it runs, inspects, verifies, prunes, rolls back and undoes,
and exports, over and over. The run must finish with no failed save, the store must verify, and
a resume must load the newest live checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from smartckpt_cli.cli.app import app

APP = [sys.executable, "-m", "smartckpt_cli.cli.app"]
# Runs until stopped with SIGTERM: a checkpoint every 3 steps of ~30 ms.
TRAIN_ARGS = ["--steps", "1000000", "--save-every", "3", "--step-time", "0.03"]


def _run(args: list[str], env: dict[str, str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*APP, *args], capture_output=True, text=True, env=env, timeout=180, **kw)  # type: ignore[call-overload]


def test_each_command_as_a_process(demo_store: Path, tmp_path: Path, child_env: dict[str, str]) -> None:
    store = tmp_path / "store"
    shutil.copytree(demo_store, store)
    # Independent read-only commands run concurrently (each process imports torch: seconds).
    jobs = {
        "inspect": ["inspect", str(store), "--json"],
        "ls": ["ls", str(store)],
        "detail": ["inspect", str(store), "--step", "25", "--json"],
        "config": ["config", "show", "--json", "--set", "keep_last=7"],
        "help": ["prune", "-h"],
    }
    procs = {
        k: subprocess.Popen(
            [*APP, *a], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env, cwd=tmp_path
        )
        for k, a in jobs.items()
    }
    res = {k: (p.communicate(timeout=180), p.returncode) for k, p in procs.items()}
    for k, ((_, err), rc) in res.items():
        assert rc == 0, (k, err)
    rows = json.loads(res["inspect"][0][0])["checkpoints"]
    assert [r["step"] for r in rows] == [30, 25, 20, 15, 10, 5]
    assert "every 5 steps" in res["ls"][0][0]
    assert json.loads(res["detail"][0][0])["checkpoint"]["step"] == 25
    cfg = json.loads(res["config"][0][0])["settings"]
    assert cfg["keep_last"] == {"value": 7, "source": "flag"}
    assert "Example" in res["help"][0][0]

    ver = _run(["verify", str(store), "--all"], child_env)
    assert ver.returncode == 0 and ver.stdout.count(": ok") == 6, ver.stdout + ver.stderr
    pr = _run(["prune", str(store), "--keep", "3"], child_env)
    assert pr.returncode == 0, pr.stderr
    assert "removed step 15" in pr.stdout and "kept steps 30, 25, 20" in pr.stdout
    rb = _run(["rollback", str(store), "--to-prev"], child_env)
    assert rb.returncode == 0 and "rolled back to step 25" in rb.stdout, rb.stderr
    undo = _run(["rollback", str(store), "--undo"], child_env)
    assert undo.returncode == 0 and "live again: steps 30" in undo.stdout, undo.stderr
    out = tmp_path / "model.pt"
    ex = _run(["export", str(store), str(out), "--weights-only"], child_env)
    assert ex.returncode == 0, ex.stderr
    assert "model/0.weight" not in torch.load(out, weights_only=True) and "0.weight" in torch.load(
        out, weights_only=True
    )
    # Errors from a real process: one line, the documented code, no traceback.
    bad = _run(["rollback", str(store), "--to", "7"], child_env)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "smartckpt: error: no checkpoint of step 7 in this store (live steps: 30, 25, 20)"
    ]


def _inspect(store: Path, env: dict[str, str]) -> list[dict]:
    r = _run(["inspect", str(store), "--json"], env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["checkpoints"]


def _popen(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([*APP, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_commands_while_a_training_process_writes(tmp_path: Path, child_env: dict[str, str]) -> None:
    store = tmp_path / "store"
    # The run's own retention keeps 8: the commands' prune --keep 2 does most of the pruning.
    env = {**child_env, "SMARTCKPT_KEEP_LAST": "8"}
    trainer = subprocess.Popen(
        [sys.executable, "-m", "smartckpt_cli.ops.demo_train", "--dir", str(store), *TRAIN_ARGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    cli = CliRunner()
    steps_seen: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (store / "journal.jsonl").exists() or len(_inspect(store, child_env)) < 3:
            assert trainer.poll() is None, trainer.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        for rounds in range(2):
            # Independent commands at once (each process spends seconds importing torch).
            out = tmp_path / f"export{rounds}.pt"
            procs = {
                "inspect": _popen(["inspect", str(store), "--json"], child_env),
                "verify": _popen(["verify", str(store), "--all"], child_env),
                "export": _popen(["export", str(store), str(out), "--weights-only"], child_env),
            }
            done = {k: (*p.communicate(timeout=180), p.returncode) for k, p in procs.items()}
            for k, (o, e, rc) in done.items():
                assert rc == 0, (k, o, e)
            rows = json.loads(done["inspect"][0])["checkpoints"]
            steps_seen.append(max(r["step"] for r in rows))
            assert "0.weight" in torch.load(out, weights_only=True)
            inproc = cli.invoke(app, ["verify", str(store), "--all", "--no-record"])
            assert inproc.exit_code == 0, inproc.output
            pr = _run(["prune", str(store), "--keep", "2"], child_env)
            assert pr.returncode == 0, pr.stdout + pr.stderr
            if rounds == 0:
                rb = _run(["rollback", str(store), "--to-prev"], child_env)
                assert rb.returncode == 0, rb.stderr
                assert "a run is writing this store" in rb.stderr
                undo = _run(["rollback", str(store), "--undo"], child_env)
                assert undo.returncode == 0, undo.stderr
            assert trainer.poll() is None, "the training must still be writing"
        trainer.terminate()  # preemption: a blocking save at the next step, then exit by SIGTERM
        stdout, stderr = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert trainer.returncode == -15, stderr
    assert "failed" not in stderr.lower(), stderr  # "save of step N failed" would be logged
    assert steps_seen[1] > steps_seen[0], steps_seen
    final = _run(["verify", str(store), "--all", "--json"], child_env)
    assert final.returncode == 0, final.stdout
    report = json.loads(final.stdout)
    assert report["journal_problems"] == [] and report["results"]
    newest = next(r["step"] for r in _inspect(store, child_env) if r["restore_target"])
    last = max(int(line.split()[1]) for line in stdout.splitlines() if line.startswith("step "))
    assert newest == last, "the preemption save is the newest checkpoint"
    resume = subprocess.run(
        [
            sys.executable,
            "-m",
            "smartckpt_cli.ops.demo_train",
            "--dir",
            str(store),
            "--steps",
            str(newest + 3),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert resume.returncode == 0 and f"restored step {newest}" in resume.stdout, resume.stderr


def test_verify_shows_a_progress_bar_only_on_a_terminal(demo_store: Path, child_env: dict[str, str]) -> None:
    import pty

    master, slave = pty.openpty()
    env = {**child_env, "TERM": "xterm", "COLUMNS": "100"}
    proc = subprocess.Popen(
        [*APP, "verify", str(demo_store), "--all", "--no-record"],
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out, _ = proc.communicate(timeout=180)
    os.close(master)
    tty = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0
    assert "verifying" in tty and "checked" in tty, tty
    assert out.decode().count(": ok") == 6  # stdout (a pipe) gets the plain lines only
    piped = _run(["verify", str(demo_store), "--all", "--no-record"], child_env)
    assert piped.returncode == 0 and piped.stderr == ""
