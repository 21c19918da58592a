"""What goes wrong while training runs on is shown, never swallowed: zero-code checkpointing that
turns itself off, background saves that fail. ``smartckpt run`` says it in a line, in its status
line while it lasts, in its exit summary and in the run record; ``smartckpt inspect`` lists it from
the journal. Real scripts under a real ``smartckpt run``; the failures are the user's own code
raising (a loader's ``state_dict``, a registered object's ``state_dict``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from smartckpt_cli.hooks import _smartckpt_protocol as proto

from smartckpt_cli.supervise.runstate import RunState, trouble_text

LOADER_SCRIPT = """
import time, torch, smartckpt_cli
from torch.utils.data import DataLoader, TensorDataset

class Loader(DataLoader):
    # a stateful loader (torchdata's StatefulDataLoader shape) whose state_dict fails from its 3rd call
    calls = 0
    def state_dict(self):
        Loader.calls += 1
        if Loader.calls >= 3:
            raise RuntimeError("the sampler's state is gone")
        return {"calls": Loader.calls}
    def load_state_dict(self, state):
        pass

torch.manual_seed(0)
model = torch.nn.Linear(6, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = Loader(TensorDataset(torch.randn(64, 6)), batch_size=4)
step = smartckpt_cli.start_step()
while step < 40:
    for (x,) in loader:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        step += 1
        time.sleep(0.1)
        if step >= 40:
            break
print("trained to", step, flush=True)
"""

FLAKY_SCRIPT = """
import time, torch, smartckpt_cli as sc

class Stats:
    # a user object whose state_dict() raises for a while: neither an OSError nor smartckpt's own
    def __init__(self):
        self.broken, self.value = False, 0
    def state_dict(self):
        if self.broken:
            raise TypeError("state_dict of a user object raised")
        return {"value": self.value}
    def load_state_dict(self, state):
        self.value = state["value"]

torch.manual_seed(0)
model = torch.nn.Linear(6, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
stats = Stats()
mgr = sc.CheckpointManager("ck", every_steps=2)
mgr.register(model=model, optimizer=opt, stats=stats)
start = mgr.restore()
for step in range(start + 1, 51):
    stats.broken, stats.value = 6 <= step < 30, step
    opt.zero_grad()
    model(torch.randn(4, 6)).pow(2).mean().backward()
    opt.step()
    mgr.step(step)
    time.sleep(0.1)
print("trained to", step, "failures", len(mgr.close()), flush=True)
"""


def _run(tmp_path: Path, env: dict[str, str], script: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "train.py").write_text(script)
    return subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", *args, "train.py"],
        cwd=tmp_path, env={**env, "SMARTCKPT_LOG_EVERY": "0.5"}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def _inspect(tmp_path: Path, env: dict[str, str]) -> tuple[str, dict]:
    cmd = [sys.executable, "-m", "smartckpt_cli.cli.app", "inspect", "ck"]
    text = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    js = subprocess.run([*cmd, "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and js.returncode == 0, text.stderr + js.stderr
    return text.stdout + text.stderr, json.loads(js.stdout)


def _record(tmp_path: Path) -> dict:
    (path,) = (tmp_path / "ck" / "runs").glob("*.json")
    return json.loads(path.read_text())


def _status_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("smartckpt: attempt 0, restarts 0, step")]


def test_zero_code_turning_itself_off_is_said_everywhere(tmp_path: Path, child_env):
    run = _run(tmp_path, child_env, LOADER_SCRIPT, "--every", "3")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "trained to 40" in out  # the training went on to its end
    # the line, at once
    assert "zero-code checkpointing turned itself off at step" in out, out
    assert "RuntimeError: the sampler's state is gone" in out, out
    # the status line while it lasts, with the reason
    flagged = [ln for ln in _status_lines(out) if "PROBLEM: checkpointing OFF" in ln]
    assert flagged and any("the sampler's state is gone" in ln for ln in flagged), out
    # the heartbeat went on beating steps: the last status lines see the training's end
    steps = [int(re.search(r"step (\d+)", ln).group(1)) for ln in _status_lines(out)]
    assert max(steps) >= 35, out
    # the exit summary
    summary = [ln for ln in out.splitlines() if ln.startswith("smartckpt: during this run:")]
    assert summary and "trained without checkpoints from step" in summary[0], out
    # the run record
    off = _record(tmp_path)["attempts"][0]["checkpointing_off"]
    assert "RuntimeError: the sampler's state is gone" in off["why"] and off["step"] > 0, off
    # inspect, from the journal
    text, js = _inspect(tmp_path, child_env)
    assert f"zero-code checkpointing turned itself off at step {off['step']}" in text, text
    assert js["checkpointing_off"] and js["checkpointing_off"][0]["step"] == off["step"], js


def test_failing_background_saves_show_in_the_status_line_summary_record_and_inspect(
    tmp_path: Path, child_env
):
    run = _run(tmp_path, child_env, FLAKY_SCRIPT)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    done = next(ln for ln in out.splitlines() if ln.startswith("trained to"))
    assert done.startswith("trained to 50 failures "), out  # the loop never saw an exception
    failures = int(done.split()[-1])
    assert failures >= 5, out
    assert "attempt 0: background saves fail (save of step" in out, out
    lines = _status_lines(out)
    failing = [i for i, ln in enumerate(lines) if "PROBLEM: saves failing" in ln]
    assert failing, out
    assert any("TypeError: state_dict of a user object raised" in lines[i] for i in failing), out
    # saves work again after step 30: a later status line no longer shows the problem
    later = [ln for ln in lines[failing[-1] + 1 :] if int(re.search(r"step (\d+)", ln).group(1)) > 32]
    assert later and all("PROBLEM" not in ln for ln in later), out
    summary = [ln for ln in out.splitlines() if ln.startswith("smartckpt: during this run:")]
    assert summary and f"{failures} background save(s) failed" in summary[0], out
    rec = _record(tmp_path)["attempts"][0]["save_failures"]
    assert rec["count"] == failures and "TypeError" in rec["last"], rec
    text, js = _inspect(tmp_path, child_env)
    assert f"{failures} failed save(s)" in text, text
    assert len(js["save_failures"]) == failures, js


def test_trouble_flags_travel_in_the_heartbeat_and_clear(tmp_path: Path):
    w = proto.HeartbeatWriter(str(tmp_path))
    w_pid = os.getpid()
    path = proto.heartbeat_path(str(tmp_path), w_pid)
    w.beat(step=3, trouble=(proto.SAVE_FAILING, True))
    w.beat(trouble=(proto.IO_FAILING, True))
    beat = proto.read_heartbeat(path, w_pid)
    assert beat is not None and beat.step == 3 and beat.trouble == proto.SAVE_FAILING | proto.IO_FAILING
    st = RunState(trouble=beat.trouble, trouble_detail={proto.IO_FAILING: "trace: ENOSPC"})
    assert trouble_text(st) == "saves failing; writes failing (trace: ENOSPC)"
    w.beat(step=4, trouble=(proto.SAVE_FAILING, False))
    beat = proto.read_heartbeat(path, w_pid)
    assert beat is not None and beat.trouble == proto.IO_FAILING and beat.step == 4
    w.close()


WARMUP_SCRIPT = """
import os, signal, time, torch, smartckpt_cli as sc

torch.manual_seed(0)
model = torch.nn.Linear(6, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
# a warm-up step before the script's own manager exists (as a benchmark's model builder does):
# zero-code mode arms here and stands down when the manager is built
model(torch.randn(4, 6)).pow(2).mean().backward()
opt.step()
opt.zero_grad()
time.sleep(1.5)  # building data, say: the supervisor reads the child's report meanwhile
mgr = sc.CheckpointManager("ck", every_steps=5)
mgr.register(model=model, optimizer=opt)
start = mgr.restore()
print("start", start, flush=True)
for step in range(start + 1, 31):
    opt.zero_grad()
    model(torch.randn(4, 6)).pow(2).mean().backward()
    opt.step()
    mgr.step(step)
    time.sleep(0.02)
    if step == 23 and os.environ.get("SMARTCKPT_ATTEMPT") == "0":
        mgr.wait()
        os.kill(os.getpid(), signal.SIGKILL)
mgr.close()
"""


def test_a_warm_up_step_before_the_scripts_manager_does_not_pass_for_a_start_at_zero(
    tmp_path: Path, child_env
):
    env = {**child_env, "SMARTCKPT_RESTART_BACKOFF": "0.1"}
    run = _run(tmp_path, env, WARMUP_SCRIPT)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    starts = [int(ln.split()[1]) for ln in run.stdout.splitlines() if ln.startswith("start ")]
    assert starts[0] == 0 and starts[1] >= 20, out
    second = _record(tmp_path)["attempts"][1]
    # the record says where the script really began, not the zero-code guess of the warm-up step
    assert second["start_step"] == starts[1] and second["restored_from"] in ("disk", "ram"), second
    resumed = next(ln for ln in out.splitlines() if f"attempt 1: resumed at step {starts[1]}" in ln)
    if "attempt 1 began again at step 0" in out:  # said while the warm-up step was the only one
        assert "not step 0 as said above" in resumed, out  # (warnings go to stderr: no order here)
    summary = next(ln for ln in run.stdout.splitlines() if ln.startswith("smartckpt:   attempt 1:"))
    assert f"resumed at step {starts[1]}" in summary, out
