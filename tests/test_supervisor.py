"""``smartckpt run`` end to end: real supervisor, real training children, real signals.

The child is ``tests/scripts/supervised_train.py`` (an explicit CheckpointManager; it beats the
run protocol's heartbeat itself when the hooks do not). Faults are switched on by its flags, on
the first attempt or on every attempt.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from smartckpt_cli.store.journal import Journal
from smartckpt_cli.store.storage.local import LocalStorage
from tests._state import assert_same_state

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "supervised_train.py"
TOTAL = 40


def _env(child_env: dict[str, str], **extra: str) -> dict[str, str]:
    env = dict(child_env)
    env["SMARTCKPT_RESTART_BACKOFF"] = "0.1"
    env.update(extra)
    return env


def _start(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> tuple[int, str]:
    proc = _start(args, cwd, env)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _record(store: Path) -> dict:
    (path,) = (store / "runs").glob("*.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """An uninterrupted run of the same script, outside the supervisor."""
    d = tmp_path_factory.mktemp("reference")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env.update(PYTHONPATH=str(ROOT), SMARTCKPT_DIR=str(d / "store"), SMARTCKPT_EVERY_STEPS="5")
    subprocess.run(
        [sys.executable, str(SCRIPT), "--total", str(TOTAL), "--out", str(d / "final.pt"), "--step-time", "0"],
        env=env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return torch.load(d / "final.pt", weights_only=True)


def test_sigkill_at_a_random_step_finishes_bit_exact(tmp_path, child_env, reference):
    kill_at = random.Random(time.time_ns()).randrange(3, TOTAL - 2)
    rc, out = _run(
        ["--dir", "ck", "--every", "5", str(SCRIPT), "--total", str(TOTAL), "--kill-at", str(kill_at),
         "--out", "final.pt"],
        # two RAM slots: a snapshot stays whole while the next is copied, so a kill at any moment
        # finds one (with the default one slot a kill during the copy restores from disk:
        # test_ramtier's crash-in-copy test)
        tmp_path, _env(child_env, SMARTCKPT_RAM_SLOTS="2"),
    )  # fmt: skip
    assert rc == 0, out
    assert_same_state(torch.load(tmp_path / "final.pt", weights_only=True), reference)
    rec = _record(tmp_path / "ck")
    assert rec["outcome"] == "finished" and rec["restarts"] == 1
    first = rec["attempts"][0]
    assert first["category"] == "signal" and first["cause"] == "killed by SIGKILL"
    assert first["max_step"] == kill_at
    assert first["steps_lost"] == kill_at - first["restart_from"]
    # a checkpoint every 5 steps, or the RAM tier's newest snapshot persisted before the restart
    persisted = first["flash_persisted"]
    assert first["restart_from"] <= kill_at
    assert first["restart_from"] % 5 == 0 or first["restart_from"] == persisted
    assert f"lost {first['steps_lost']} step(s)" in out  # reported at the restart
    second = rec["attempts"][1]
    assert second["start_step"] == first["restart_from"]
    if first["restart_from"] == 0:  # killed before its first checkpoint: nothing to resume
        assert second["restored_from"] is None and second["resume_check"] is None
    else:
        # The resume is checked (exact), or its verdict says why it could not be: the killed run
        # died before the step after that checkpoint could be recorded. A RAM snapshot carries
        # that step's values as a disk checkpoint does.
        assert second["restored_from"] == "ram"  # the RAM tier is on by default under smartckpt run
        check = second["resume_check"]
        assert check is not None and check["step"] == second["start_step"] + 1, second
        assert check["verdict"] == "exact" or (
            check["verdict"] == "unchecked" and "recorded nothing after it" in check["why"]
        ), check
        assert f"resume check at step {check['step']}: {check['verdict']}" in out
    assert "1 restart(s)" in out and "run record:" in out
    # the failure taught an MTBF, handed to the restarted child for its Young/Daly interval
    assert rec["mtbf"] is not None and f"SMARTCKPT_MTBF={rec['mtbf']:.1f}" in out


def test_syntax_error_is_not_restarted(tmp_path, child_env):
    script = tmp_path / "broken.py"
    script.write_text('import os\nprint("unclosed"\n')
    rc, out = _run(["--dir", "ck", str(script)], tmp_path, _env(child_env))
    assert rc == 1, out
    assert "not restarting" in out and "a restart would fail the same way" in out
    rec = _record(tmp_path / "ck")
    assert len(rec["attempts"]) == 1 and rec["outcome"] == "failed"


def test_failure_before_the_first_step_is_not_restarted(tmp_path, child_env):
    rc, out = _run(
        ["--dir", "ck", str(SCRIPT), "--fail-at", "0", "--fault-attempts", "all"], tmp_path, _env(child_env)
    )
    assert rc == 1, out
    assert "failed before its first training step" in out and "not restarting" in out
    assert "RuntimeError: injected failure at step 0" in out  # the child's own traceback is shown
    assert len(_record(tmp_path / "ck")["attempts"]) == 1


def test_hang_is_detected_dumped_killed_and_resumed(tmp_path, child_env, reference):
    rc, out = _run(
        ["--dir", "ck", "--every", "5", "--hang-timeout", "2", str(SCRIPT), "--total", str(TOTAL),
         "--hang-at", "17", "--out", "final.pt"],
        tmp_path, _env(child_env),
    )  # fmt: skip
    assert rc == 0, out
    assert "the child hangs: no progress past step 17" in out
    rec = _record(tmp_path / "ck")
    first = rec["attempts"][0]
    assert first["category"] == "hang" and rec["restarts"] == 1
    assert first["stacks"], out
    stacks = Path(first["stacks"]).read_text()
    assert "supervised_train.py" in stacks  # the hung frame, from faulthandler
    assert f"stacks of the hung child in {first['stacks']}" in out
    assert_same_state(torch.load(tmp_path / "final.pt", weights_only=True), reference)


def test_crash_loop_rolls_back_once_then_stops(tmp_path, child_env):
    rc, out = _run(
        ["--dir", "ck", "--every", "5", str(SCRIPT), "--total", str(TOTAL), "--kill-at", "14",
         "--fault-attempts", "all", "--step-time", "0.1"],
        tmp_path, _env(child_env),
    )  # fmt: skip
    assert rc == 4, out
    assert "rolled back to step 5" in out
    assert (
        "crash loop: attempts keep dying at step 14" in out and "rolling back to step 5 did not help" in out
    )
    rec = _record(tmp_path / "ck")
    assert rec["outcome"] == "crash-loop" and len(rec["attempts"]) == 5
    assert [a["start_step"] for a in rec["attempts"]] == [0, 10, 10, 10, 5]
    # the first attempt got to checkpoint 10: restarted at once; then 0.1 s, doubling per attempt
    # that got nowhere (the rollback to 5 does not reset it)
    assert [a["delay"] for a in rec["attempts"][:4]] == [0.0, 0.1, 0.2, 0.4], rec["attempts"]
    assert "restarting from step 10 now" in out and "restarting from step 10 in 0.1 s" in out
    journal = Journal(LocalStorage(tmp_path / "ck"), tmp_path / "ck")
    raw = [json.loads(line) for line in journal.path.read_text().splitlines()]
    rollbacks = [e for e in raw if e["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] == 5


def test_sigterm_child_saves_both_exit_in_grace_and_resume_is_bit_exact(tmp_path, child_env, reference):
    env = _env(child_env, SMARTCKPT_GRACE_PERIOD="20")
    proc = _start(
        ["--dir", "ck", "--every", "1000", str(SCRIPT), "--total", str(TOTAL), "--step-time", "0.1",
         "--out", "final.pt"],
        tmp_path, env,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 15 "):
            break
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    out = "".join(lines) + rest
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert elapsed < 20, out
    journal = Journal(LocalStorage(tmp_path / "ck"), tmp_path / "ck").read()
    (ckpt,) = journal.records
    assert ckpt.reason.startswith("preemption") and ckpt.step >= 15
    assert not (tmp_path / "final.pt").exists()
    assert _record(tmp_path / "ck")["outcome"] == "stopped"
    # the child is gone too (its own process group)
    pid = _record(tmp_path / "ck")["attempts"][0]["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # resume under smartckpt run: restores that checkpoint and ends where the reference ends
    rc, out = _run(["--dir", "ck", "--every", "1000", str(SCRIPT), "--total", str(TOTAL), "--out", "final.pt"],
                   tmp_path, env)  # fmt: skip
    assert rc == 0, out
    assert f"start {ckpt.step}" in out
    assert_same_state(torch.load(tmp_path / "final.pt", weights_only=True), reference)


def test_python_isolated_mode_warns_that_hooks_are_not_live(tmp_path, child_env):
    rc, out = _run(
        ["--dir", "ck", "--", sys.executable, "-I", "-c", "print('ran')"], tmp_path, _env(child_env)
    )
    assert rc == 0, out
    assert "ran" in out
    assert "-I ignores PYTHONPATH" in out and "hooks are not live" in out and "drop -I" in out


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["missing.py"], {}, "script missing.py does not exist"),
        ([], {}, "no command"),
        (["--every", "0", "x.py"], {}, "--every"),
        (["--", "no-such-command-xyz"], {}, "not found"),
        (["x.py"], {"SMARTCKPT_MAX_RESTARTS": "-1"}, "max_restarts must be 0 or more"),
        (["x.py"], {"SMARTCKPT_HANG_TIMEOUT": "soon"}, "hang_timeout must be float"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, child_env, args, env, message):
    (tmp_path / "x.py").write_text("pass\n")
    rc, out = _run(["--dir", "ck", *args], tmp_path, _env(child_env, **env), timeout=60)
    assert rc == 2, out
    assert message in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1, out


def test_usr1_is_forwarded_the_child_saves_and_without_requeue_the_run_stops(tmp_path, child_env):
    proc = _start(
        ["--dir", "ck", "--every", "1000", str(SCRIPT), "--total", str(TOTAL), "--step-time", "0.1"],
        # eval_every 1: every heartbeat carries a loss (with 10, the status lines before step
        # 10 have none, and the preemption can come first)
        tmp_path, _env(child_env, SMARTCKPT_LOG_EVERY="0.5", SMARTCKPT_EVAL_EVERY="1"),
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 12 "):
            break
    proc.send_signal(signal.SIGUSR1)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 128 + signal.SIGUSR1, out
    assert "preempted by SIGUSR1" in out and "not requeued (requeue is off)" in out
    (ckpt,) = Journal(LocalStorage(tmp_path / "ck"), tmp_path / "ck").read().records
    assert ckpt.reason == "preemption (SIGUSR1)" and ckpt.step >= 12
    # not a terminal: periodic plain status lines, as a SLURM log wants them
    assert re.search(
        r"^smartckpt: attempt 0, restarts 0, step \d+(, [\d.]+ steps/s)?, loss [\d.e+-]+, .*cpu \d+%",
        out,
        re.M,
    ), out
    assert _record(tmp_path / "ck")["outcome"] == "preempted"


ZERO_CODE = ROOT / "tests" / "scripts" / "zero_code_train.py"


@pytest.mark.parametrize("flags", [(), ("--fp8",)], ids=["plain", "float8-buffers"])
def test_zero_code_script_killed_at_a_random_step_finishes_bit_exact(tmp_path, child_env, flags):
    """The front door: a plain loop with only start_step(), no CheckpointManager in the script.
    With ``--fp8`` the model also holds float8 buffers (amax history, scale) that every step
    updates: every save must commit (a health check that cannot read float8 would fail them all)
    and the resume must carry them bit for bit."""
    ref = tmp_path / "ref"
    ref.mkdir()
    subprocess.run(
        [sys.executable, str(ZERO_CODE), "--total", str(TOTAL), "--out", str(ref / "final.pt"), *flags],
        env=child_env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    kill_at = random.Random(time.time_ns()).randrange(11, TOTAL - 2)  # step 5 committed by then
    rc, out = _run(
        ["--dir", "ck", "--every", "5", str(ZERO_CODE), "--total", str(TOTAL), "--kill-at", str(kill_at),
         "--out", "final.pt", *flags],
        tmp_path, _env(child_env),
    )  # fmt: skip
    assert rc == 0, out
    assert "hooks are not live" not in out
    rec = _record(tmp_path / "ck")
    first = rec["attempts"][0]
    assert rec["restarts"] == 1 and first["max_step"] == kill_at, out
    assert f"start {first['restart_from']}" in out
    assert first["restart_from"] > 0  # the killed attempt committed checkpoints
    second = rec["attempts"][1]
    # the RAM tier is on by default under smartckpt run, with one slot: its snapshot of the newest
    # save restores, or the disk's copy of it when the kill came during that snapshot's copy
    where = second["restored_from"]
    assert second["start_step"] == first["restart_from"] and where in ("ram", "disk"), second
    assert second["resume_check"]["verdict"] == "exact", second  # zero-code: always recorded
    assert f"attempt 1: resumed at step {first['restart_from']} (restored from {where})" in out
    journal = [json.loads(ln) for ln in (tmp_path / "ck" / "journal.jsonl").read_text().splitlines()]
    assert not [r for r in journal if r["event"] == "save_failed"]
    assert [r["health"] for r in journal if r["event"] == "commit"] == ["ok"] * sum(
        r["event"] == "commit" for r in journal
    )
    assert_same_state(
        torch.load(tmp_path / "final.pt", weights_only=True), torch.load(ref / "final.pt", weights_only=True)
    )


def test_monitor_samples_a_real_process_tree():
    from smartckpt_cli.supervise.monitor import GpuMonitor, TreeMonitor

    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
         "x = bytearray(50 << 20); time.sleep(30)"],
        start_new_session=True,
    )  # fmt: skip
    try:
        mon = TreeMonitor(child.pid)
        deadline = time.monotonic() + 20
        usage = mon.sample()
        while (usage.processes < 2 or usage.rss < 50 << 20) and time.monotonic() < deadline:
            time.sleep(0.2)
            usage = mon.sample()
        assert usage.processes == 2 and usage.rss > 50 << 20
        cached = dict(mon._procs)
        mon.sample()
        assert all(mon._procs[p] is cached[p] for p in cached)  # the same Process objects
        gpu = GpuMonitor()
        if not gpu.available:  # no NVML or no GPU: normal, nothing to wait for
            assert gpu.held_by({child.pid}) == 0 and gpu.wait_freed({child.pid}) == (True, 0.0)
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # its own group: the grandchild too
        child.wait()


def test_panel_and_status_line_render():
    from rich.console import Console

    from smartckpt_cli.cli.run import _panel, _status
    from smartckpt_cli.supervise.runstate import RunState

    st = RunState(run_id="r1", command="python train.py", step=120, loss=0.25, heartbeat=True,
                  child_state="training", checkpoint_step=100, checkpoint_seen=time.time() - 5, restarts=2)  # fmt: skip
    console = Console(record=True, width=120)
    console.print(_panel(st))
    text = console.export_text()
    assert "120" in text and "0.25" in text and "step 100" in text and "restarts 2" in text
    line = _status(st)
    assert "step 120" in line and "checkpoint 100" in line and "restarts 2" in line
    assert "steps/s" not in line and "ETA" not in line  # neither a rate nor a total known yet
    st.total, st.rate = 1000, 2.0
    assert "step 120 of 1000 (12%), 2 steps/s, ETA 7m20s" in _status(st)
    console = Console(record=True, width=120)
    console.print(_panel(st))
    assert "120 of 1000 (12%), 2 steps/s, ETA 7m20s; loss 0.25" in console.export_text()


def test_the_pace_follows_the_last_half_minute_and_a_restart_starts_it_afresh():
    from smartckpt_cli.supervise.pace import WINDOW, Pace, eta_text

    pace = Pace()
    assert pace.rate(0.0) is None
    for t in range(0, 61):  # 1 step/s for a minute, then 4 steps/s
        pace.note(float(t), t)
    assert pace.rate(60.0) == pytest.approx(1.0)
    for i in range(1, 121):
        pace.note(60.0 + i / 4, 60 + i)
    # the window holds only the fast half minute (and the one sample before it)
    assert pace.rate(90.0) == pytest.approx(4.0, rel=0.05)
    assert pace.rate(90.0 + WINDOW) < 2.1  # no step for a while: the rate falls
    pace.note(100.0, 10)  # a restart from step 10
    assert pace.rate(100.0) is None
    assert eta_text(10, 100, 1.5) == "ETA 1m00s" and eta_text(0, 36000, 1.0) == "ETA 10h00m"
    assert eta_text(5, None, 1.0) is None and eta_text(100, 100, 1.0) is None


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path, child_env):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"
    proc = _start(
        ["--dir", "ck", "--", sys.executable, "-c", code],
        tmp_path,
        _env(child_env, SMARTCKPT_GRACE_PERIOD="2"),
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ready"):
            break
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=30)
    out = "".join(lines) + rest
    assert time.monotonic() - t0 < 6, out
    assert "grace period of 2 s over: killing the child" in out
    assert proc.returncode == 128 + signal.SIGKILL, out


def test_run_help_documents_the_exit_codes():
    from typer.testing import CliRunner

    from smartckpt_cli.cli.app import app

    result = CliRunner().invoke(app, ["run", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for needle in ("--every", "--max-restarts", "--hang-timeout", "--requeue", "--config", "Exit codes",
                   "128+N", "max_restarts reached", "crash loop"):  # fmt: skip
        assert needle in text, needle


def test_yaml_settings_gave_up_after_max_restarts(tmp_path, child_env):
    (tmp_path / "cfg.yaml").write_text("max_restarts: 0\nevery: 5\nrestart_backoff: 0.1\n")
    rc, out = _run(
        ["--config", "cfg.yaml", "--dir", "ck", str(SCRIPT), "--total", str(TOTAL), "--kill-at", "14",
         "--step-time", "0.1"],
        tmp_path, _env(child_env),
    )  # fmt: skip
    assert rc == 3, out
    assert "giving up after 0 restart(s) (max_restarts); last: killed by SIGKILL" in out
    rec = _record(tmp_path / "ck")
    resume = f"no attempt followed; a restart would resume at step {rec['attempts'][0]['restart_from']}"
    assert resume in out and "next attempt began" not in out
    assert rec["outcome"] == "gave-up"
    steps = [r.step for r in Journal(LocalStorage(tmp_path / "ck"), tmp_path / "ck").read().records]
    assert steps == [5, 10] and rec["checkpoints_taken"] == 2  # every: 5 from the YAML file


def test_no_restart_on_pattern_matches_the_error_file(tmp_path, child_env):
    rc, out = _run(
        ["--dir", "ck", "--every", "5", str(SCRIPT), "--total", str(TOTAL), "--fail-at", "9"],
        tmp_path, _env(child_env, SMARTCKPT_NO_RESTART_ON="injected failure at step \\d+"),
    )  # fmt: skip
    assert rc == 1, out
    assert "RuntimeError: injected failure at step 9 matches no_restart_on pattern" in out
    rec = _record(tmp_path / "ck")
    assert len(rec["attempts"]) == 1 and rec["attempts"][0]["error"]["type"] == "RuntimeError"


def _ctrl_c(tmp_path: Path, env: dict[str, str], args: list[str], at_step: int) -> tuple[int, str]:
    """``smartckpt run`` in a session of its own, as a shell runs a foreground job; when the child
    prints ``step {at_step}``, SIGINT goes to the whole process group, as a terminal's Ctrl-C does."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"step {at_step} "):
            os.killpg(proc.pid, signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=90)
    return proc.returncode, "".join(lines) + rest


