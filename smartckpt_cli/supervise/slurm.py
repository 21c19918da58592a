"""SLURM: which job this is, which attempt, and requeueing it after a preemption.

Reading the job is pure (a mapping of environment variables in, plain values out), so it is
tested without SLURM; ``requeue`` is the one function that does something (``scontrol requeue``).

How ``smartckpt run --requeue`` uses this module (the order of calls):

1. At start, ``job_from_env()``: ``None`` outside a SLURM job, where ``--requeue`` has nothing to
   requeue (say so once and carry on without it). Inside a job, ``job.restart_count`` is
   SLURM's attempt counter (``SLURM_RESTART_COUNT``: 0 on the first run, 1 after the first
   requeue, ...) for the run record and the log line; the checkpoint store decides where
   training resumes, not this number.
2. The preemption signal (SIGUSR1 by default, from ``#SBATCH --signal=B:USR1@90`` or
   ``scancel --signal=USR1 --batch JOBID``) reaches ``smartckpt run`` as the batch step's
   process (the example batch script forwards it from its trap). ``run`` forwards it to the
   child, whose hooks take a blocking checkpoint at the next step boundary and exit.
3. When the child has exited after that forwarded signal (whatever its exit status: the hooks
   re-raise the signal) and ``--requeue`` is on, ``run`` calls ``requeue()`` once. On success
   SLURM puts the job back in the queue and ends this allocation (SIGTERM to the batch step,
   SIGKILL after ``KillWait``); ``run`` should just exit, with status 0. A ``SlurmError`` is one
   line for the user (``str(err)``); ``run`` exits non-zero with it, and the checkpoint is
   still there for a manual resubmission.
4. A child that finishes (exit 0) or fails without a preemption signal is never requeued.

The job must be requeueable: submitted with ``--requeue`` (or the cluster's ``JobRequeue=1``),
and ``--open-mode=append`` keeps the first run's output in the log.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from smartckpt_cli.errors import SmartckptError

__all__ = [
    "RequeueResult",
    "SlurmError",
    "SlurmJob",
    "in_slurm_job",
    "job_from_env",
    "parse_show_job",
    "requeue",
    "requeue_target",
    "restart_count",
]

logger = logging.getLogger(__name__)

_ID = re.compile(r"^[0-9]+$")


class SlurmError(SmartckptError):
    """Not inside a SLURM job, or ``scontrol`` refused or failed."""


@dataclass(frozen=True)
class SlurmJob:
    """The SLURM job this process belongs to, as its environment describes it."""

    job_id: str  # SLURM_JOB_ID: for an array task, the task's own job id
    array_job_id: str | None  # SLURM_ARRAY_JOB_ID, None outside job arrays
    array_task_id: str | None  # SLURM_ARRAY_TASK_ID
    restart_count: int  # SLURM_RESTART_COUNT: 0 on the first run, +1 per requeue

    @property
    def requeue_target(self) -> str:
        """What ``scontrol requeue`` is given: ``<array>_<task>`` for an array task, else the id."""
        if self.array_job_id is not None and self.array_task_id is not None:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id


@dataclass(frozen=True)
class RequeueResult:
    """A successful ``scontrol requeue``."""

    target: str  # the job id given to scontrol ("123" or "120_3")
    command: tuple[str, ...]  # the command that ran
    output: str  # what scontrol printed (usually nothing)
    seconds: float  # how long scontrol took


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def in_slurm_job(env: Mapping[str, str] = os.environ) -> bool:
    """True inside a SLURM job allocation (batch script, srun step or salloc shell)."""
    return _get(env, "SLURM_JOB_ID") is not None or _get(env, "SLURM_JOBID") is not None


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """SLURM's attempt counter, ``SLURM_RESTART_COUNT``: 0 when unset (the first run)."""
    raw = _get(env, "SLURM_RESTART_COUNT")
    if raw is None:
        return 0
    if not _ID.match(raw):
        raise SlurmError(f"SLURM_RESTART_COUNT={raw!r} is not a non-negative integer")
    return int(raw)


def job_from_env(env: Mapping[str, str] = os.environ) -> SlurmJob | None:
    """The job described by ``env``; ``None`` outside SLURM. Malformed ids raise ``SlurmError``."""
    job_id = _get(env, "SLURM_JOB_ID") or _get(env, "SLURM_JOBID")
    if job_id is None:
        return None
    array_job = _get(env, "SLURM_ARRAY_JOB_ID")
    array_task = _get(env, "SLURM_ARRAY_TASK_ID")
    for name, value in (
        ("SLURM_JOB_ID", job_id),
        ("SLURM_ARRAY_JOB_ID", array_job),
        ("SLURM_ARRAY_TASK_ID", array_task),
    ):
        if value is not None and not _ID.match(value):
            raise SlurmError(f"{name}={value!r} is not a SLURM job id")
    if (array_job is None) != (array_task is None):
        # Half an array description: the plain job id still names this very job.
        array_job = array_task = None
    return SlurmJob(job_id, array_job, array_task, restart_count(env))


def requeue_target(env: Mapping[str, str] = os.environ) -> str:
    """The id ``scontrol requeue`` needs for this job (array-task aware)."""
    job = job_from_env(env)
    if job is None:
        raise SlurmError("not inside a SLURM job (SLURM_JOB_ID is not set): nothing to requeue")
    return job.requeue_target


def requeue(
    env: Mapping[str, str] = os.environ, *, scontrol: str = "scontrol", timeout: float = 60.0
) -> RequeueResult:
    """Put this job back in the queue with ``scontrol requeue <target>``.

    ``env`` only names the job; ``scontrol`` runs in this process's own environment (so
    ``SLURM_CONF`` and ``PATH`` are the caller's). Raises ``SlurmError`` with one line naming
    the cause: outside a job, ``scontrol`` missing, a refusal (job not requeueable, unknown
    job, controller down) or no answer within ``timeout`` seconds.
    """
    target = requeue_target(env)
    exe = shutil.which(scontrol)
    if exe is None:
        raise SlurmError(f"cannot requeue job {target}: {scontrol!r} not found on PATH")
    command = (exe, "requeue", target)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as err:
        raise SlurmError(
            f"cannot requeue job {target}: 'scontrol requeue' did not answer within {timeout:g} s"
        ) from err
    except OSError as err:
        raise SlurmError(f"cannot requeue job {target}: {err}") from err
    seconds = time.monotonic() - t0
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        detail = " ".join(output.split()) or "no message"
        hint = ""
        if "disabled" in detail.lower():
            hint = " (submit the job with --requeue, or set JobRequeue=1 in slurm.conf)"
        raise SlurmError(f"scontrol requeue {target} failed (exit {proc.returncode}): {detail}{hint}")
    logger.info("job %s requeued (scontrol took %.2f s)", target, seconds)
    return RequeueResult(target, command, output, seconds)


def parse_show_job(text: str) -> dict[str, str]:
    """Fields of one ``scontrol show job -o ID`` record, e.g. ``{"JobState": "RUNNING", ...}``.

    A word without ``=`` belongs to the value before it (values may contain spaces)."""
    fields: dict[str, str] = {}
    last: str | None = None
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key and (key[0].isalpha() or key[0] == "_"):
            fields[key] = value
            last = key
        elif last is not None:
            fields[last] += " " + word
    return fields
