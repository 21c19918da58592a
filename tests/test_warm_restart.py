"""Warm restarts: while an attempt trains, ``smartckpt run`` starts the next attempt's interpreter
(torch and smartckpt imported) and, after a crash, hands it the attempt instead of starting a new
one. Real processes throughout: a real ``smartckpt run``, a real SIGKILL of the training process
(and of the spare, and of the supervisor), the script's own view of itself compared between a
cold and a warm start, the result compared bit for bit with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from smartckpt_cli.supervise.warm import WarmPlan, env_differs, warm_plan
from tests._state import assert_same_state

PY = sys.executable

# Attempt 0 trains to step 20, then waits for the test's go (the file kill-now) and SIGKILLs
# itself; attempt 1 raises 5 steps after it resumed; attempt 2 trains to the end. Each start
# writes what the script sees of itself (seen.<attempt>.json) into $OUT.
TRAIN = r"""
import json, os, signal, sys, time
import torch
from smartckpt_cli.agent.runtime import start_step

def _started():  # this process's start, seconds since boot (CLOCK_BOOTTIME, 10 ms ticks)
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")

out = os.environ["OUT"]
attempt = int(os.environ.get("SMARTCKPT_ATTEMPT", "-1"))
with open(os.path.join(out, f"seen.{attempt}.json"), "w") as f:
    json.dump({"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
               "orig_argv": sys.orig_argv[1:], "cwd": os.getcwd(), "pid": os.getpid(),
               "spec": getattr(__spec__, "name", None), "main_file": getattr(sys.modules["__main__"], "__file__", None),
               "hooks": bool(getattr(sys, "_smartckpt_hooks", {}).get("active")),
               "created": _started()}, f)
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
begin = start_step()
for step in range(begin, 60):
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if step == begin:  # a first step of 1 s: the next spare must not start before it ends
        time.sleep(1.0)
    opt.step()
    if step == begin:
        with open(os.path.join(out, f"stepped.{attempt}"), "w") as f:
            f.write(repr(time.clock_gettime(time.CLOCK_BOOTTIME)))
    if attempt == 0 and step == 20:
        while not os.path.exists(os.path.join(out, "kill-now")):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == 1 and step == begin + 5:
        raise RuntimeError("injected after the warm restart")
    time.sleep(0.01)
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()},
           os.path.join(out, "final.pt"))
"""


def _start(tmp_path: Path, env: dict[str, str], target: list[str], *options: str) -> subprocess.Popen[str]:
    cmd = [
        PY,
        "-m",
        "smartckpt_cli.cli.app",
        "run",
        "--dir",
        "ck",
        "--every",
        "5",
        *options,
        "--",
        PY,
        *target,
    ]
    return subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _read_until(proc: subprocess.Popen[str], said: list[str], needle: str, timeout: float = 90.0) -> str:
    """Lines of the run's output until one holds ``needle`` (that line); all kept in ``said``."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        said.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} never said:\n{''.join(said)}")


def _finish(proc: subprocess.Popen[str], said: list[str]) -> str:
    rest, _ = proc.communicate(timeout=180)
    said.append(rest)
    return "".join(said)


def _record(tmp_path: Path) -> dict:
    (path,) = (tmp_path / "ck" / "runs").glob("*.json")
    return json.loads(path.read_text())