@pytest.mark.parametrize("script", ["zero-code", "api"])
def test_ctrl_c_saves_at_the_next_step_without_a_traceback_and_resumes_bit_exact(
    tmp_path, child_env, reference, script
):
    """Ctrl-C in a terminal: SIGINT reaches the supervisor and the child alike. The child takes a
    blocking checkpoint at its next step and ends by SIGINT without a traceback; the summary
    counts what was really lost (nothing: the checkpoint is the step it reached); the rerun
    restores that checkpoint and ends where an uninterrupted run ends."""
    path = ZERO_CODE if script == "zero-code" else SCRIPT
    ref = reference
    if script == "zero-code":
        subprocess.run(
            [sys.executable, str(ZERO_CODE), "--total", str(TOTAL), "--out", str(tmp_path / "ref.pt")],
            env=child_env, check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    args = ["--dir", "ck", "--every", "1000", str(path), "--total", str(TOTAL), "--step-time", "0.1",
            "--out", "final.pt"]  # fmt: skip
    rc, out = _ctrl_c(tmp_path, _env(child_env), args, at_step=12)
    assert rc == 128 + signal.SIGINT, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    (ckpt,) = Journal(LocalStorage(tmp_path / "ck"), tmp_path / "ck").read().records
    assert ckpt.reason == "preemption (SIGINT)" and ckpt.step >= 12, out
    rec = _record(tmp_path / "ck")
    (att,) = rec["attempts"]
    assert rec["outcome"] == "stopped" and att["max_step"] == ckpt.step, rec
    assert att["restart_from"] == ckpt.step and att["steps_lost"] == 0 and rec["steps_lost"] == 0, rec
    assert f"SIGINT: checkpoint of step {ckpt.step} committed, stopping" in out
    assert "0 step(s) and" in out and f"a restart would resume at step {ckpt.step}" in out
    assert not (tmp_path / "final.pt").exists()
    rc, out = _run([*args[:-4], "--out", "final.pt"], tmp_path, _env(child_env))
    assert rc == 0, out
    assert f"start {ckpt.step}" in out
    assert_same_state(torch.load(tmp_path / "final.pt", weights_only=True), ref)


def _on_a_terminal_ctrl_c(
    tmp_path: Path, env: dict[str, str], args: list[str], at_step: int
) -> tuple[int, str]:
    """``smartckpt run`` on a real pseudo-terminal (its live panel on), its controlling terminal;
    when the child prints ``step {at_step}``, the terminal's interrupt character (Ctrl-C) is
    typed: the terminal itself sends SIGINT to its foreground process group."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))

    def controlling_terminal() -> None:  # after setsid (start_new_session): the pty becomes ours
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", *args],
        cwd=tmp_path, env={**env, "TERM": "xterm", "COLUMNS": "120"},
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True, preexec_fn=controlling_terminal,
    )  # fmt: skip
    os.close(slave)
    text, typed = b"", False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every process holding the terminal has gone
            break
        if not data:
            break
        text += data
        if not typed and re.search(
            rb"(^|\x1b\[[0-9;?]*[A-Za-z])step %d " % at_step, text.replace(b"\r", b""), re.M
        ):
            os.write(master, b"\x03")
            typed = True
    rc = proc.wait(timeout=60)
    os.close(master)
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text.decode(errors="replace")).replace("\r", "")
    assert typed, plain
    return rc, plain


def test_the_live_panel_shows_the_pace_and_agrees_with_the_summary_after_ctrl_c(tmp_path, child_env):
    """On a terminal: the panel shows the step of the total, steps/s and an ETA (the script said
    its total through start_step(total=)); Ctrl-C typed on the terminal saves and stops, and the
    panel's last frame counts the checkpoints the summary counts."""
    env = _env(child_env)
    args = ["--dir", "ck", "--every", "5", str(ZERO_CODE), "--total", str(TOTAL), "--step-time", "0.1"]
    rc, out = _on_a_terminal_ctrl_c(tmp_path, env, args, at_step=17)
    assert rc == 128 + signal.SIGINT, out
    assert "Traceback" not in out, out
    assert re.search(rf"\d+ of {TOTAL} \(\d+%\), [\d.]+ steps/s, ETA \d+s", out), out
    panel = [int(n) for n in re.findall(r"(\d+) this run", out)]
    (summary,) = [int(n) for n in re.findall(r"(\d+) checkpoint\(s\) taken", out)]
    steps = [r.step for r in Journal(LocalStorage(tmp_path / "ck"), tmp_path / "ck").read().records]
    assert summary == len(steps) and summary >= 4, (steps, out)  # 5, 10, 15 and the last one
    assert panel and panel[-1] == summary, out


def test_a_stop_whose_save_never_came_counts_the_steps_it_lost(tmp_path, child_env):
    """SIGINT to a child that does not save for it (INT taken off ``preempt_signals``, the RAM tier
    off): the run stops, and the summary says how many steps a rerun trains again, from the
    newest checkpoint to the step the child had reached."""
    env = _env(child_env, SMARTCKPT_PREEMPT_SIGNALS="TERM", SMARTCKPT_RAM="0")
    args = ["--dir", "ck", "--every", "5", str(SCRIPT), "--total", str(TOTAL), "--step-time", "0.1"]
    rc, out = _ctrl_c(tmp_path, env, args, at_step=13)
    assert rc == 128 + signal.SIGINT, out
    steps = [r.step for r in Journal(LocalStorage(tmp_path / "ck"), tmp_path / "ck").read().records]
    rec = _record(tmp_path / "ck")
    (att,) = rec["attempts"]
    assert steps and att["restart_from"] == max(steps) == 10, (steps, rec)
    assert att["steps_lost"] == att["max_step"] - 10 >= 3 and rec["steps_lost"] == att["steps_lost"], rec
    assert f"{att['steps_lost']} step(s) and" in out
    assert f"lost {att['steps_lost']} step(s)" in out and "a restart would resume at step 10" in out


def test_a_child_that_never_reaches_its_first_step_is_a_hang(tmp_path, child_env):
    """Hooks live, no heartbeat ever (a deadlock before the first step, as a rank waiting on a
    collective no other rank joins): after first_step_timeout the stacks are dumped and the child
    is killed as hung, not watched for ever."""
    script = tmp_path / "stuck.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(600)\n")
    env = _env(child_env, SMARTCKPT_FIRST_STEP_TIMEOUT="3", SMARTCKPT_MAX_RESTARTS="0")
    t0 = time.monotonic()
    rc, out = _run(["--dir", "ck", str(script)], tmp_path, env, timeout=120)
    assert time.monotonic() - t0 < 60, out
    assert rc == 3, out  # gave up: max_restarts 0
    assert "the child hangs: no first step within 3 s (first_step_timeout)" in out
    (att,) = _record(tmp_path / "ck")["attempts"]
    assert att["category"] == "hang" and att["stacks"], att
    assert "time.sleep" in Path(att["stacks"]).read_text() or "stuck.py" in Path(att["stacks"]).read_text()
