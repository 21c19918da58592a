"""The loop shapes of the README's "Your loop", under ``smartckpt run`` with a real SIGKILL: what the
run record and the output say (where each attempt really began, the resume check's verdict), and
that the documented change makes the resume bit-exact.

- ``tests/scripts/nanogpt_shaped.py``: ``while True`` with its own counter, the next batch fetched
  inside gradient accumulation before the optimizer step, an evaluation under ``no_grad`` from the
  same RNG, a GradScaler, its own ``torch.save``. Unmodified (it begins again at step 0, and says
  so), with only ``start_step()`` (``differs``), with ``carry()`` as well (``exact``, bit for bit).
- ``tests/scripts/rnn_train.py``: an LSTM whose hidden state runs from batch to batch.
- a hand-written SGD update (no ``torch.optim``), ``start_step()`` before the model exists, a
  finished ``while True`` job started again, a child that lingers after its DONE heartbeat, a
  progress bar's open line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._output import child_lines
from tests._state import assert_same_state

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "tests" / "scripts" / "nanogpt_shaped.py"
RNN = ROOT / "tests" / "scripts" / "rnn_train.py"
KILL_AT = 23  # iteration (0-based) after which nanogpt_shaped kills itself: step 24; newest checkpoint 20


def _env(child_env: dict[str, str], **extra: str) -> dict[str, str]:
    # These runs resume from a disk checkpoint of a known step; the RAM tier (on by default
    # under smartckpt run, tests/test_ramtier.py) would resume from its newer snapshot instead.
    return {**child_env, "SMARTCKPT_RESTART_BACKOFF": "0.1", "SMARTCKPT_RAM": "false", **extra}


def _smartckpt(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", *args],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )  # fmt: skip
    return proc.returncode, proc.stdout


def _record(store: Path) -> dict[str, Any]:
    (path,) = (store / "runs").glob("*.json")
    return json.loads(path.read_text())


def _trace(out: str, word: str = "iter") -> dict[int, str]:
    return {int(ln.split()[1]): ln.split()[3] for ln in child_lines(out) if ln.startswith(f"{word} ")}


def _reference(
    script: Path, tmp: Path, child_env: dict[str, str], *flags: str
) -> tuple[dict[int, str], dict]:
    """The same script uninterrupted, without smartckpt run (start_step() is 0, carry() hands
    its arguments back)."""
    d = tmp / "ref"
    d.mkdir()
    res = subprocess.run(
        [sys.executable, str(script), *flags, "--out", str(d / "final.pt")],
        cwd=d, env=child_env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return _trace(res.stdout, "iter" if script == NANO else "step"), torch.load(
        d / "final.pt", weights_only=False
    )


def _killed_run(
    script: Path, tmp: Path, child_env: dict[str, str], *flags: str, kill_at: int
) -> tuple[str, dict]:
    rc, out = _smartckpt(
        ["run", "--dir", "ck", "--every", "5", str(script), *flags, "--kill-at", str(kill_at), "--out", "final.pt"],
        tmp, _env(child_env),
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    rec = _record(tmp / "ck")
    assert rec["restarts"] == 1 and rec["attempts"][0]["cause"] == "killed by SIGKILL", out[-3000:]
    return out, rec


def test_nanogpt_shaped_with_the_readme_change_resumes_bit_exact(tmp_path, child_env):
    ref_trace, ref_state = _reference(NANO, tmp_path, child_env, "--carry")
    out, rec = _killed_run(NANO, tmp_path, child_env, "--carry", kill_at=KILL_AT)
    first, second = rec["attempts"]
    assert first["start_step"] == 0 and first["max_step"] == KILL_AT + 1 and first["restart_from"] == 20
    assert second["start_step"] == 20 and second["restored_from"] == "disk", out[-3000:]
    check = second["resume_check"]
    assert check["step"] == 21 and check["verdict"] == "exact" and check["got"] == check["expected"]
    assert "attempt 1: resumed at step 20 (restored from disk)" in out
    assert "resume check at step 21: exact" in out and "not exact" not in out
    resumed = out.split("attempt 1: started", 1)[1]
    trace = _trace(resumed)
    assert min(trace) == 20 and trace == {n: ref_trace[n] for n in trace}
    final = torch.load(tmp_path / "final.pt", weights_only=False)
    assert final["best_val_loss"] == ref_state["best_val_loss"]
    assert_same_state(final, ref_state)


def test_nanogpt_shaped_with_only_start_step_is_reported_differs(tmp_path, child_env):
    out, rec = _killed_run(NANO, tmp_path, child_env, "--start-step", kill_at=KILL_AT)
    second = rec["attempts"][1]
    assert second["start_step"] == 20 and second["restored_from"] == "disk"
    check = second["resume_check"]
    assert check["step"] == 21 and check["verdict"] == "differs", check
    assert check["got"]["loss"] != check["expected"]["loss"]
    (line,) = [ln for ln in out.splitlines() if "the resume is not exact" in ln]
    assert "step 21" in line and "a batch fetched before the optimizer step" in line and '"Your loop"' in line
    assert "resume check at step 21: differs" in out  # the summary
    rc, listing = _smartckpt(["inspect", "ck", "--json"], tmp_path, child_env)
    assert rc == 0 and [c["verdict"] for c in json.loads(listing)["resume_checks"]] == ["differs"]


def test_unmodified_nanogpt_shaped_began_again_and_the_record_says_so(tmp_path, child_env):
    out, rec = _killed_run(NANO, tmp_path, child_env, kill_at=KILL_AT)
    first, second = rec["attempts"]
    # It never calls start_step(): the restart trained every step again, all of it lost.
    assert second["start_step"] == 0 and second["restored_from"] is None and second["newest_checkpoint"] == 20
    assert second["began_again"] == "nanogpt_shaped.py does not call smartckpt_cli.start_step()"
    assert first["restart_from"] == 0 and first["steps_lost"] == first["max_step"] == KILL_AT + 1
    assert rec["steps_lost"] == KILL_AT + 1
    assert "restarting from step 0" in out
    (line,) = [
        ln for ln in out.splitlines() if "began again at step 0, not at the checkpoint of step 20" in ln
    ]
    assert "does not call smartckpt_cli.start_step()" in line and "Fix:" in line and "start_step()" in line
    assert "None" not in "\n".join(ln for ln in out.splitlines() if ln.startswith("smartckpt:"))
    # inspect tells the two trainings apart; a resume loads the newest one's
    rc, listing = _smartckpt(["inspect", "ck", "--json"], tmp_path, child_env)
    data = json.loads(listing)
    assert rc == 0 and [x["line"] for x in data["lineages"]] == ["A", "B"]
    assert {r["line"] for r in data["checkpoints"] if r["restore_target"]} == {"B"}
    rc, table = _smartckpt(["inspect", "ck"], tmp_path, child_env)
    assert "lineage A:" in table and "lineage B:" in table and "a resume never falls back" in table
    # plot's restart agrees with the record
    rc, js = _smartckpt(["plot", "ck", "--json"], tmp_path, child_env)
    (restart,) = json.loads(js)["restarts"]
    assert rc == 0 and restart["steps_lost"] == first["steps_lost"] and restart["restart_from"] == 0


@pytest.mark.parametrize("carry", [True, False], ids=["carry", "no-carry"])
def test_rnn_hidden_state_exact_with_carry_differs_without(tmp_path, child_env, carry):
    flags = ("--carry",) if carry else ()
    ref_trace, ref_state = _reference(RNN, tmp_path, child_env, *flags)
    out, rec = _killed_run(RNN, tmp_path, child_env, *flags, kill_at=13)
    second = rec["attempts"][1]
    assert second["start_step"] == 10 and second["restored_from"] == "disk", out[
        -2000:
    ]  # mid-epoch (7 a epoch)
    assert second["resume_check"]["step"] == 11
    final = torch.load(tmp_path / "final.pt", weights_only=False)
    if carry:
        assert second["resume_check"]["verdict"] == "exact"
        assert_same_state(final, ref_state)
        trace = _trace(out.split("attempt 1: started", 1)[1], "step")
        assert trace == {n: ref_trace[n] for n in trace}
    else:
        assert second["resume_check"]["verdict"] == "differs"
        assert "a hidden state carried across steps" in out
        assert not torch.equal(final["model"]["out.weight"], ref_state["model"]["out.weight"])


def test_start_step_before_the_model_exists_says_one_thing(tmp_path, child_env):
    out, rec = _killed_run(NANO, tmp_path, child_env, "--early-start-step", kill_at=KILL_AT)
    lines = [
        ln for ln in out.splitlines() if "start_step()" in ln and not ln.startswith("smartckpt: attempt")
    ]
    assert (
        len([ln for ln in lines if "was called before any optimizer exists" in ln]) == 2
    )  # once per attempt
    assert "the loop does not call smartckpt_cli.start_step()" not in out
    second = rec["attempts"][1]
    assert (
        second["start_step"] == 0
        and "calls smartckpt_cli.start_step() before its optimizer exists" in second["began_again"]
    )


def test_a_finished_while_true_job_started_again_trains_no_further(tmp_path, child_env):
    args = [
        "run",
        "--dir",
        "ck",
        "--every",
        "5",
        str(NANO),
        "--carry",
        "--max-iters",
        "12",
        "--out",
        "final.pt",
    ]
    rc, out = _smartckpt(args, tmp_path, _env(child_env))
    assert rc == 0 and "done 13" in out, out[-2000:]
    journal = (tmp_path / "ck" / "journal.jsonl").read_text()
    final = (tmp_path / "final.pt").read_bytes()
    rc, again = _smartckpt(args, tmp_path, _env(child_env))
    assert (
        rc == 0
        and "already finished" in again
        and "ended at step 13" in again
        and "--resume-finished" in again
    )
    assert "iter " not in again and "run record" not in again
    assert (tmp_path / "ck" / "journal.jsonl").read_text() == journal and (
        tmp_path / "final.pt"
    ).read_bytes() == final
    assert len(list((tmp_path / "ck" / "runs").glob("*.json"))) == 1
    rc, more = _smartckpt([*args[:1], "--resume-finished", *args[1:]], tmp_path, _env(child_env))
    assert rc == 0 and "attempt 0: resumed at step 13" in more and "done 14" in more  # as asked


HAND_SGD = """
import sys, time
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
for step in range(40):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.1)          # a hand-written SGD update, no torch.optim
    print(f"step {step + 1}", flush=True)
    time.sleep(0.05)
