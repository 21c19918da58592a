"""What ``smartckpt run`` decides, as pure functions: no processes, no files, no clocks.

The supervisor (``supervisor.py``) observes a child and hands the facts to these functions:

1. :func:`classify` turns how an attempt ended (exit code or signal, the error file the hooks
   wrote, whether it ever got past its start step, a hang, a forwarded signal) into an
   :class:`Outcome`: done, stop, restart, or stopped-by-signal, with the cause in words.
2. :func:`backoff` gives the delay before a restart (exponential, capped, reset by progress).
3. :class:`CrashLoop` watches consecutive failed attempts that never get past the same
   checkpoint and says when to roll back (once) and when to give up.
4. :class:`HangClock` learns the step interval from heartbeats and gives the current hang
   timeout (long for the first step, learned after a warm-up, paused while saving/restoring).

Constants below are the defaults the README documents.
"""

from __future__ import annotations

import math
import re
import signal
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from smartckpt_cli.errors import EXIT_REMOTE_UNREACHABLE as _EXIT_REMOTE

__all__ = [
    "BACKOFF_CAP",
    "BACKOFF_FACTOR",
    "EXIT_CRASH_LOOP",
    "EXIT_GAVE_UP",
    "EXIT_REMOTE_UNREACHABLE",
    "FIRST_STEP_TIMEOUT",
    "HANG_FACTOR",
    "HANG_FLOOR",
    "NON_RETRYABLE",
    "WARMUP_INTERVALS",
    "AttemptEnd",
    "CrashLoop",
    "HangClock",
    "Outcome",
    "backoff",
    "classify",
    "estimate_mtbf",
    "exit_status",
    "root_failure",
    "silent_rank",
]

# Exit codes of ``smartckpt run`` besides the child's own (see the command's help).
EXIT_GAVE_UP = 3  # --max-restarts reached
EXIT_CRASH_LOOP = 4  # the same failure after a rollback: stopped with a diagnosis
# nothing to resume locally, the remote unreachable for remote_start_wait (errors.RemoteStartRefused)
EXIT_REMOTE_UNREACHABLE = _EXIT_REMOTE

BACKOFF_FACTOR = 2.0
BACKOFF_CAP = 300.0  # seconds

# Hang detection.
FIRST_STEP_TIMEOUT = 1800.0  # seconds without a first step (imports, data, compile, restore)
WARMUP_INTERVALS = 5  # step intervals observed before the timeout is learned
HANG_FACTOR = 10.0  # x the slowest recent step interval
HANG_FLOOR = 60.0  # a learned timeout is never shorter than this
WARMUP_TIMEOUT = 600.0  # between the first step and the end of the warm-up
INTERVAL_WINDOW = 200

# Exceptions that fail the same way on every restart: a restart cannot help.
NON_RETRYABLE = (
    "SyntaxError",
    "IndentationError",
    "TabError",
    "ImportError",
    "ModuleNotFoundError",
    "NameError",
)
_RETRYABLE_MARKERS = re.compile(r"CUDA|NCCL|cuDNN|CUBLAS|out of memory|ECC|Xid|c10d|Gloo", re.IGNORECASE)


@dataclass(frozen=True)
class AttemptEnd:
    """The facts of how one attempt ended."""

    returncode: int  # Popen's: negative = killed by that signal
    progressed: bool | None  # got past its start step; None = unknown (no heartbeat, no commit)
    error: dict[str, Any] | None = None  # error.<pid>.json: type, message, traceback
    hung: bool = False  # the supervisor killed it for not beating
    forwarded: int | None = None  # a stop signal (TERM/INT) the supervisor forwarded
    preempted: int | None = None  # a preemption signal (USR1/USR2) the supervisor forwarded
    oom: bool = False  # the kernel's OOM killer fired (cgroup counter) or memory was at its limit


@dataclass(frozen=True)
class Outcome:
    action: str  # "done" | "stop" | "restart" | "signalled" | "preempted"
    category: str  # done, non-retryable, no-progress, failed, signal, oom, hang, gpu, stopped, preempted
    cause: str  # one line, for the log and the run record
    exit_code: int  # what ``smartckpt run`` exits with if this is the last attempt


