"""``smartckpt run``'s doing half: spawn the training, watch it, forward signals, restart it.

Order of events for one run::

    Supervisor(options, on_event).run()
      for each attempt:
        newest checkpoint (what the child restores) -> child env (handshake + settings + MTBF)
        Popen(start_new_session=True)          # its own process group: signals go to all of it
        poll every 0.2 s until it exits:
          forward TERM/INT/USR1/USR2 to the group; after TERM/INT, SIGKILL after grace_period
          heartbeats -> HangClock; hung -> SIGQUIT (stack dump, live hooks only) -> SIGKILL
          psutil/NVML samples -> RunState (the CLI renders it)
        runpolicy.classify -> done | stop | restart | signalled | preempted
        restart: crash-loop check (maybe a journal rollback), backoff, GPU memory freed
      run record -> <dir>/runs/<run-id>.json

Every decision is made in ``runpolicy``; this module only carries them out. It never imports
rich: it reports through ``on_event(level, message)`` and the :class:`RunState` it keeps
current, which the CLI renders as a live panel or as log lines.

This module is the loop; its parts: runstate.py (:class:`RunOptions`, :class:`RunState`),
runstart.py (before the first attempt), launch.py (each attempt's process: a new interpreter or
the warm spare), poll.py (one attempt's poll and the facts of its end), hearing.py (what the
child reports), forward.py (the signals passed to the child, killing its tree), watch.py
(heartbeats, the child's output, a hang's stack dump), restarts.py (work lost, rollback,
diagnosis, the wait to restart).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from smartckpt_cli.config import public_settings
from smartckpt_cli.errors import SmartckptError
from smartckpt_cli.redact import redact_argv
from smartckpt_cli.supervise.child import RunDir, child_env, interpreter_flags_warning
from smartckpt_cli.supervise.childreport import (
    began_at,
    predicted_start,
    script_name,
    settle_resume_check,
    trouble_summary,
)
from smartckpt_cli.supervise.forward import Forwarder, killpg
from smartckpt_cli.supervise.hearing import Hearing
from smartckpt_cli.supervise.launch import Launcher
from smartckpt_cli.supervise.monitor import GpuMonitor, Usage, oom_kills
from smartckpt_cli.supervise.policy import (
    EXIT_CRASH_LOOP,
    EXIT_GAVE_UP,
    AttemptEnd,
    CrashLoop,
    Outcome,
    backoff,
    classify,
)
from smartckpt_cli.supervise.poll import HOOKS_GRACE, Poll, attempt_end, reaper
from smartckpt_cli.supervise.ramowner import RamOwner
from smartckpt_cli.supervise.records import (
    RUNS_DIR,
    AttemptRecord,
    RunRecord,
    StoreView,
    learned_mtbf,
    new_run_id,
)
from smartckpt_cli.supervise.restarts import crash_loop_diagnosis, record_lost, roll_back, wait_to_restart
from smartckpt_cli.supervise.runstart import already_finished, slurm_first_attempt
from smartckpt_cli.supervise.runstate import Emit, RunOptions, RunState
from smartckpt_cli.supervise.watch import relay

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, options: RunOptions, on_event: Emit | None = None) -> None:
        self.opts = options
        self.s = options.settings
        self.emit: Emit = on_event or (lambda level, msg: logger.log(getattr(logging, level.upper()), msg))
        self.run_id = options.run_id or new_run_id()
        self.dir = Path(self.s.dir).resolve()
        self.run_dir = self.dir / RUNS_DIR / self.run_id
        self.store = StoreView(self.dir, self.s.meta_dir)
        # What is written and shown never holds a secret of the command line (--hf-token=...).
        shown = redact_argv(list(options.command))
        self.record = RunRecord(self.run_id, shown, str(self.dir), time.time())
        self.record.settings = public_settings(self.s)
        self.state = RunState(run_id=self.run_id, command=" ".join(shown))
        self.gpu = GpuMonitor()
        self.crash = CrashLoop(limit=self.s.crash_loop)
        self.signals = Forwarder(self.state, self.s.grace_period, self.emit)
        self._start_position = -1
        self._step_seen: dict[int, float] = {}
        self._last_pids: set[int] = set()
        self._last_usage: Usage | None = None
        self._script = script_name(list(options.command))
        self._report: dict[str, Any] | None = None  # what the current attempt's child said it did
        self.ram: RamOwner | None = None  # the RAM tier's area (ramowner.py), made by run()
        # each attempt's process, and warm restarts' next interpreter
        self.launcher = Launcher(options.command, self.emit, piped=options.output is not None)
        # set once the restarted process did its first step (or ended): a flash persist behind
        # it starts writing then (ramowner.persist_behind)
        self._flash_go = threading.Event()

    # ------------------------------------------------------------------ the run

    def run(self) -> int:
        self.store.refuse_damaged()
        done = (
            None if self.opts.resume_finished else already_finished(self.store, self.dir, self.opts.command)
        )
        if done is not None:
            self.emit("info", done)
            self.record.outcome, self.record.exit_code = "finished", 0
            self.state.phase = "finished"
            return 0
        self.run_dir.mkdir(parents=True, exist_ok=True)
        first = slurm_first_attempt(self.s.requeue, self.emit)
        if first is not None and self.opts.first_attempt == 0:
            self.opts.first_attempt = first
        self._start_position = self.store.position()
        warn = interpreter_flags_warning(self.opts.command)
        if warn:
            self.emit("warning", warn)
        self.signals.install()
        self.ram = RamOwner.open(self.s, self.run_id, self.emit)
        if self.s.warm_restart:
            self.launcher.plan_warm()
        try:
            return self._loop()
        finally:
            self._flash_go.set()
            self.launcher.drop()
            if self.ram is not None:
                self.ram.close()
            self.signals.uninstall()
            self.record.ended = time.time()
            # The view's last frame and the summary show one count: the journal's, now.
            self._checkpoint_seen()
            self.record.checkpoints_taken = self.state.checkpoints_taken
            self._save_record()
            self.state.phase = "finished"

    def _loop(self) -> int:
        failures_in_row = 0
        attempt_no = self.opts.first_attempt
        while True:
            att, end = self._attempt(attempt_no)
            outcome = self._judge(att, end)
            if outcome.action != "restart":
                return self._no_restart(att, outcome)
            max_committed = att.max_committed if att.max_committed is not None else att.began
            verdict = self.crash.record(att.began, max_committed)
            if verdict == "stop":
                return self._finish(
                    "crash-loop",
                    EXIT_CRASH_LOOP,
                    crash_loop_diagnosis(att, self.record.attempts, self.s.crash_loop, self.crash.mark),
                    "error",
                )
            progressed = self._restart_point(att, verdict, max_committed > att.began)
            if self.record.restarts >= self.s.max_restarts:
                return self._finish(
                    "gave-up",
                    EXIT_GAVE_UP,
                    f"giving up after {self.record.restarts} restart(s) (max_restarts); last: {outcome.cause}",
                    "error",
                )
            # Failures in a row without progress set the backoff: an attempt that committed past
            # its start restarts at once (its crash says nothing of the next attempt's; every
            # second of waiting is recovery time), one that got nowhere waits, longer each time.
            failures_in_row = 0 if progressed else failures_in_row + 1
            if not self._wait_to_restart(att, outcome, failures_in_row):
                return self._finish(
                    "stopped",
                    128 + int(self.signals.stop or signal.SIGTERM),
                    "stopped while waiting to restart",
                )
            attempt_no += 1
            self.state.restarts += 1

    def _judge(self, att: AttemptRecord, end: AttemptEnd) -> Outcome:
        """What follows the attempt (``policy.classify``), written into its record."""
        outcome = classify(end, patterns=self.s.no_restart_patterns)
        att.category, att.cause, att.exit_code = outcome.category, outcome.cause, outcome.exit_code
        settle_resume_check(att)
        if outcome.category == "oom" and self._last_usage is not None:
            u = self._last_usage
            att.cause += (
                f"; last sample: {u.rss / 2**30:.2f} GiB resident, {u.mem_available / 2**30:.2f} GiB free"
            )
        self.record.attempts.append(att)
        return outcome

    def _no_restart(self, att: AttemptRecord, outcome: Outcome) -> int:
        """The run ends after this attempt: finished, stopped, preempted or failed."""
        if outcome.action != "done" and self.ram is not None:
            # nothing restarts: the dead attempt's RAM snapshot, when newer than the disk's,
            # becomes a checkpoint at once
            att.flash_persisted = self.ram.persist(
                self.dir, self.s.meta_dir, self.store.newest_step(), level=self.s.compression_level
            )
        if outcome.action != "done" and att.max_step is not None:
            # Nothing follows: what a rerun would train again is lost all the same (a Ctrl-C
            # whose save never came, a crash that is not restarted).
            att.restart_from = predicted_start(self._report, self.store.newest_step())
            record_lost(att, self._step_seen)
        if outcome.action == "done":
            return self._finish("finished", 0, f"training finished after {self.record.restarts} restart(s)")
        if outcome.action == "signalled":
            return self._finish("stopped", outcome.exit_code, f"child {outcome.cause}")
        if outcome.action == "preempted":
            return self._preempted(outcome.exit_code, outcome.cause)
        if outcome.category == "remote-unreachable":
            return self._finish("remote-unreachable", outcome.exit_code, outcome.cause, "error")
        return self._finish("failed", outcome.exit_code, f"not restarting: {outcome.cause}", "error")

    def _restart_point(self, att: AttemptRecord, verdict: str, progressed: bool) -> bool:
        """Where the next attempt begins (rolled back, or at the dead attempt's RAM snapshot) and
        what the restart loses; whether the dead attempt ``progressed`` (its snapshot counts)."""
        if verdict == "rollback":
            roll_back(self.store, att, self.s.crash_loop, self.emit)
            if self.ram is not None:  # the RAM snapshot holds the state that kept crashing
                self.ram.discard()
        newest = self.store.newest_step()
        if self.ram is not None and verdict != "rollback":
            # the dead attempt's RAM snapshot, when newer than the disk's, becomes a
            # checkpoint while the next attempt starts (its first commit waits for it)
            self._flash_go = threading.Event()
            writing = self.ram.persist_behind(
                self.dir,
                self.s.meta_dir,
                newest,
                level=self.s.compression_level,
                done=functools.partial(setattr, att, "flash_persisted"),
                after=self._flash_go,
            )
            newest = max(newest, writing or 0)
            progressed = progressed or (writing or 0) > att.began  # its snapshot: a checkpoint
        # Where the next attempt begins: the newest checkpoint, or step 0 when this one did
        # not restore through start_step() (corrected once the next one reports).
        att.restart_from = predicted_start(self._report, newest)
        record_lost(att, self._step_seen)
        return progressed

    def _wait_to_restart(self, att: AttemptRecord, outcome: Outcome, failures_in_row: int) -> bool:
        """Say the restart, record it, and wait the backoff; False: stopped while waiting."""
        att.delay = backoff(failures_in_row, self.s.restart_backoff)
        lost = f"{att.steps_lost} step(s), " if att.steps_lost is not None else ""
        at = f" at step {att.max_step}" if att.max_step is not None else ""
        when = f"in {att.delay:.1f} s" if att.delay > 0 else "now"
        self.emit(
            "warning",
            f"attempt {att.attempt} ended{at}: {outcome.cause}; lost {lost}{att.seconds_lost or 0:.1f} s of work; "
            f"restarting from step {att.restart_from} {when} "
            f"(restart {self.record.restarts + 1} of at most {self.s.max_restarts})",
        )
        self._save_record()
        self.state.phase = "restarting"
        return wait_to_restart(self.gpu, self._last_pids, att.delay, self.signals.take_stop, self.emit)

    def _preempted(self, code: int, cause: str) -> int:
        """The child saved and exited after USR1/USR2: requeue the SLURM job when asked to
        (``smartckpt_cli.supervise.slurm``'s order of calls), then exit 0 and let SLURM end the step."""
        if not self.s.requeue:
            return self._finish("preempted", code, f"{cause}; not requeued (requeue is off)")
        try:
            slurm = importlib.import_module("smartckpt_cli.supervise.slurm")
            done = slurm.requeue()
        except (SmartckptError, ImportError) as err:
            return self._finish("preempted", code, f"{cause}; requeue failed: {err}", "error")
        return self._finish("requeued", 0, f"{cause}; job {done.target} requeued")

    def _finish(self, outcome: str, code: int, message: str, level: str = "info") -> int:
        self.record.outcome, self.record.exit_code = outcome, code
        if outcome in ("crash-loop", "failed", "gave-up"):
            self.record.diagnosis = message
        self.emit(level, message)
        trouble = trouble_summary(self.record.attempts)
        if trouble:  # a run that "finished" without checkpoints must not read as a clean one
            self.emit("warning", f"during this run: {trouble}")
        return code

    # ------------------------------------------------------------------ one attempt

    def _attempt(self, attempt: int) -> tuple[AttemptRecord, AttemptEnd]:
        """One attempt: start the child, poll it until it exits, and gather how it ended."""
        start_step = self.store.newest_step()  # what a restore would load; the child says
        position = self.store.position()
        t_start = time.time()
        files = RunDir(self.run_dir)
        files.mark(t_start)
        oom_before = oom_kills()
        proc, warm = self.launcher.spawn(attempt, self._env(attempt, self._mtbf()))
        died = reaper(proc)  # the moment of death, for the record's "detection" phase
        relay_thread = relay(proc, self.opts.output)
        att = AttemptRecord(attempt, proc.pid, t_start, newest_checkpoint=start_step, warm=warm)
        self._started(att)
        heard = Hearing(
            att,
            files,
            self.state,
            self.emit,
            self._script,
            self._flash_go,
            self._save_record,
            prev=self.record.attempts[-1] if self.record.attempts else None,
            prev_seen=self._step_seen,
        )
        poll = Poll.start(
            proc.pid,
            att,
            files,
            self.state,
            self.emit,
            hang_timeout=self.s.hang_timeout,
            first_step_timeout=self.s.first_step_timeout,
        )
        self._watch(proc, poll, heard)
        self._gone(proc, poll, heard, died, relay_thread)
        committed = self.store.commits_since(position)
        att.max_committed = max([*committed, att.began])
        self._checkpoint_seen()
        att.error = files.error()
        return att, attempt_end(proc.returncode, att, committed, poll, self.signals, oom_before)

    def _mtbf(self) -> float | None:
        """The MTBF the child is told, learned from the earlier attempts and runs (kept in the
        record); None when the settings name one."""
        mtbf = None if "mtbf" in self.opts.sources else learned_mtbf(self.dir, self.record)
        self.record.mtbf = mtbf if mtbf is not None else self.record.mtbf
        return mtbf

    def _started(self, att: AttemptRecord) -> None:
        """A new child runs: the view starts afresh, and it is said."""
        self.state.attempt, self.state.pid, self.state.phase = att.attempt, att.pid, "running"
        self.state.step, self.state.loss, self.state.heartbeat = None, None, False
        self.state.rate = None
        self.state.trouble, self.state.trouble_detail = 0, {}
        start_step = att.newest_checkpoint
        newest = f" (newest checkpoint: step {start_step})" if start_step else ""
        how = " in the warm spare" if att.warm else ""
        self.emit("info", f"attempt {att.attempt}: started pid {att.pid}{how}{newest}")
        self.signals.preempt, self.signals.stopping_since = None, None

    def _watch(self, proc: subprocess.Popen[bytes], poll: Poll, heard: Hearing) -> None:
        """Poll the child until it exits: signals passed on, its heartbeats, what it reports, the
        next attempt's spare, and once a second its use of the machine and the store."""
        att = poll.att
        while proc.poll() is None:
            now = time.monotonic()
            self.signals.forward(proc.pid)
            poll.grace_over(self.signals, now)
            poll.listen(now, stopping=self.signals.stop is not None)
            if began_at(att) is None:  # where it began: said as soon as the child says it
                heard.hear()
            self._tend_spare(att)
            if poll.due(now):
                heard.hear()
                self.state.usage = poll.sample(self.gpu)
                self._checkpoint_seen()
            time.sleep(self.opts.poll)

    def _gone(
        self,
        proc: subprocess.Popen[bytes],
        poll: Poll,
        heard: Hearing,
        died: Callable[[float], float | None],
        relay_thread: threading.Thread | None,
    ) -> None:
        """The child exited: when it died, its last words and steps, and the rest of its group killed."""
        att = poll.att
        att.ended = time.time()
        att.returncode = proc.returncode
        self._flash_go.set()  # a flash persist deferred for this attempt's first step: now
        when = died(1.0)
        if when is not None:
            att.died = min(when, att.ended)
        heard.hear()
        self._report = heard.report
        if relay_thread is not None:
            relay_thread.join(timeout=5.0)  # the rest of the output (orphans may keep the pipe open)
        poll.last_beat()
        self._step_seen = poll.step_seen
        self._last_pids, self._last_usage = poll.pids, poll.usage
        # Whatever is left of the dead attempt's group (DataLoader workers, torchrun workers)
        # would hold the store's writer lock and GPU memory: it goes with it.
        if proc.returncode != 0:
            killpg(proc.pid, signal.SIGKILL)

    def _env(self, attempt: int, mtbf: float | None) -> dict[str, str]:
        env = child_env(
            dict(os.environ),
            self.s,
            self.opts.sources,
            store_dir=self.dir,
            run_dir=self.run_dir,
            run_id=self.run_id,
            attempt=attempt,
            mtbf=mtbf,
        )
        if self.ram is not None:
            env.update(self.ram.env())
        if self.opts.output is not None:
            env.setdefault("PYTHONUNBUFFERED", "1")  # a pipe would hold its lines back until exit
        return env

    def _tend_spare(self, att: AttemptRecord) -> None:
        """Start the next attempt's spare once this one did its first step, and say once that it
        is ready, or why it failed. Not before: its imports would compete for the cores with this
        one's imports, restore and first step (a heartbeat is no sign of training: the restore
        beats too; on 2 cores a spare started then slowed a warm restart's restore and first
        resumed step, docs/recovery.md)."""
        began, step = began_at(att), self.state.step
        stepped = began is not None and step is not None and step > began
        # with the hooks live a step says it trains; without them, only time can
        training = stepped or (not self.state.hooks_live and time.time() - att.started > HOOKS_GRACE)
        self.launcher.tend(
            training and len(self.record.attempts) < self.s.max_restarts,
            lambda: self._env(att.attempt + 1, self.record.mtbf),
        )

    def _checkpoint_seen(self) -> None:
        newest = self.store.newest_step()
        if newest != self.state.checkpoint_step:
            self.state.checkpoint_step, self.state.checkpoint_seen = newest, time.time()
        self.state.checkpoints_taken = len(self.store.commits_since(self._start_position))

    def _save_record(self) -> None:
        try:
            self.record.save()
        except OSError as err:
            self.emit("warning", f"cannot write the run record {self.record.path()}: {err}")
