"""smartckpt_cli.supervise.slurm, and preemption + requeue under a real single-node SLURM.

The pure parts (job, attempt and requeue target from the environment) are tested directly;
``requeue`` against stand-in ``scontrol`` programs for its error lines; then, under the real
SLURM that the session fixture starts (tests/slurm/start-slurm.sh: slurm-wlm and munge,
installed with apt-get when missing), jobs are signalled with ``scancel --signal=USR1 --batch``,
requeue themselves and finish from their checkpoint with the weights of an uninterrupted run.
The SLURM tests are skipped, with the reason, only where SLURM cannot be installed or started
(not root, no apt-get, no network).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from smartckpt_cli.errors import SmartckptError
from smartckpt_cli.supervise.slurm import (
    SlurmError,
    SlurmJob,
    in_slurm_job,
    job_from_env,
    parse_show_job,
    requeue,
    requeue_target,
    restart_count,
)
from tests.conftest import ROOT
from tests.slurm import cluster as sl

# One pytest-xdist worker runs them all: the worker that starts the cluster stops it when its
# session ends, which must not happen under another worker's job.
pytestmark = pytest.mark.xdist_group("slurm")

TRAIN = ROOT / "examples" / "slurm" / "train.py"
SBATCH_EXAMPLE = ROOT / "examples" / "slurm" / "train.sbatch"
STEPS = 200
SLEEP = 0.05  # seconds per step: the run lasts long enough to be signalled in the middle

# ---------------------------------------------------------------- pure: the job from its environment


def test_outside_slurm_there_is_no_job() -> None:
    assert job_from_env({}) is None
    assert not in_slurm_job({"PATH": "/bin"})
    assert restart_count({}) == 0
    with pytest.raises(SlurmError, match="not inside a SLURM job"):
        requeue_target({})


def test_plain_job() -> None:
    env = {"SLURM_JOB_ID": "1234", "SLURM_RESTART_COUNT": "2"}
    assert in_slurm_job(env)
    assert job_from_env(env) == SlurmJob("1234", None, None, 2)
    assert requeue_target(env) == "1234"
    assert restart_count(env) == 2


def test_first_run_has_attempt_zero() -> None:
    job = job_from_env({"SLURM_JOB_ID": "7"})
    assert job is not None and job.restart_count == 0


def test_old_variable_name_is_read() -> None:
    assert requeue_target({"SLURM_JOBID": "99"}) == "99"


def test_array_task_is_requeued_by_array_and_task_id() -> None:
    # SLURM_JOB_ID of an array task is its own id; scontrol is given "<array>_<task>".
    env = {"SLURM_JOB_ID": "131", "SLURM_ARRAY_JOB_ID": "120", "SLURM_ARRAY_TASK_ID": "11"}
    job = job_from_env(env)
    assert job == SlurmJob("131", "120", "11", 0)
    assert requeue_target(env) == "120_11"


def test_half_an_array_description_falls_back_to_the_job_id() -> None:
    assert requeue_target({"SLURM_JOB_ID": "131", "SLURM_ARRAY_JOB_ID": "120"}) == "131"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLURM_JOB_ID": "12; rm -rf /"}, "SLURM_JOB_ID"),
        ({"SLURM_JOB_ID": "1", "SLURM_ARRAY_JOB_ID": "x", "SLURM_ARRAY_TASK_ID": "1"}, "SLURM_ARRAY_JOB_ID"),
        ({"SLURM_JOB_ID": "1", "SLURM_RESTART_COUNT": "-1"}, "SLURM_RESTART_COUNT"),
    ],
)
def test_malformed_values_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(SlurmError, match=message) as err:
        job_from_env(env)
    assert isinstance(err.value, SmartckptError)


def test_parse_show_job() -> None:
    line = (
        "JobId=42 JobName=smartckpt-train UserId=root(0) JobState=RUNNING Reason=None "
        "Requeue=1 Restarts=1 BatchFlag=1 Command=/tmp/x.sbatch --steps=3 "
        "WorkDir=/tmp TRES=cpu=1,mem=100M,node=1"
    )
    f = parse_show_job(line)
    assert f["JobId"] == "42" and f["JobState"] == "RUNNING" and f["Restarts"] == "1"
    assert f["Command"] == "/tmp/x.sbatch --steps=3"
    assert f["TRES"] == "cpu=1,mem=100M,node=1"
    assert parse_show_job("") == {}


def test_sbatch_example_has_the_directives_preemption_needs() -> None:
    text = SBATCH_EXAMPLE.read_text()
    directives = re.findall(r"^#SBATCH (\S+)", text, re.M)
    for flag in ("--signal=B:USR1@90", "--requeue", "--open-mode=append"):
        assert flag in directives, flag
    # sbatch reads #SBATCH lines only up to the first command.
    first_command = next(i for i, ln in enumerate(text.splitlines()) if ln.strip() and not ln.startswith("#"))
    assert all(text.splitlines().index(f"#SBATCH {d}") < first_command for d in directives)
    run = re.search(r"^smartckpt run --requeue .*&$", text, re.M)
    trap = re.search(r"^trap ", text, re.M)
    ready = re.search(r"^echo .*ready job=", text, re.M)
    assert run and trap and ready
    # The trap before the ready line, the ready line before the work (run in the background).
    assert trap.start() < ready.start() < run.start()
    subprocess.run(["bash", "-n", str(SBATCH_EXAMPLE)], check=True)


# ---------------------------------------------------------------- requeue against stand-in scontrol programs


def _fake_scontrol(tmp_path: Path, body: str) -> Path:
    exe = tmp_path / "bin" / "scontrol"
    exe.parent.mkdir(exist_ok=True)
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_requeue_runs_scontrol_with_the_target(tmp_path: Path) -> None:
    args_file = tmp_path / "args"
    exe = _fake_scontrol(tmp_path, f'echo "$@" > {args_file}')
    env = {"SLURM_JOB_ID": "131", "SLURM_ARRAY_JOB_ID": "120", "SLURM_ARRAY_TASK_ID": "3"}
    result = requeue(env, scontrol=str(exe))
    assert args_file.read_text().split() == ["requeue", "120_3"]
    assert result.target == "120_3"
    assert result.command == (str(exe), "requeue", "120_3")
    assert result.seconds >= 0


def test_requeue_refused_gives_one_line_with_a_hint(tmp_path: Path) -> None:
    exe = _fake_scontrol(
        tmp_path, 'echo "slurm_requeue error: Requested operation is presently disabled" >&2; exit 1'
    )
    with pytest.raises(SlurmError) as err:
        requeue({"SLURM_JOB_ID": "5"}, scontrol=str(exe))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("scontrol requeue 5 failed (exit 1): slurm_requeue error: Requested operation")
    assert "--requeue" in msg


def test_requeue_without_scontrol(tmp_path: Path) -> None:
    with pytest.raises(SlurmError, match="not found on PATH"):
        requeue({"SLURM_JOB_ID": "5"}, scontrol=str(tmp_path / "no-such-scontrol"))


def test_requeue_outside_a_job_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    exe = _fake_scontrol(tmp_path, f"touch {marker}")
    with pytest.raises(SlurmError, match="not inside a SLURM job"):
        requeue({}, scontrol=str(exe))
    assert not marker.exists()


def test_requeue_that_hangs_times_out(tmp_path: Path) -> None:
    exe = _fake_scontrol(tmp_path, "exec sleep 30")
    with pytest.raises(SlurmError, match=r"did not answer within 0\.5 s"):
        requeue({"SLURM_JOB_ID": "5"}, scontrol=str(exe), timeout=0.5)


# ---------------------------------------------------------------- where SLURM cannot be had, the tests skip


def test_start_script_says_unavailable_without_root(tmp_path: Path) -> None:
    """Exit 3 (the fixture's "skip") with one line naming why, before touching anything."""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("needs root and runuser to run the start script as an unprivileged user")
    tmp_path.chmod(0o777)
    # A copy nobody can read: the checkout may sit under a private directory (mktemp -d is 0700)
    readable = Path(tempfile.mkdtemp(prefix="smartckpt-start-"))
    readable.chmod(0o755)
    script = readable / sl.START.name
    shutil.copy(sl.START, script)
    script.chmod(0o755)
    proc = subprocess.run(
        ["runuser", "-u", "nobody", "--", "bash", str(script)],
        env={"PATH": sl.SYSTEM_PATH, "SMARTCKPT_SLURM_DIR": str(tmp_path / "state")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    shutil.rmtree(readable)
    assert proc.returncode == sl.UNAVAILABLE, proc.stdout + proc.stderr
    assert "SLURM unavailable: must run as root" in proc.stderr
    assert not (tmp_path / "state").exists()


def test_fixture_skips_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(sl.SlurmUnavailable, match="needs root"):
        sl.start_cluster()


# ---------------------------------------------------------------- a real single-node SLURM


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[sl.Cluster]:
    """A running single-node SLURM for the session; stops only the daemons it started."""
    try:
        cluster = sl.start_cluster()
    except sl.SlurmUnavailable as err:
        pytest.skip(f"SLURM cannot be installed or started here: {err}")
    try:
        yield cluster
    finally:
        sl.stop_cluster(cluster)


@pytest.fixture
def slurm_env(slurm_cluster: sl.Cluster, child_env: dict[str, str]) -> dict[str, str]:
    """Environment for sbatch/scontrol and the jobs (sbatch exports it): this venv's python and
    smartckpt first on PATH, the package importable, our slurm.conf."""
    env = sl.client_env(child_env)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    return env


@pytest.fixture(scope="session")
def reference_hash(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Final weights of an uninterrupted run, outside SLURM."""
    d = tmp_path_factory.mktemp("reference")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMARTCKPT_", "SLURM_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, str(TRAIN), "--dir", str(d / "ckpt"), "--steps", str(STEPS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    return _final_hash(out)


def _final_hash(text: str) -> str:
    hashes = re.findall(r"^final weights sha256=([0-9a-f]{64})$", text, re.M)
    assert len(hashes) == 1, f"expected one final hash line:\n{text}"
    return hashes[0]


def _starts(text: str) -> list[tuple[int, int]]:
    """(step, SLURM_RESTART_COUNT) of each start of train.py, in order."""
    return [(int(s), int(r)) for s, r in re.findall(r"^start step=(\d+) restart=(\d+)$", text, re.M)]


def _preempt_and_check(
    job: str, out: Path, env: dict[str, str], reference: str, ready: str
) -> tuple[str, list[tuple[int, int]]]:
    """Signal ``job`` once it is training, wait for it to requeue and finish; check the resume."""
    sl.wait_for(out, ready, 120, job, env)
    m = sl.wait_for(out, r"^step=(2\d|[3-9]\d|\d{3,})\s", 180, job, env)  # at least 20 steps done
    signalled_at = int(m.group(1))
    sl.scancel(["--signal=USR1", "--batch", job], env)
    records = sl.wait_jobs(job, env, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, 300)
    text = out.read_text()
    assert records[0]["JobState"] == "COMPLETED", f"job {job}: {records[0]}\n{text}"
    assert records[0]["Restarts"] == "1", f"job {job} should have been requeued once: {records[0]}\n{text}"
    starts = _starts(text)
    assert len(starts) == 2, text
    (first, first_restart), (resumed, second_restart) = starts
    assert (first, first_restart) == (0, 0), text
    assert second_restart == 1, "SLURM_RESTART_COUNT=1 on the second run\n" + text
    # The second run continues from the preemption checkpoint, not from step 0.
    assert signalled_at <= resumed < STEPS, text
    assert f"step={resumed + 1} " in text.split(f"start step={resumed} restart=1", 1)[1], text
    assert _final_hash(text) == reference, "final weights differ from the uninterrupted run\n" + text
    return text, starts


@pytest.mark.slow
def test_trap_script_requeues_through_slurm_module(
    slurm_env: dict[str, str], reference_hash: str, tmp_path: Path
) -> None:
    """No supervisor: the batch script forwards USR1 to train.py (explicit CheckpointManager),
    which saves and exits; the script calls smartckpt_cli.supervise.slurm.requeue(); the job runs again
    with SLURM_RESTART_COUNT=1 and finishes from the checkpoint."""
    out = tmp_path / "job.out"
    env = dict(
        slurm_env, TRAIN=str(TRAIN), CKPT_DIR=str(tmp_path / "ckpt"), STEPS=str(STEPS), SLEEP=str(SLEEP)
    )
    job = sl.sbatch(["-o", str(out), str(ROOT / "tests" / "slurm" / "requeue_trap.sbatch")], env, tmp_path)
    text, _ = _preempt_and_check(job, out, env, reference_hash, r"^batch: ready job=\d+ restart=0$")
    assert f"batch: requeued {job}" in text


@pytest.mark.slow
def test_array_task_requeues_itself_by_array_and_task_id(slurm_env: dict[str, str], tmp_path: Path) -> None:
    script = ROOT / "tests" / "slurm" / "requeue_array.sbatch"
    job = sl.sbatch(["--array=0-1", "-o", str(tmp_path / "task-%a.out"), str(script)], slurm_env, tmp_path)
    records = sl.wait_jobs(job, slurm_env, {"COMPLETED", "FAILED", "CANCELLED"}, 300)
    assert len(records) == 2
    for task in (0, 1):
        text = (tmp_path / f"task-{task}.out").read_text()
        # slurmstepd writes its "CANCELLED ... DUE TO JOB REQUEUE" line into the same file, and
        # it can land in the middle of the task's own line
        text = re.sub(r"slurmstepd\S*: error: \*\*\*.*?\*\*\*\n?", "", text)
        # the target requeue() hands scontrol (its "requeued" line may not outlive the requeue)
        assert f"requeueing {job}_{task}\n" in text, text
        assert f"run task={task} " in text and f"second run task={task}" in text, text
    for r in records:
        assert r["JobState"] == "COMPLETED" and r["Restarts"] == "1", r


@pytest.mark.slow
def test_sbatch_example_is_preempted_requeued_and_resumed(
    slurm_env: dict[str, str], reference_hash: str, tmp_path: Path
) -> None:
    """Must-show 7: examples/slurm/train.sbatch (`smartckpt run --requeue`) gets
    `scancel --signal=USR1 --batch`, requeues itself, runs again with SLURM_RESTART_COUNT=1,
    resumes from its checkpoint and ends with the uninterrupted run's weights."""
    out = tmp_path / "train.out"
    env = dict(
        slurm_env,
        TRAIN=str(TRAIN),
        CKPT_DIR=str(tmp_path / "ckpt"),
        TRAIN_ARGS=f"--steps {STEPS} --sleep {SLEEP}",
        PYTHON=sys.executable,
    )
    job = sl.sbatch(["-o", str(out), str(SBATCH_EXAMPLE)], env, tmp_path)
    text, _ = _preempt_and_check(job, out, env, reference_hash, r"^train.sbatch: ready job=\d+ restart=0 ")
    assert "train.sbatch: SIGUSR1 received" in text