def exit_status(returncode: int) -> int:
    """A shell-style status: 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _matches(patterns: list[str], text: str) -> str | None:
    for pat in patterns:
        try:
            if re.search(pat, text):
                return pat
        except re.error:
            if pat in text:
                return pat
    return None


def classify(end: AttemptEnd, *, patterns: list[str] | tuple[str, ...] = ()) -> Outcome:
    """Decide what follows an attempt (see the module docstring)."""
    rc, status = end.returncode, exit_status(end.returncode)
    if end.forwarded is not None:
        return _stopped(end.forwarded, rc, status)
    if rc == 0:
        return Outcome("done", "done", "finished", 0)
    if end.preempted is not None:
        name = _signame(end.preempted)
        return Outcome("preempted", "preempted", f"preempted by {name}: the child saved and exited", status)
    err = end.error or {}
    etype, emsg = str(err.get("type", "")), str(err.get("message", ""))
    text = f"{etype}: {emsg}" if etype else ""
    rank = err.get("rank")
    if isinstance(rank, int) and not etype:  # a rank that wrote no error: how it ended (root_failure)
        return _ended(end, f"rank {rank} {_rank_end(err)}", status)
    if isinstance(rank, int):
        text = f"rank {rank}: {text}"
    refused = _refused(etype, emsg, text, list(patterns), status)
    if refused is not None:
        return refused
    return _failed(end, text, status)


def _stopped(forwarded: int, rc: int, status: int) -> Outcome:
    """The stop the user asked for (TERM/INT, forwarded to the child): the run ends."""
    # It ends with that signal's status when the child exited with a code of its own (torchrun's
    # agent exits 1 after passing SIGINT to its workers); a child killed after the grace period
    # keeps its own (137).
    return Outcome(
        "signalled",
        "stopped",
        f"stopped by {_signame(forwarded)} (forwarded to the child)",
        128 + forwarded if rc > 0 else status,
    )


def _rank_end(err: dict[str, Any]) -> str:
    """How a rank that wrote no error of its own ended, in words."""
    return (
        f"killed by {err['signal']}"
        if err.get("signal")
        else f"exit code {err['exitcode']}"
        if err.get("exitcode") is not None
        else "ended without an error of its own (killed by a signal?)"
    )


def _refused(etype: str, emsg: str, text: str, patterns: list[str], status: int) -> Outcome | None:
    """The child's error says a restart cannot help: stop; None when it does not."""
    if etype.rsplit(".", 1)[-1] == "RemoteStartRefused":
        # The child waited remote_start_wait for the remote and refused to start over at step 0:
        # a restart now would wait again; the operator decides (run again, or start fresh).
        return Outcome("stop", "remote-unreachable", _short(emsg, 400), EXIT_REMOTE_UNREACHABLE)
    if etype:
        pat = _matches(patterns, text)
        if pat is not None:
            return Outcome(
                "stop", "non-retryable", f"{_short(text)} matches no_restart_on pattern {pat!r}", status
            )
        if etype.rsplit(".", 1)[-1] in NON_RETRYABLE:
            return Outcome(
                "stop", "non-retryable", f"{_short(text)}: a restart would fail the same way", status
            )
    return None


def _failed(end: AttemptEnd, text: str, status: int) -> Outcome:
    """A failure whose error (``text``, maybe empty) does not rule out a restart."""
    rc = end.returncode
    if end.hung:
        return Outcome("restart", "hang", "hung: no heartbeat within the hang timeout", status)
    if not end.progressed and not (rc < 0 and end.progressed is None):
        how = f"{_short(text)}, " if text else ""
        how += f"killed by {_signame(-rc)}" if rc < 0 else f"exit code {rc}"
        return Outcome(
            "stop",
            "no-progress",
            f"failed before its first training step ({how}): a restart would fail the same way",
            status,
        )
    if end.oom:
        return Outcome("restart", "oom", "killed by the OOM killer (SIGKILL at the memory limit)", status)
    if text and _RETRYABLE_MARKERS.search(text):
        return Outcome("restart", "gpu", f"GPU/communication error: {_short(text)}", status)
    if rc < 0:
        return Outcome("restart", "signal", f"killed by {_signame(-rc)}", status)
    if text:
        return Outcome("restart", "failed", _short(text), status)
    return Outcome("restart", "failed", f"exit code {rc}", status)


