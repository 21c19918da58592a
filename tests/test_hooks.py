"""The injected hooks (hooks/sitecustomize.py, smartckpt_cli/agent/runtime.py) in real child processes,
started with the environment ``smartckpt run`` gives them: the hooks directory first on PYTHONPATH,
SMARTCKPT_RUN_DIR, SMARTCKPT_DIR, SMARTCKPT_EVERY_STEPS."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from smartckpt_cli.hooks import _smartckpt_protocol as proto

from tests._state import assert_same_state

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "hooks"
SCRIPT = ROOT / "tests" / "scripts" / "zero_code_train.py"

pytestmark = pytest.mark.slow


def _env(child_env: dict[str, str], run_dir: Path | None, *path: Path, **extra: str) -> dict[str, str]:
    env = dict(child_env)
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in path), str(HOOKS), str(ROOT)])
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        env[proto.ENV_RUN_DIR] = str(run_dir)
        env[proto.ENV_HOOKS_DIR] = str(HOOKS)
    env.update(extra)
    return env


def _run(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _files(run_dir: Path, prefix: str) -> list[Path]:
    return sorted(p for p in run_dir.glob(f"{prefix}.*") if ".tmp" not in p.name)


PROBE = textwrap.dedent(
    """
    import sys, sitecustomize
    state = getattr(sys, "_smartckpt_hooks", None)
    watchers = sum(type(f).__name__ == "_TorchWatcher" for f in sys.meta_path)
    print("OURS", sitecustomize.__file__, "ACTIVE", bool(state and state.get("active")), "WATCHERS", watchers)
    """
)


def _user_sitecustomize(d: Path, marker: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(
        f"print({marker!r}, flush=True)\nimport sys\nsys.user_site_ran = True\n"
    )
    return d


# ------------------------------------------------------------------ sitecustomize


def test_user_sitecustomize_still_runs(tmp_path, python, child_env):
    user = _user_sitecustomize(tmp_path / "user", "USER-SITECUSTOMIZE")
    run_dir = tmp_path / "run"
    env = _env(child_env, run_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(HOOKS), str(user), str(ROOT)])
    res = _run([python, "-c", PROBE + "print('USER', sys.user_site_ran)"], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("USER-SITECUSTOMIZE") == 1
    assert "USER True" in res.stdout
    assert f"OURS {HOOKS / 'sitecustomize.py'} ACTIVE True WATCHERS 1" in res.stdout
    (hooks_file,) = _files(run_dir, "hooks")
    info = json.loads(hooks_file.read_text())
    assert info["python"] and info["argv"] == ["-c"] and info["pid"] == int(hooks_file.name.split(".")[1])
    assert str(HOOKS) in env["PYTHONPATH"].split(os.pathsep)  # stays on the path for children


def test_distribution_sitecustomize_is_chained(tmp_path, child_env):
    """A sitecustomize in the interpreter's own site-packages (the distribution's place)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    _user_sitecustomize(Path(purelib), "DIST-SITECUSTOMIZE")
    run_dir = tmp_path / "run"
    env = _env(child_env, run_dir)
    env["PYTHONPATH"] = str(HOOKS)
    res = _run([vpy, "-c", PROBE], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("DIST-SITECUSTOMIZE") == 1
    assert "ACTIVE True WATCHERS 1" in res.stdout
    assert len(_files(run_dir, "hooks")) == 1


def test_hooks_run_once_per_process_and_again_in_children(tmp_path, python, child_env):
    """Two copies of the hooks on the path (two installs): one set of hooks, the user's
    sitecustomize still runs once; a subprocess (a torchrun worker) runs the hooks again."""
    copies = []
    for name in ("a", "b"):
        d = tmp_path / name / "hooks"
        shutil.copytree(HOOKS, d, ignore=shutil.ignore_patterns("__pycache__"))
        copies.append(d)
    user = _user_sitecustomize(tmp_path / "user", "USER-SITECUSTOMIZE")
    run_dir = tmp_path / "run"
    env = _env(child_env, run_dir)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, copies), str(user), str(ROOT)])
    code = PROBE + textwrap.dedent(
        """
        import subprocess
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        """
    )
    res = _run([python, "-c", code], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("USER-SITECUSTOMIZE") == 2  # once here, once in the subprocess
    assert "ACTIVE True WATCHERS 1" in res.stdout
    assert len(_files(run_dir, "hooks")) == 2


def test_excepthook_wrapped_once(tmp_path, python, child_env):
    copies = []
    for name in ("a", "b"):
        d = tmp_path / name / "hooks"
        shutil.copytree(HOOKS, d, ignore=shutil.ignore_patterns("__pycache__"))
        copies.append(d)
    env = _env(child_env, tmp_path / "run")
    env["PYTHONPATH"] = os.pathsep.join(map(str, copies))
    code = (
        "import sys\n"
        "cells = [c.cell_contents for c in sys.excepthook.__closure__]\n"
        "print('WRAPS_BUILTIN', sys.__excepthook__ in cells)\n"
    )
    res = _run([python, "-c", code], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "WRAPS_BUILTIN True" in res.stdout  # wraps the interpreter's hook, not a second wrapper


def test_no_hooks_file_without_run_dir(tmp_path, python, child_env):
    env = _env(child_env, None)
    res = _run([python, "-c", PROBE + "import os; print('FILES', os.listdir('.'))"], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "ACTIVE False WATCHERS 0" in res.stdout
    assert "FILES []" in res.stdout


@pytest.mark.parametrize("flag", ["-I", "-E", "-S"])
def test_isolated_interpreter_does_not_load_hooks(tmp_path, python, child_env, flag):
    """What `smartckpt run` turns into its warning: no hooks.<pid>.json appears."""
    run_dir = tmp_path / "run"
    env = _env(child_env, run_dir)
    res = _run([python, flag, "-c", "print('ran')"], env, tmp_path)
    assert res.returncode == 0 and "ran" in res.stdout, res.stderr
    assert _files(run_dir, "hooks") == []
    res = _run([python, "-c", "print('ran')"], env, tmp_path)  # the same without the flag: loaded
    assert len(_files(run_dir, "hooks")) == 1


def test_broken_run_dir_reports_once_and_runs_on(tmp_path, python, child_env):
    env = _env(child_env, None)
    env[proto.ENV_RUN_DIR] = str(tmp_path / "missing" / "run")
    res = _run([python, "-c", "import torch; print('trained')"], env, tmp_path)
    assert res.returncode == 0 and "trained" in res.stdout
    assert res.stderr.count("smartckpt: hooks disabled") == 1, res.stderr


# ------------------------------------------------------------------ errors and stacks


@pytest.mark.parametrize(
    ("source", "etype", "message"),
    [
        ("x = (\n", "SyntaxError", "was never closed"),
        ("import no_such_module_smartckpt\n", "ModuleNotFoundError", "no_such_module_smartckpt"),
        ("def f():\n    raise ValueError('bad value 42')\nf()\n", "ValueError", "bad value 42"),
    ],
)
def test_error_file_on_uncaught_exception(tmp_path, python, child_env, source, etype, message):
    run_dir = tmp_path / "run"
    (tmp_path / "train.py").write_text(source)
    res = _run([python, "train.py"], _env(child_env, run_dir), tmp_path)
    assert res.returncode == 1
    assert etype in res.stderr  # the usual traceback still printed
    (err_file,) = _files(run_dir, "error")
    (hooks_file,) = _files(run_dir, "hooks")
    assert err_file.name.split(".")[1] == hooks_file.name.split(".")[1]
    err = json.loads(err_file.read_text())
    assert err["type"] == etype and message in err["message"]
    assert etype in err["traceback"] and isinstance(err["time"], float)


def test_error_file_from_a_thread(tmp_path, python, child_env):
    run_dir = tmp_path / "run"
    code = (
        "import threading\nt = threading.Thread(target=lambda: 1 / 0, name='loader'); t.start(); t.join()\n"
    )
    res = _run([python, "-c", code], _env(child_env, run_dir), tmp_path)
    assert res.returncode == 0  # a thread's exception does not end the process...
    (err_file,) = _files(run_dir, "error")
    err = json.loads(err_file.read_text())
    assert err["type"] == "ZeroDivisionError" and err["thread"] == "loader"  # ...and says where it came from


def test_sigquit_dumps_stacks(tmp_path, python, child_env):
    run_dir = tmp_path / "run"
    code = "import time\ndef stuck_in_the_loop():\n    print('ready', flush=True)\n    time.sleep(60)\nstuck_in_the_loop()\n"
    proc = subprocess.Popen(
        [python, "-c", code], env=_env(child_env, run_dir), cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(getattr(signal, proto.STACK_SIGNAL_NAME))
        path = Path(proto.stacks_path(str(run_dir), proc.pid))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "stuck_in_the_loop" not in (
            path.read_text() if path.exists() else ""
        ):
            time.sleep(0.1)
        text = path.read_text()
        assert "stuck_in_the_loop" in text and "thread" in text.lower()
        assert proc.poll() is None  # dumping does not end the process; the supervisor kills it
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------ zero-code mode

TOTAL = 30
EVERY = 5


def _trace(text: str) -> dict[int, str]:
    out = {}
    for ln in text.splitlines():
        if ln.startswith("step "):
            _, n, _, hexloss = ln.split()
            out[int(n)] = hexloss
    return out


def _zero_code_env(child_env: dict[str, str], tmp: Path) -> dict[str, str]:
    return _env(
        child_env,
        tmp / "run",
        SMARTCKPT_DIR=str(tmp / "store"),
        SMARTCKPT_EVERY_STEPS=str(EVERY),
        SMARTCKPT_RUN_ID="test",
        SMARTCKPT_ATTEMPT="0",
    )


_REFERENCES: dict[tuple[str, ...], tuple[dict[int, str], dict]] = {}


def _plain_run(tmp_path_factory, *flags: str):
    """The same script without smartckpt at all (no hooks on the path), once per set of flags."""
    if flags not in _REFERENCES:
        d = tmp_path_factory.mktemp("plain")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
        env["PYTHONPATH"] = str(ROOT)
        res = _run(
            [sys.executable, str(SCRIPT), "--total", str(TOTAL), "--out", str(d / "final.pt"), *flags], env, d
        )
        assert res.returncode == 0, res.stderr
        assert "start 0" in res.stdout
        _REFERENCES[flags] = (_trace(res.stdout), torch.load(d / "final.pt", weights_only=True))
    return _REFERENCES[flags]


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory):
    return _plain_run(tmp_path_factory)


def _run_until_step(args: list[str], env: dict[str, str], cwd: Path, kill_at: int) -> tuple[str, int]:
    proc = subprocess.Popen(
        args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None
    lines = []
    for ln in proc.stdout:
        lines.append(ln)
        if ln.startswith(f"step {kill_at} "):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    return "".join(lines), proc.returncode


KILL_AT = random.Random(time.time_ns()).randrange(13, TOTAL - 3)  # past two of the --amp overflows


@pytest.mark.parametrize("flags", [(), ("--amp",)], ids=["plain", "gradscaler-skipping-steps"])
def test_zero_code_sigkill_and_resume_is_bit_exact(tmp_path, tmp_path_factory, python, child_env, flags):
    ref_trace, ref_state = _plain_run(tmp_path_factory, *flags)
    env = _zero_code_env(child_env, tmp_path)
    args = [python, str(SCRIPT), "--total", str(TOTAL), "--out", str(tmp_path / "final.pt"), "--step-time", "0.05", *flags]  # fmt: skip
    out, rc = _run_until_step(args, env, tmp_path, KILL_AT)
    assert rc == -signal.SIGKILL, f"not killed at step {KILL_AT}: {out[-300:]}"
    first = _trace(out)
    assert first and all(first[n] == ref_trace[n] for n in first), "the hooks changed the training"

    env[proto.ENV_ATTEMPT] = "1"
    res = _run(args, env, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    start = int(res.stdout.split("start ", 1)[1].split()[0])
    assert 0 < start <= KILL_AT and start % EVERY == 0, (start, KILL_AT)
    assert start >= (KILL_AT // EVERY - 1) * EVERY  # at most the save in flight is lost
    trace = _trace(res.stdout)
    assert min(trace) == start + 1 and max(trace) == TOTAL
    assert all(trace[n] == ref_trace[n] for n in trace), "loss trace after the resume differs"
    assert_same_state(torch.load(tmp_path / "final.pt", weights_only=True), ref_state)

    # The heartbeat of the finished run, and its final checkpoint.
    beats = [
        proto.read_heartbeat(str(p), int(p.name.split(".")[1])) for p in _files(tmp_path / "run", "heartbeat")
    ]
    last = max((b for b in beats if b is not None), key=lambda b: b.time)
    assert last.state == proto.DONE and last.step == TOTAL and last.committed_step >= start
    journal = [json.loads(ln) for ln in (tmp_path / "store" / "journal.jsonl").read_text().splitlines()]
    commits = [r for r in journal if r["event"] == "commit"]
    assert commits[-1]["step"] == TOTAL and commits[-1]["reason"] == "final"
    checks = [r for r in journal if r["event"] == "resume_check"]
    assert [(c["step"], c["verdict"]) for c in checks] == [(start + 1, "exact")], checks

    # Started again after it finished: resumes at the end and trains no further step.
    res = _run(args, env, tmp_path)
    assert res.returncode == 0 and f"start {TOTAL}" in res.stdout and "step " not in res.stdout
    assert_same_state(torch.load(tmp_path / "final.pt", weights_only=True), ref_state)


JOLT_AT = 14  # loop index whose optimizer step runs at 400x the learning rate (printed step 15)


def test_zero_code_precursor_save_holds_the_step_before_the_update(
    tmp_path, tmp_path_factory, python, child_env
):
    """The planned update surges in the jolt's optimizer pre-hook: zero-code mode saves step
    JOLT_AT there, before the update, with that boundary's RNG, BatchNorm statistics and data
    position; a run SIGKILLed right after resumes from it and trains on bit-exactly."""
    ref_trace, ref_state = _plain_run(tmp_path_factory, "--jolt-at", str(JOLT_AT))
    env = _zero_code_env(child_env, tmp_path)
    del env["SMARTCKPT_EVERY_STEPS"]  # the default policy; signals every step; no interval save
    env.update(SMARTCKPT_EVAL_EVERY="1", SMARTCKPT_MIN_INTERVAL="0", SMARTCKPT_MAX_INTERVAL="100000")
    args = [python, str(SCRIPT), "--total", str(TOTAL), "--out", str(tmp_path / "final.pt"), "--step-time", "0.5", "--jolt-at", str(JOLT_AT)]  # fmt: skip
    # Killed after the jolt's step: the next pre-hook may re-arm the alarm but cannot fire it.
    out, rc = _run_until_step(args, env, tmp_path, JOLT_AT + 1)
    assert rc == -signal.SIGKILL, out[-300:]
    journal = [json.loads(ln) for ln in (tmp_path / "store" / "journal.jsonl").read_text().splitlines()]
    commits = [(r["step"], r["reason"]) for r in journal if r["event"] == "commit"]
    assert (JOLT_AT, "precursor: planned update") in commits and max(s for s, _ in commits) == JOLT_AT

    env[proto.ENV_ATTEMPT] = "1"
    res = _run(args, env, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"start {JOLT_AT}\n" in res.stdout
    trace = _trace(res.stdout)
    assert min(trace) == JOLT_AT + 1 and all(trace[n] == ref_trace[n] for n in trace)
    journal = [json.loads(ln) for ln in (tmp_path / "store" / "journal.jsonl").read_text().splitlines()]
    assert [(c["step"], c["verdict"]) for c in journal if c["event"] == "resume_check"] == [
        (JOLT_AT + 1, "exact")
    ]
    assert_same_state(torch.load(tmp_path / "final.pt", weights_only=True), ref_state)


GAS = """
import torch, smartckpt_cli
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = smartckpt_cli.start_step()
for step in range(start, 6):
    total = 0.0
    for micro in range(4):                     # gradient accumulation: loss / 4, four times
        loss = model(torch.randn(8, 4)).pow(2).mean() / 4
        loss.backward()
        total += loss.item()
    opt.step(); opt.zero_grad()
    print(f"step {step + 1} {total!r}", flush=True)
"""


def test_zero_code_loss_under_gradient_accumulation_is_the_steps_loss(tmp_path, python, child_env):
    """What the trigger, the trace and the status line read is the step's loss: the sum of the
    losses backward() ran on in the step, not the last micro-step's share."""
    script = tmp_path / "gas.py"
    script.write_text(GAS)
    env = _zero_code_env(child_env, tmp_path)
    env.update(SMARTCKPT_EVAL_EVERY="1", SMARTCKPT_EVERY_STEPS="100")
    res = _run([python, str(script)], env, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    total = {
        int(ln.split()[1]): float(ln.split()[2]) for ln in res.stdout.splitlines() if ln.startswith("step ")
    }
    (trace,) = (tmp_path / "store" / "traces").glob("*.csv")
    lines = trace.read_text().splitlines()
    head = lines[0].split(",")
    rows = [dict(zip(head, ln.split(","), strict=True)) for ln in lines[1:]]
    assert len(rows) >= 3
    for row in rows:
        assert float(row["raw_loss"]) == pytest.approx(total[int(row["step"])], rel=1e-5), row


def test_start_step_outside_smartckpt_run_is_zero(tmp_path, python, child_env):
    env = _env(child_env, None, SMARTCKPT_DIR=str(tmp_path / "store"))
    res = _run([python, str(SCRIPT), "--total", "3"], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "start 0" in res.stdout and not (tmp_path / "store").exists()


def test_script_with_its_own_manager_is_not_instrumented_twice(tmp_path, python, child_env):
    env = _env(child_env, tmp_path / "run", SMARTCKPT_DIR=str(tmp_path / "zero-code-store"))
    store = tmp_path / "own-store"
    args = [
        python,
        "-m",
        "smartckpt_cli.ops.demo_train",
        "--dir",
        str(store),
        "--steps",
        "12",
        "--save-every",
        "5",
    ]
    res = _run(args, env, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "zero-code" not in res.stderr
    assert not (tmp_path / "zero-code-store").exists()
    journal = [json.loads(ln) for ln in (store / "journal.jsonl").read_text().splitlines()]
    assert [r["step"] for r in journal if r["event"] == "commit"] == [5, 10]  # the script's own saves only
    (hb,) = _files(tmp_path / "run", "heartbeat")
    beat = proto.read_heartbeat(str(hb), int(hb.name.split(".")[1]))
    assert (
        beat is not None and beat.step == 12 and beat.committed_step in (5, 10) and beat.state == proto.DONE
    )


def test_zero_code_sigterm_saves_and_resumes_bit_exact(tmp_path, python, child_env, plain_reference):
    """SIGTERM (SLURM's warning, scancel): the manager's preemption handling takes a blocking
    checkpoint at the next step boundary and the process ends by the signal; the rerun resumes
    from exactly that step."""
    ref_trace, ref_state = plain_reference
    env = _zero_code_env(child_env, tmp_path)
    env["SMARTCKPT_EVERY_STEPS"] = "1000"  # no scheduled save: only the preemption one
    args = [
        python,
        str(SCRIPT),
        "--total",
        str(TOTAL),
        "--out",
        str(tmp_path / "final.pt"),
        "--step-time",
        "0.05",
    ]
    proc = subprocess.Popen(
        args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    for ln in proc.stdout:
        if ln.startswith("step 7 "):
            proc.send_signal(signal.SIGTERM)
            break
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, err[-2000:]
    last = max(_trace(rest) or {7: ""})
    journal = [json.loads(ln) for ln in (tmp_path / "store" / "journal.jsonl").read_text().splitlines()]
    commits = [r for r in journal if r["event"] == "commit"]
    assert len(commits) == 1 and commits[0]["reason"].startswith("preemption") and commits[0]["step"] == last

    env[proto.ENV_ATTEMPT] = "1"
    res = _run(args, env, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"start {last}" in res.stdout
    trace = _trace(res.stdout)
    assert all(trace[n] == ref_trace[n] for n in trace)
    journal = [json.loads(ln) for ln in (tmp_path / "store" / "journal.jsonl").read_text().splitlines()]
    # zero-code saved the preemption checkpoint in the pre-hook of the next step: it holds that
    # step's values, so even this resume is checked
    assert [(c["step"], c["verdict"]) for c in journal if c["event"] == "resume_check"] == [
        (last + 1, "exact")
    ]
    assert_same_state(torch.load(tmp_path / "final.pt", weights_only=True), ref_state)


def test_processes_that_do_not_train_stay_untouched(tmp_path, python, child_env):
    """torch imported, a backward pass, no optimizer step (a DataLoader worker, the torchrun
    agent): hooks live, but no heartbeat, no manager, no store."""
    env = _zero_code_env(child_env, tmp_path)
    code = "import torch\nm = torch.nn.Linear(2, 2)\nm(torch.randn(3, 2)).sum().backward()\nprint('ok')\n"
    res = _run([python, "-c", code], env, tmp_path)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
    assert len(_files(tmp_path / "run", "hooks")) == 1
    assert _files(tmp_path / "run", "heartbeat") == []
    assert not (tmp_path / "store").exists()


def test_several_ranks_only_beat(tmp_path, python, child_env):
    """Under WORLD_SIZE > 1 without an initialised torch.distributed, zero-code checkpointing stands
    down (no coordination, so no shared store) but the heartbeat still counts steps."""
    env = _zero_code_env(child_env, tmp_path)
    env.update(WORLD_SIZE="2", RANK="1")
    res = _run([python, str(SCRIPT), "--total", "6"], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "start 0" in res.stdout and "only the heartbeat runs" in res.stderr
    assert not (tmp_path / "store").exists()
    (hb,) = _files(tmp_path / "run", "heartbeat")
    beat = proto.read_heartbeat(str(hb), int(hb.name.split(".")[1]))
    assert beat is not None and beat.step == 6 and beat.rank == 1 and beat.state == proto.DONE


def test_internal_failure_reports_once_and_training_runs_on(tmp_path, python, child_env):
    """The store cannot be created: one line on stderr, and the script trains to the end unhooked."""
    (tmp_path / "a-file").write_text("")
    env = _zero_code_env(child_env, tmp_path)
    env["SMARTCKPT_DIR"] = str(tmp_path / "a-file" / "store")
    res = _run([python, str(SCRIPT), "--total", "8", "--out", str(tmp_path / "final.pt")], env, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "start 0" in res.stdout and "done 8" in res.stdout
    assert res.stderr.count("smartckpt: zero-code checkpointing off") == 1, res.stderr
    assert "Traceback" not in res.stderr