def _env(child_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    # a long hang timeout: attempt 0 waits for the test's go without stepping
    return dict(child_env, OUT=str(tmp_path), SMARTCKPT_RESTART_BACKOFF="0", SMARTCKPT_HANG_TIMEOUT="300",
                SMARTCKPT_RAM_DIR=str(tmp_path))  # fmt: skip


def _reference(tmp_path: Path, child_env: dict[str, str]) -> dict:
    ref = tmp_path / "reference"
    ref.mkdir()
    (ref / "train.py").write_text(TRAIN)
    env = dict(child_env, OUT=str(ref), SMARTCKPT_DIR=str(ref / "store"))
    subprocess.run([PY, "train.py"], cwd=ref, env=env, check=True, capture_output=True, timeout=120)
    return torch.load(ref / "final.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("as_module", [False, True], ids=["script", "module"])
def test_a_crash_restarts_in_the_spare_which_runs_the_script_as_a_new_interpreter_would(
    tmp_path, child_env, as_module
):
    """The spare announced while attempt 0 trains becomes attempt 1 (same pid); the script sees
    itself exactly as in the cold start (name, file, argv, path, cwd), the hooks are live, its
    traceback holds none of smartckpt's frames, the record says warm and gives the phases, and
    the result after two crashes equals an uninterrupted run's bit for bit."""
    expected = _reference(tmp_path, child_env)
    if as_module:
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / "__init__.py").write_text("")
        (tmp_path / "pkg" / "train.py").write_text(TRAIN)
        target = ["-u", "-m", "pkg.train", "--lr", "3"]
    else:
        (tmp_path / "train.py").write_text(TRAIN)
        target = ["-u", "train.py", "--lr", "3"]
    said: list[str] = []
    proc = _start(tmp_path, _env(child_env, tmp_path), target)
    ready = _read_until(proc, said, "waits for the next restart")
    spare = int(ready.split("(pid ")[1].split(")")[0])
    assert "torch and smartckpt imported in" in ready and "MiB resident" in ready
    (tmp_path / "kill-now").touch()
    _read_until(proc, said, f"attempt 1: started pid {spare} in the warm spare")
    out = _finish(proc, said)
    assert proc.returncode == 0, out

    assert_same_state(torch.load(tmp_path / "final.pt", weights_only=True), expected)
    cold = json.loads((tmp_path / "seen.0.json").read_text())
    warm = json.loads((tmp_path / "seen.1.json").read_text())
    assert warm["pid"] == spare
    for key in ("name", "file", "argv", "path0", "orig_argv", "cwd", "spec", "main_file", "hooks"):
        assert warm[key] == cold[key], key
    assert cold["hooks"] and cold["argv"][1:] == ["--lr", "3"]

    rec = _record(tmp_path)
    first, second, third = rec["attempts"]
    assert (first["warm"], second["warm"], third["warm"]) == (False, True, True)
    assert first["cause"] == "killed by SIGKILL" and second["start_step"] == first["restart_from"] > 0
    assert second["restored_from"] == "ram" and second["resume_check"]["verdict"] == "exact"
    phases = second["phases"]
    assert {"detection", "relaunch", "imports", "to_restore", "restore", "start_to_first_step"} <= set(phases)
    assert 0 <= phases["detection"] < 5 and phases["imports"] <= phases["to_restore"]
    assert first["died"] is not None and first["died"] <= first["ended"]
    # each spare started after the attempt before it trained its first step, not during its
    # imports, restore or first step (it would compete for the cores)
    third_seen = json.loads((tmp_path / "seen.2.json").read_text())
    for spare_seen, before in ((warm, 0), (third_seen, 1)):
        stepped = float((tmp_path / f"stepped.{before}").read_text())
        assert spare_seen["created"] >= stepped - 0.02, (before, spare_seen["created"], stepped)
    # the warm attempt's failure reads as the script's own
    assert second["error"]["type"] == "RuntimeError"
    assert "agent/warm.py" not in second["error"]["traceback"] and "runpy" not in second["error"]["traceback"]
    tb = out[out.index("Traceback (most recent call last)") :]
    assert "RuntimeError: injected after the warm restart" in tb
    assert "agent/warm.py" not in tb.split("RuntimeError: injected")[0]


@pytest.mark.slow
def test_no_warm_restart_starts_every_attempt_in_a_new_interpreter(tmp_path, child_env):
    (tmp_path / "train.py").write_text(TRAIN)
    said: list[str] = []
    proc = _start(tmp_path, _env(child_env, tmp_path), ["train.py"], "--no-warm-restart")
    _read_until(proc, said, "attempt 0: started pid")
    time.sleep(3.0)  # when a spare would be announced
    (tmp_path / "kill-now").touch()
    out = _finish(proc, said)
    assert proc.returncode == 0, out
    assert "spare interpreter" not in out and "warm spare" not in out
    assert [a["warm"] for a in _record(tmp_path)["attempts"]] == [False, False, False]
    assert _record(tmp_path)["settings"]["warm_restart"] is False


@pytest.mark.slow
def test_a_dead_spare_gives_one_line_and_a_cold_restart(tmp_path, child_env):
    (tmp_path / "train.py").write_text(TRAIN)
    said: list[str] = []
    proc = _start(tmp_path, _env(child_env, tmp_path), ["train.py"])
    ready = _read_until(proc, said, "waits for the next restart")
    spare = int(ready.split("(pid ")[1].split(")")[0])
    os.kill(spare, signal.SIGKILL)
    _read_until(proc, said, "warm restart off: the spare interpreter exited (killed by SIGKILL)")
    (tmp_path / "kill-now").touch()
    out = _finish(proc, said)
    assert proc.returncode == 0, out
    attempts = _record(tmp_path)["attempts"]
    assert [a["warm"] for a in attempts] == [False, False, False]
    assert attempts[1]["start_step"] == attempts[0]["restart_from"] > 0
    assert out.count("warm restart off") == 1 and "Traceback" in out  # attempt 1's own error only


@pytest.mark.slow
def test_the_spare_goes_when_the_supervisor_is_killed(tmp_path, child_env):
    """SIGKILL the supervisor itself: its end of the control socket closes and the spare exits,
    rather than waiting forever holding a few hundred MiB."""
    (tmp_path / "train.py").write_text(TRAIN)
    said: list[str] = []
    proc = _start(tmp_path, _env(child_env, tmp_path), ["train.py"])
    child = int(_read_until(proc, said, "attempt 0: started pid").split("started pid ")[1].split()[0])
    ready = _read_until(proc, said, "waits for the next restart")
    spare = int(ready.split("(pid ")[1].split(")")[0])
    try:
        proc.kill()
        proc.wait(timeout=10)
        end = time.monotonic() + 15
        while time.monotonic() < end and _alive(spare):
            time.sleep(0.1)
        assert not _alive(spare), "the spare outlived its supervisor"
    finally:
        for pid in (child, spare):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (its parent, the supervisor, is gone; init reaps it soon) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    ("command", "plan"),
    [
        ([PY, "train.py", "--lr", "3"], WarmPlan([PY], "train.py", False, ["--lr", "3"])),
        ([PY, "-u", "-W", "error", "-Ximporttime", "t.py"], WarmPlan([PY, "-u", "-W", "error", "-Ximporttime"], "t.py", False, [])),
        ([PY, "-X", "dev", "-m", "pkg.train", "-x"], WarmPlan([PY, "-X", "dev"], "pkg.train", True, ["-x"])),
        ([PY, "-uB", "--", "t.py"], WarmPlan([PY, "-uB"], "t.py", False, [])),
        ([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "t.py"], "`-m torch.distributed.run` starts its own workers cold"),
        ([PY, "-c", "print(1)"], "`python -c` runs no script"),
        ([PY, "-I", "t.py"], "interpreter option -I is not handled"),
        ([PY, "-i", "t.py"], "interpreter option -i is not handled"),
        ([PY], "no script to run"),
        ([PY, "-m"], "no module to run"),
        (["torchrun", "--nproc_per_node", "2", "t.py"], "`torchrun` is not a Python interpreter"),
        (["bash", "run.sh"], "`bash` is not a Python interpreter"),
        (["/nowhere/python3", "t.py"], "`/nowhere/python3` is not found"),
    ],
)  # fmt: skip
def test_which_commands_a_spare_can_run(command, plan):
    assert warm_plan(command) == plan


def test_an_environment_that_differs_outside_the_handshake_is_named_not_shown():
    spare = {"PATH": "/bin", "HF_TOKEN": "secret-a", "SMARTCKPT_ATTEMPT": "1"}
    assert env_differs(spare, dict(spare, SMARTCKPT_ATTEMPT="2", SMARTCKPT_RUN_DIR="/r")) == []
    assert env_differs(spare, dict(spare, HF_TOKEN="secret-b", OMP_NUM_THREADS="1")) == [
        "HF_TOKEN",
        "OMP_NUM_THREADS",
    ]
