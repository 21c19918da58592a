"""A real single-node SLURM for the tests: start it, submit jobs, watch them, stop it.

``start_cluster`` runs ``start-slurm.sh`` beside this file (it installs slurm-wlm and munge with
apt-get when missing, writes /etc/slurm/slurm.conf, starts munged, slurmctld and slurmd and
waits until the node is idle; it reuses daemons that ``.ci/run`` or an earlier call started).
It returns which daemons this call started, and ``stop_cluster`` stops exactly those (by
recorded PID and start time, never by name). Job state comes from ``scontrol show job -o``:
there is no accounting storage, so no ``sacct``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from smartckpt_cli.supervise.slurm import parse_show_job

HERE = Path(__file__).resolve().parent
START = HERE / "start-slurm.sh"
STOP = HERE / "stop-slurm.sh"
SLURM_CONF = "/etc/slurm/slurm.conf"
UNAVAILABLE = 3  # start-slurm.sh: SLURM cannot be had on this machine

# Daemons and clients live in /usr/sbin and /usr/bin.
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


class SlurmUnavailable(Exception):
    """SLURM cannot be installed or started here (not root, no apt-get, no network)."""


@dataclass
class Cluster:
    started_file: Path  # "name pid starttime" of the daemons this session started
    seconds: float  # how long start-slurm.sh took
    log: str  # its output

    def started(self) -> list[str]:
        text = self.started_file.read_text() if self.started_file.exists() else ""
        return [line.split()[0] for line in text.splitlines() if line.strip()]


def start_cluster(timeout: float = 600.0) -> Cluster:
    if not sys.platform.startswith("linux"):
        raise SlurmUnavailable(f"the test cluster needs Linux (this is {sys.platform})")
    if os.geteuid() != 0:
        raise SlurmUnavailable("installing and starting slurmctld/slurmd/munged needs root")
    if shutil.which("bash") is None:
        raise SlurmUnavailable("bash not found")
    fd, name = tempfile.mkstemp(prefix="smartckpt-slurm-started-")
    os.close(fd)
    env = dict(os.environ, SLURM_STARTED_FILE=name)
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(START)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    if proc.returncode == UNAVAILABLE:
        reason = next((ln for ln in log.splitlines() if "SLURM unavailable" in ln), log.strip())
        raise SlurmUnavailable(reason)
    if proc.returncode != 0:
        raise RuntimeError(f"start-slurm.sh failed (exit {proc.returncode}):\n{log}")
    return Cluster(Path(name), seconds, log)


def stop_cluster(cluster: Cluster) -> str:
    """Stop the daemons this session started (none when .ci/run had started them)."""
    if not cluster.started():
        cluster.started_file.unlink(missing_ok=True)
        return "nothing to stop: the cluster was already up"
    env = dict(os.environ, SLURM_PIDFILE=str(cluster.started_file))
    proc = subprocess.run(
        ["bash", str(STOP)], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300
    )
    cluster.started_file.unlink(missing_ok=True)
    return proc.stdout + proc.stderr


def client_env(base: dict[str, str]) -> dict[str, str]:
    """``base`` for SLURM clients and submitted jobs: our slurm.conf, no SLURM_* of an outer job."""
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = SLURM_CONF
    env["PATH"] = env.get("PATH", "") + os.pathsep + SYSTEM_PATH
    return env


def sbatch(args: list[str], env: dict[str, str], cwd: Path) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"sbatch {args} failed: {proc.stdout}{proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def show_job(job: str, env: dict[str, str]) -> list[dict[str, str]]:
    """One record per job (an array job gives one per task); [] once SLURM forgot it."""
    proc = subprocess.run(
        ["scontrol", "show", "job", "-o", job],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        return []
    return [parse_show_job(line) for line in proc.stdout.splitlines() if line.strip()]


def wait_jobs(job: str, env: dict[str, str], states: set[str], timeout: float) -> list[dict[str, str]]:
    """Wait until every record of ``job`` is in one of ``states``; returns the records."""
    deadline = time.monotonic() + timeout
    records: list[dict[str, str]] = []
    while time.monotonic() < deadline:
        records = show_job(job, env)
        if records and all(r.get("JobState") in states for r in records):
            return records
        time.sleep(0.5)
    seen = [(r.get("JobId"), r.get("JobState"), r.get("Reason")) for r in records]
    raise AssertionError(f"job {job} not in {sorted(states)} after {timeout:.0f} s: {seen}")


def wait_for(path: Path, pattern: str, timeout: float, job: str, env: dict[str, str]) -> re.Match[str]:
    """Wait until ``path`` (a job's output) has a line matching ``pattern``; returns the match."""
    deadline = time.monotonic() + timeout
    rx = re.compile(pattern, re.M)
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        m = rx.search(text)
        if m:
            return m
        time.sleep(0.2)
    text = path.read_text(errors="replace") if path.exists() else "(no output file)"
    states = [(r.get("JobState"), r.get("Reason")) for r in show_job(job, env)]
    raise AssertionError(f"no line /{pattern}/ in {path} after {timeout:.0f} s; job {job} {states}:\n{text}")


def scancel(args: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(
        ["scancel", *args], env=env, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, f"scancel {args} failed: {proc.stdout}{proc.stderr}"
