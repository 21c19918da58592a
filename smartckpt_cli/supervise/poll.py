"""One attempt, polled: what the supervisor's poll loop keeps between two polls of one child
(:class:`Poll`), the thread that notes the moment the child died (:func:`reaper`), and the facts
of its end that the policy judges (:func:`attempt_end`).

``supervisor.py`` is the loop over attempts and what happens between them; this module is the
state of a single attempt's watch, made when its child starts and thrown away with it.
``watch.py`` holds the steps a poll calls (``observe``, ``hang_kill``); whether the child hangs is
decided by ``policy.HangClock``.

Order of calls (the supervisor, main thread): :func:`reaper` and :meth:`Poll.start` once the child
is spawned; at every poll :meth:`Poll.grace_over` and :meth:`Poll.listen`, then :meth:`Poll.sample` when :meth:`Poll.due`;
once it exited :meth:`Poll.last_beat`, then :func:`attempt_end`.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from smartckpt_cli.hooks import _smartckpt_protocol as proto
from smartckpt_cli.supervise.child import RunDir, hooks_dir
from smartckpt_cli.supervise.forward import Forwarder, killpg
from smartckpt_cli.supervise.monitor import GpuMonitor, TreeMonitor, Usage, near_memory_limit, oom_kills
from smartckpt_cli.supervise.pace import Pace
from smartckpt_cli.supervise.policy import AttemptEnd, HangClock
from smartckpt_cli.supervise.records import AttemptRecord
from smartckpt_cli.supervise.runstate import Emit, RunState
from smartckpt_cli.supervise.watch import hang_kill, observe

__all__ = ["HOOKS_GRACE", "Poll", "attempt_end", "reaper"]

HOOKS_GRACE = 20.0  # seconds after start without a hooks file before warning that hooks are not live


@dataclass
class Poll:
    """What the poll loop of one attempt keeps between polls."""

    pid: int  # the child's, and its process group's
    att: AttemptRecord
    files: RunDir
    state: RunState
    emit: Emit
    clock: HangClock
    tree: TreeMonitor
    step_seen: dict[int, float]  # when a heartbeat first showed each step
    first_step_timeout: float  # settings': the hang timeout before a first step
    pace: Pace = field(default_factory=Pace)
    pids: set[int] = field(default_factory=set)  # every process seen in the child's tree
    hung: bool = False
    warned_hooks: bool = False
    warned_beat: bool = False
    usage: Usage | None = None  # the newest sample of the tree
    last_sample: float = 0.0

    @classmethod
    def start(
        cls,
        pid: int,
        att: AttemptRecord,
        files: RunDir,
        state: RunState,
        emit: Emit,
        *,
        hang_timeout: float | None,
        first_step_timeout: float,
    ) -> Poll:
        """The watch of a child just spawned; its hang clock starts now."""
        tree = TreeMonitor(pid)
        clock = HangClock(override=hang_timeout, first_step=first_step_timeout)
        clock.start(time.monotonic())
        step_seen = {att.newest_checkpoint: att.started}
        return cls(pid, att, files, state, emit, clock, tree, step_seen, first_step_timeout, pids={pid})

    def grace_over(self, signals: Forwarder, now: float) -> None:
        """A child still running grace_period after TERM/INT was passed on is killed."""
        if (
            signals.stop is not None
            and signals.stopping_since is not None
            and now - signals.stopping_since > signals.grace_period
        ):
            self.emit("warning", f"grace period of {signals.grace_period:g} s over: killing the child")
            killpg(self.pid, signal.SIGKILL)
            signals.stopping_since = float("inf")

    def listen(self, now: float, *, stopping: bool) -> None:
        """One poll of the run directory: the heartbeats into the hang clock and the view, the
        warnings of a child that says nothing, and a hang's stack dump and kill."""
        seen = self.files.beats()
        # A process that said DONE has finished training (what follows it, an evaluation or
        # saving the model, is no hang): it counts as a heartbeat, not as a step.
        beats = [b for b in seen if b.state != proto.DONE]
        hooks = self.files.hooks_pids()
        self.state.hooks_live = bool(hooks)
        if beats:
            observe(beats, self.clock, now, self.att, self.step_seen, self.state, self.pace)
        elif seen:
            self.state.heartbeat, self.state.child_state = True, "done"
        self._warn(not seen, hooks)
        # Before the first heartbeat the clock runs too, once the hooks are live in the child
        # (it is a training: a job stuck before its first step is a hang after
        # first_step_timeout); without hooks nothing says what a step is.
        watched = bool(beats) or (bool(hooks) and self.att.max_step is None)
        self.state.hang_timeout = self.clock.timeout() if watched else None
        if watched and not stopping and not self.hung and self.clock.hung(now):
            self.hung = True
            hang_kill(self.pid, self.clock, self.att, hooks, self.files, self.emit)

    def _warn(self, quiet: bool, hooks: list[int]) -> None:
        """Said once each, HOOKS_GRACE after the start: no heartbeat yet (``quiet``), no hooks live."""
        if quiet and self._past_grace() and not self.warned_beat and self.att.max_step is None:
            self.warned_beat = True
            self.emit(
                "warning",
                "no heartbeat from the child yet: hang detection is off until one arrives "
                "(are the hooks live? see the warning above)"
                if not hooks
                else "no heartbeat from the child yet: it counts as hung if it does not reach its first "
                f"step within {self.first_step_timeout:g} s (first_step_timeout)",
            )
        if not hooks and not self.warned_hooks and self._past_grace():
            self.warned_hooks = True
            self.emit(
                "warning",
                f"smartckpt's hooks are not live in the child (no hooks file in {self.files.path}): "
                "the interpreter ignored PYTHONPATH (-I, -E, -S), is not Python, or the "
                f"sitecustomize in {hooks_dir()} is missing; run the script with a plain "
                "`python`, or use a CheckpointManager in the script",
            )

    def _past_grace(self) -> bool:
        return time.time() - self.att.started > HOOKS_GRACE

    def due(self, now: float) -> bool:
        """A second since the last sample: time for the next one."""
        if now - self.last_sample < 1.0:
            return False
        self.last_sample = now
        return True

    def sample(self, gpu: GpuMonitor) -> Usage:
        """CPU, memory and GPU use of the child's tree now; every process in it is remembered."""
        usage = self.tree.sample()
        gpu.sample(usage, set(self.tree.pids()))
        self.pids.update(self.tree.pids())
        self.usage = usage
        return usage

    def last_beat(self) -> None:
        """The highest step the heartbeat files hold, once the child is gone (polls skip steps)."""
        last = self.files.max_step()
        if last is not None:
            self.att.max_step = max(self.att.max_step or 0, last)
            self.step_seen.setdefault(last, self.att.ended)