_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote process exited", re.IGNORECASE)


def root_failure(failures: list[Any], errors: dict[int | None, dict[str, Any]]) -> dict[str, Any] | None:
    """Pure: which rank's end caused the others', from torchrun's report (``failures``: each
    failed rank's ``rank``, ``pid``, ``exitcode``, ``signal``, ``time``) and the ranks' own error
    files (``errors`` by pid). A rank killed by a signal comes first (its peers then lose their
    connection and exit with an error of their own, or torchrun stops them with SIGTERM), then a
    rank whose error is not a lost peer, then one SIGTERM stopped, then the rest; earliest first
    within each, then the lowest rank. The rank's own error when it wrote one, else what killed
    it; ``rank`` added either way. None when ``failures`` names no rank."""
    ranks = [f for f in failures if isinstance(f, dict) and isinstance(f.get("rank"), int)]
    if not ranks:
        return None

    def text(f: dict[str, Any]) -> str:
        own = errors.get(f.get("pid")) or {}
        return f"{own.get('type', '')}: {own.get('message', '')}"

    def order(f: dict[str, Any]) -> tuple[int, float, int]:
        sig, own = f.get("signal"), errors.get(f.get("pid"))
        if sig and own is None and sig != "SIGTERM":
            kind = 0  # killed outright: nothing of its own was said
        elif own is not None and not _PEER_GONE.search(text(f)):
            kind = 1  # an error of its own
        elif sig and own is None:
            kind = 2  # SIGTERM: what torchrun stops the surviving ranks with
        else:
            kind = 3  # a peer went away
        when = f.get("time")
        return kind, float(when) if isinstance(when, int | float) else math.inf, int(f["rank"])

    first = min(ranks, key=order)
    own = errors.get(first.get("pid"))
    if own is not None:
        return {**own, "rank": first["rank"]}
    return {"rank": first["rank"], "signal": first.get("signal"), "exitcode": first.get("exitcode")}


def _ended(end: AttemptEnd, how: str, status: int) -> Outcome:
    """A rank of several that died without an error of its own (a signal, an exit code)."""
    if end.hung:
        return Outcome("restart", "hang", "hung: no heartbeat within the hang timeout", status)
    if not end.progressed and end.progressed is not None:
        return Outcome(
            "stop",
            "no-progress",
            f"failed before its first training step ({how}): a restart would fail the same way",
            status,
        )
    if end.oom:
        return Outcome("restart", "oom", f"{how.split(' killed')[0]} killed by the OOM killer", status)
    return Outcome("restart", "signal" if "killed by" in how or "signal" in how else "failed", how, status)


def silent_rank(
    dead: list[tuple[int, int, float]], errors: dict[int | None, dict[str, Any]]
) -> dict[str, Any] | None:
    """Pure: without torchrun's report, the rank that died first when it said nothing: ``dead``
    holds (rank, pid, last beat) of ranks gone without DONE; the one with no error file of its
    own whose last beat is the earliest, when every error the others wrote is a lost peer's
    (theirs are the consequence). None otherwise."""
    quiet = [d for d in dead if d[1] not in errors]
    said = [e for e in errors.values() if e]
    if not quiet or any(not _PEER_GONE.search(f"{e.get('type')}: {e.get('message')}") for e in said):
        return None
    rank, _, _ = min(quiet, key=lambda d: (d[2], d[0]))
    return {"rank": rank, "signal": None, "exitcode": None}