print("done", flush=True)
"""


def test_hand_written_sgd_is_told_at_once_and_the_commands_say_no_checkpoint(tmp_path, child_env):
    script = tmp_path / "lm.py"
    script.write_text(HAND_SGD)
    rc, out = _smartckpt(["run", "--dir", "ck", str(script)], tmp_path, _env(child_env))
    assert rc == 0 and "done" in out, out[-2000:]
    lines = out.splitlines()
    (at,) = [i for i, ln in enumerate(lines) if "no torch.optim optimizer has stepped" in ln]
    assert "zero-code checkpointing needs one" in lines[at] and "CheckpointManager" in lines[at]
    assert at < lines.index("step 10"), "said only at the end"
    rec = _record(tmp_path / "ck")
    assert rec["checkpoints_taken"] == 0 and rec["attempts"][0]["no_optimizer"] is True
    assert "no checkpoint: the training never stepped a torch.optim optimizer" in out
    for cmd in (["inspect", "ck"], ["verify", "ck"], ["plot", "ck", "--json"]):
        rc, said = _smartckpt(cmd, tmp_path, child_env)
        assert rc == 1, (cmd, said)
        assert "holds the records of 1 run(s) of `smartckpt run` (runs/) but no checkpoint" in said, said
        assert "never stepped a torch.optim optimizer" in said and "Traceback" not in said


LINGER = """
import atexit, time
import torch
import smartckpt_cli
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start = smartckpt_cli.start_step()
t0 = time.time()
step = start
while time.time() - t0 < 21:                     # past the supervisor's 20 s start-up grace
    model(torch.randn(8, 4)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    step += 1
    time.sleep(0.1)
atexit.register(time.sleep, 4)                   # after its DONE heartbeat, the process lingers
print("trained", step, flush=True)
"""


def test_a_child_that_lingers_after_training_is_not_taken_for_one_without_heartbeat(tmp_path, child_env):
    script = tmp_path / "linger.py"
    script.write_text(LINGER)
    rc, out = _smartckpt(["run", "--dir", "ck", "--every", "50", str(script)], tmp_path, _env(child_env))
    assert rc == 0 and "trained" in out, out[-2000:]
    assert "no heartbeat" not in out and "hooks are not live" not in out


BAR = """
import sys, time
sys.stdout.write("training:  45%|#####     | 45/100")   # a progress bar's line, left open
sys.stdout.flush()
time.sleep(3)
sys.stdout.write("\\r training: 100%|##########| 100/100\\n")
"""


def test_status_lines_start_on_a_line_of_their_own_in_a_log_file(tmp_path, child_env):
    script = tmp_path / "bar.py"
    script.write_text(BAR)
    log = tmp_path / "job.log"
    with open(log, "w") as f:  # as a SLURM log: stdout and stderr into one file
        subprocess.run(
            [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", str(script)],
            cwd=tmp_path, env=_env(child_env, SMARTCKPT_LOG_EVERY="1"), stdout=f, stderr=subprocess.STDOUT,
            timeout=60, check=True,
        )  # fmt: skip
    text = log.read_text()
    assert "smartckpt: attempt 0, restarts 0" in text, text
    assert "45/100smartckpt" not in text
    for ln in text.splitlines():
        assert "smartckpt:" not in ln or ln.startswith("smartckpt:"), ln


def test_resume_check_verdicts_in_the_run_record_of_a_zero_code_script(tmp_path, child_env):
    """The plain zero-code script (``for step in range(start_step(), total)``): exact."""
    script = ROOT / "tests" / "scripts" / "zero_code_train.py"
    rc, out = _smartckpt(
        ["run", "--dir", "ck", "--every", "5", str(script), "--total", "30", "--kill-at", "17", "--step-time", "0.05"],
        tmp_path, _env(child_env),
    )  # fmt: skip
    assert rc == 0, out[-2000:]
    second = _record(tmp_path / "ck")["attempts"][1]
    assert second["restored_from"] == "disk" and second["resume_check"]["verdict"] == "exact"
    assert second["resume_check"]["step"] == second["start_step"] + 1
    if os.environ.get("SMARTCKPT_TEST_VERBOSE"):
        print(out)