def reaper(proc: subprocess.Popen[bytes]) -> Callable[[float], float | None]:
    """A thread that waits for the child; the call returned gives the moment of its death (for the
    record's "detection" phase), waiting up to that many seconds for it, or None."""
    reaped = threading.Event()
    died: list[float] = []

    def reap() -> None:
        proc.wait()
        died.append(time.time())
        reaped.set()

    threading.Thread(target=reap, name="smartckpt-reaper", daemon=True).start()
    return lambda timeout: died[0] if reaped.wait(timeout) and died else None


def attempt_end(
    returncode: int,
    att: AttemptRecord,
    committed: list[int],
    poll: Poll,
    signals: Forwarder,
    oom_before: int | None,
) -> AttemptEnd:
    """The facts of how the attempt ended, for ``policy.classify``: ``committed`` holds the steps
    it committed, ``oom_before`` the cgroup's OOM kills when it started."""
    start_step = att.began
    progressed: bool | None = None
    if att.max_step is not None:
        progressed = att.max_step > start_step
    if committed and max(committed) > start_step:
        progressed = True
    oom_after = oom_kills()
    oom = returncode == -signal.SIGKILL and (
        (oom_before is not None and oom_after is not None and oom_after > oom_before)
        or near_memory_limit(poll.usage)
    )
    stop = signals.stop if signals.stop is not None and signals.stopping_since is not None else None
    return AttemptEnd(returncode, progressed, att.error, poll.hung, stop, signals.preempt, oom)