def _short(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def backoff(
    failures_in_a_row: int, base: float, *, factor: float = BACKOFF_FACTOR, cap: float = BACKOFF_CAP
) -> float:
    """Seconds to wait before a restart after ``failures_in_a_row`` failures without progress
    in between: none after an attempt that progressed (0), then base, 2·base, 4·base, ... capped."""
    if failures_in_a_row < 1 or base <= 0:
        return 0.0
    return float(min(cap, base * factor ** (failures_in_a_row - 1)))


@dataclass
class CrashLoop:
    """Consecutive failed attempts that never get past the same checkpoint.

    ``record(start_step, committed_past)`` is called for each failed (retryable) attempt with
    the checkpoint step it started from and whether it committed a checkpoint beyond the crash
    loop's mark. After ``limit`` stuck attempts from one checkpoint it answers ``"rollback"``
    (once per run); the first stuck attempt after the rollback answers ``"stop"``.
    """

    limit: int = 3
    stuck: int = 0
    at_step: int | None = None  # the checkpoint the stuck attempts start from
    mark: int | None = None  # after a rollback: the step the loop happened at
    rolled_back: bool = False

    def record(self, start_step: int, max_committed: int) -> str:
        """``max_committed``: the newest step committed during the attempt (or ``start_step``)."""
        past = max(start_step, self.mark if self.mark is not None else start_step)
        if max_committed > past:
            self.stuck, self.at_step = 0, None
            if self.rolled_back:
                self.mark = None  # it got past the loop: the rollback helped
            return "restart"
        if self.rolled_back and self.mark is not None:
            return "stop"
        if self.at_step != start_step:
            self.at_step, self.stuck = start_step, 0
        self.stuck += 1
        if self.stuck >= self.limit:
            if self.rolled_back:
                return "stop"
            self.rolled_back, self.mark, self.stuck = True, start_step, 0
            return "rollback"
        return "restart"

    def progressed(self) -> None:
        """An attempt that committed something new, or that succeeded."""
        self.stuck, self.at_step = 0, None


@dataclass
class HangClock:
    """Learns the step interval and tells whether the child hangs.

    Feed it ``observe(step, state, now)`` at each poll with the newest heartbeat (any rank's
    slowest); ``timeout(now)`` is the current allowance in seconds (None while paused) and
    ``hung(now)`` says whether it has passed since the last progress.
    """

    override: float | None = None
    first_step: float = FIRST_STEP_TIMEOUT
    factor: float = HANG_FACTOR
    floor: float = HANG_FLOOR
    warmup: int = WARMUP_INTERVALS
    start_step: int | None = None
    last_step: int | None = None
    last_change: float = 0.0
    paused: bool = False
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=INTERVAL_WINDOW))

    def start(self, now: float) -> None:
        self.last_change, self.last_step, self.start_step, self.paused = now, None, None, False

    def observe(self, step: int, paused: bool, now: float) -> None:
        if self.start_step is None:
            self.start_step = step
        # The first step (start-up, compilation, restore) is not a step interval.
        if self.last_step is not None and self.last_step != self.start_step and step > self.last_step:
            self.intervals.append((now - self.last_change) / (step - self.last_step))
        if step != self.last_step or paused != self.paused:
            self.last_change = now
        self.last_step, self.paused = step, paused

    @property
    def stepped(self) -> bool:
        return self.last_step is not None and self.start_step is not None and self.last_step > self.start_step

    def timeout(self) -> float | None:
        if self.paused:
            return None
        if not self.stepped:
            return max(self.first_step, 10 * self.override) if self.override else self.first_step
        if self.override:
            return self.override
        if len(self.intervals) < self.warmup:
            return WARMUP_TIMEOUT
        return learned_timeout(list(self.intervals), factor=self.factor, floor=self.floor)

    def hung(self, now: float) -> bool:
        t = self.timeout()
        return t is not None and now - self.last_change > t


def learned_timeout(
    intervals: list[float], *, factor: float = HANG_FACTOR, floor: float = HANG_FLOOR
) -> float:
    """factor x the slowest recent step (evaluation or logging steps included), at least floor."""
    return max(floor, factor * max(intervals)) if intervals else floor


def estimate_mtbf(
    records: list[dict[str, Any]], *, lo: float = 60.0, hi: float = 30 * 86400.0
) -> float | None:
    """Mean time between failures from run records: attempt wall time / failed attempts.

    Failures are attempts that ended by a cause a restart addresses (signal, OOM, hang, GPU,
    preemption, other retryable failures); None until one has been seen."""
    exposure, failures = 0.0, 0
    for rec in records:
        for att in rec.get("attempts", []):
            try:
                exposure += max(0.0, float(att.get("ended", 0)) - float(att.get("started", 0)))
            except (TypeError, ValueError):
                continue
            if att.get("category") in ("signal", "oom", "hang", "gpu", "failed", "preempted"):
                failures += 1
    if failures == 0 or exposure <= 0:
        return None
    return float(min(hi, max(lo, exposure / failures)))
