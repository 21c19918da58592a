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
forward.py (the signals passed to the child, killing its tree), watch.py (heartbeats, the child's
output, a hang's stack dump), restarts.py (work lost, rollback, diagnosis, the wait to restart).
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
from pathlib import Path
from typing import Any

from smartckpt_cli.config import public_settings
from smartckpt_cli.errors import SmartckptError
from smartckpt_cli.hooks import _smartckpt_protocol as proto
from smartckpt_cli.redact import redact_argv
from smartckpt_cli.supervise.child import RunDir, child_env, hooks_dir, interpreter_flags_warning
from smartckpt_cli.supervise.childreport import (
    lead_report,
    learn,
    predicted_start,
    script_name,
    start_line,
    trouble_lines,
    trouble_summary,
    unchecked_resume,
)
from smartckpt_cli.supervise.forward import Forwarder, killpg
from smartckpt_cli.supervise.monitor import GpuMonitor, TreeMonitor, Usage, near_memory_limit, oom_kills
from smartckpt_cli.supervise.pace import Pace
from smartckpt_cli.supervise.policy import (
    EXIT_CRASH_LOOP,
    EXIT_GAVE_UP,
    AttemptEnd,
    CrashLoop,
    HangClock,
    backoff,
    classify,
)
from smartckpt_cli.supervise.ramowner import RamOwner
from smartckpt_cli.supervise.records import (
    RUNS_DIR,
    AttemptRecord,
    RunRecord,
    StoreView,
    learned_mtbf,
    new_run_id,
    read_records,
)
from smartckpt_cli.supervise.restarts import crash_loop_diagnosis, record_lost, roll_back, wait_to_restart
from smartckpt_cli.supervise.runstate import Emit, RunOptions, RunState
from smartckpt_cli.supervise.warm import Spare, WarmPlan, warm_plan
from smartckpt_cli.supervise.watch import hang_kill, observe, relay

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)

HOOKS_GRACE = 20.0  # seconds after start without a hooks file before warning that hooks are not live
SPARE_WAIT = 120.0  # seconds a restart waits for a spare still importing before starting cold


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
        self._warm: WarmPlan | None = None  # how a spare runs the command; None: restarts start cold
        self.spare: Spare | None = None  # the next attempt's interpreter, importing or ready
        self._spare_said = False
        # set once the restarted process did its first step (or ended): a flash persist behind
        # it starts writing then (ramowner.persist_behind)
        self._flash_go = threading.Event()

    # ------------------------------------------------------------------ the run

    def run(self) -> int:
        self.store.refuse_damaged()
        done = self._already_finished()
        if done is not None:
            self.emit("info", done)
            self.record.outcome, self.record.exit_code = "finished", 0
            self.state.phase = "finished"
            return 0
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._slurm_job()
        self._start_position = self.store.position()
        warn = interpreter_flags_warning(self.opts.command)
        if warn:
            self.emit("warning", warn)
        self.signals.install()
        self.ram = RamOwner.open(self.s, self.run_id, self.emit)
        if self.s.warm_restart:
            plan = warm_plan(self.opts.command)
            if isinstance(plan, str):
                self.emit("info", f"warm restart off: {plan}; a restart starts a new interpreter")
            else:
                self._warm = plan
        try:
            return self._loop()
        finally:
            self._flash_go.set()
            self._drop_spare()
            if self.ram is not None:
                self.ram.close()
            self.signals.uninstall()
            self.record.ended = time.time()
            # The view's last frame and the summary show one count: the journal's, now.
            self._checkpoint_seen()
            self.record.checkpoints_taken = self.state.checkpoints_taken
            self._save_record()
            self.state.phase = "finished"

    def _already_finished(self) -> str | None:
        """The same command again on a store whose last run finished with a final checkpoint:
        a loop that tests its end after a step (``while True`` with its own counter) would
        train one more step every time. Nothing to do, unless ``resume_finished``."""
        if self.opts.resume_finished:
            return None
        newest = self.store.newest()
        if newest is None or newest.reason != "final":
            return None
        runs = sorted(read_records(self.dir), key=lambda r: r.get("started") or 0)
        last = runs[-1] if runs else None
        if (
            last is None
            or last.get("outcome") != "finished"
            or last.get("command") != list(self.opts.command)
        ):
            return None
        return (
            f"the training in {self.dir} already finished: run {last.get('run_id')} ended at step "
            f"{newest.step} with its final checkpoint; nothing to do (to train on from it, pass "
            "--resume-finished; to start over, use another --dir)"
        )

    def _slurm_job(self) -> None:
        """Under SLURM the first attempt number is SLURM_RESTART_COUNT (one record per job run)."""
        try:
            slurm = importlib.import_module("smartckpt_cli.supervise.slurm")
            job = slurm.job_from_env()
        except (SmartckptError, ImportError) as err:
            if self.s.requeue:
                self.emit("warning", f"requeue: {err}")
            return
        if job is None:
            if self.s.requeue:
                self.emit("warning", "requeue is on but this is not a SLURM job: nothing will be requeued")
            return
        if self.opts.first_attempt == 0:
            self.opts.first_attempt = job.restart_count
        self.emit("info", f"SLURM job {job.requeue_target}, run {job.restart_count} (SLURM_RESTART_COUNT)")

    def _loop(self) -> int:
        failures_in_row = 0
        attempt_no = self.opts.first_attempt
        while True:
            att, end = self._attempt(attempt_no)
            outcome = classify(end, patterns=self.s.no_restart_patterns)
            att.category, att.cause, att.exit_code = outcome.category, outcome.cause, outcome.exit_code
            att.resume_check = att.resume_check or unchecked_resume(att)
            if outcome.category == "oom" and self._last_usage is not None:
                u = self._last_usage
                att.cause += (
                    f"; last sample: {u.rss / 2**30:.2f} GiB resident, {u.mem_available / 2**30:.2f} GiB free"
                )
            self.record.attempts.append(att)
            if outcome.action not in ("done", "restart") and self.ram is not None:
                # nothing restarts: the dead attempt's RAM snapshot, when newer than the disk's,
                # becomes a checkpoint at once
                att.flash_persisted = self.ram.persist(
                    self.dir, self.s.meta_dir, self.store.newest_step(), level=self.s.compression_level
                )
            if outcome.action not in ("done", "restart") and att.max_step is not None:
                # Nothing follows: what a rerun would train again is lost all the same (a Ctrl-C
                # whose save never came, a crash that is not restarted).
                att.restart_from = predicted_start(self._report, self.store.newest_step())
                record_lost(att, self._step_seen)
            if outcome.action == "done":
                return self._finish(
                    "finished", 0, f"training finished after {self.record.restarts} restart(s)"
                )
            if outcome.action == "signalled":
                return self._finish("stopped", outcome.exit_code, f"child {outcome.cause}")
            if outcome.action == "preempted":
                return self._preempted(outcome.exit_code, outcome.cause)
            if outcome.action == "stop" and outcome.category == "remote-unreachable":
                return self._finish("remote-unreachable", outcome.exit_code, outcome.cause, "error")
            if outcome.action == "stop":
                return self._finish("failed", outcome.exit_code, f"not restarting: {outcome.cause}", "error")
            # restart
            max_committed = att.max_committed if att.max_committed is not None else att.began
            verdict = self.crash.record(att.began, max_committed)
            progressed = max_committed > att.began
            if verdict == "stop":
                return self._finish(
                    "crash-loop",
                    EXIT_CRASH_LOOP,
                    crash_loop_diagnosis(att, self.record.attempts, self.s.crash_loop, self.crash.mark),
                    "error",
                )
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
            if not wait_to_restart(self.gpu, self._last_pids, att.delay, self.signals.take_stop, self.emit):
                return self._finish(
                    "stopped",
                    128 + int(self.signals.stop or signal.SIGTERM),
                    "stopped while waiting to restart",
                )
            attempt_no += 1
            self.state.restarts += 1

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
        start_step = self.store.newest_step()  # what a restore would load; the child says
        position = self.store.position()
        t_start = time.time()
        files = RunDir(self.run_dir)
        files.mark(t_start)
        oom_before = oom_kills()
        mtbf = None if "mtbf" in self.opts.sources else learned_mtbf(self.dir, self.record)
        self.record.mtbf = mtbf if mtbf is not None else self.record.mtbf
        env = self._env(attempt, mtbf)
        proc, warm = self._spawn(attempt, env)
        reaped = threading.Event()
        died: list[float] = []

        def reap() -> None:  # the moment of death, for the record's "detection" phase
            proc.wait()
            died.append(time.time())
            reaped.set()

        threading.Thread(target=reap, name="smartckpt-reaper", daemon=True).start()
        relay_thread = relay(proc, self.opts.output)
        att = AttemptRecord(attempt, proc.pid, t_start, newest_checkpoint=start_step, warm=warm)
        self._report = None
        self.state.attempt, self.state.pid, self.state.phase = attempt, proc.pid, "running"
        self.state.step, self.state.loss, self.state.heartbeat = None, None, False
        self.state.rate = None
        self.state.trouble, self.state.trouble_detail = 0, {}
        newest = f" (newest checkpoint: step {start_step})" if start_step else ""
        how = " in the warm spare" if warm else ""
        self.emit("info", f"attempt {attempt}: started pid {proc.pid}{how}{newest}")
        fwd = self.signals
        fwd.preempt, fwd.stopping_since = None, None
        tree = TreeMonitor(proc.pid)
        pids: set[int] = {proc.pid}
        clock = HangClock(override=self.s.hang_timeout, first_step=self.s.first_step_timeout)
        clock.start(time.monotonic())
        pace = Pace()
        step_seen: dict[int, float] = {start_step: t_start}
        hung = warned_hooks = warned_beat = False
        usage: Usage | None = None
        last_sample = 0.0
        while proc.poll() is None:
            now = time.monotonic()
            fwd.forward(proc.pid)
            if (
                fwd.stop is not None
                and fwd.stopping_since is not None
                and now - fwd.stopping_since > fwd.grace_period
            ):
                self.emit("warning", f"grace period of {self.s.grace_period:g} s over: killing the child")
                killpg(proc.pid, signal.SIGKILL)
                fwd.stopping_since = float("inf")
            seen = files.beats()
            # A process that said DONE has finished training (what follows it, an evaluation or
            # saving the model, is no hang): it counts as a heartbeat, not as a step.
            beats = [b for b in seen if b.state != proto.DONE]
            hooks = files.hooks_pids()
            self.state.hooks_live = bool(hooks)
            if beats:
                observe(beats, clock, now, att, step_seen, self.state, pace)
            elif seen:
                self.state.heartbeat, self.state.child_state = True, "done"
            elif time.time() - t_start > HOOKS_GRACE and not warned_beat and att.max_step is None:
                warned_beat = True
                self.emit(
                    "warning",
                    "no heartbeat from the child yet: hang detection is off until one arrives "
                    "(are the hooks live? see the warning above)"
                    if not hooks
                    else "no heartbeat from the child yet: it counts as hung if it does not reach its first "
                    f"step within {self.s.first_step_timeout:g} s (first_step_timeout)",
                )
            if not hooks and not warned_hooks and time.time() - t_start > HOOKS_GRACE:
                warned_hooks = True
                self.emit(
                    "warning",
                    f"smartckpt's hooks are not live in the child (no hooks file in {self.run_dir}): "
                    "the interpreter ignored PYTHONPATH (-I, -E, -S), is not Python, or the "
                    f"sitecustomize in {hooks_dir()} is missing; run the script with a plain "
                    "`python`, or use a CheckpointManager in the script",
                )
            # Before the first heartbeat the clock runs too, once the hooks are live in the child
            # (it is a training: a job stuck before its first step is a hang after
            # first_step_timeout); without hooks nothing says what a step is.
            watched = bool(beats) or (bool(hooks) and att.max_step is None)
            self.state.hang_timeout = clock.timeout() if watched else None
            if watched and fwd.stop is None and not hung and clock.hung(now):
                hung = True
                hang_kill(proc.pid, clock, att, hooks, files, self.emit)
            if att.start_step is None:  # where it began: said as soon as the child says it
                self._hear(att, files)
            self._tend_spare(att, t_start)
            if now - last_sample >= 1.0:
                last_sample = now
                self._hear(att, files)
                usage = tree.sample()
                self.gpu.sample(usage, set(tree.pids()))
                pids.update(tree.pids())
                self.state.usage = usage
                self._checkpoint_seen()
            time.sleep(self.opts.poll)
        att.ended = time.time()
        att.returncode = proc.returncode
        self._flash_go.set()  # a flash persist deferred for this attempt's first step: now
        if reaped.wait(1.0) and died:
            att.died = min(died[0], att.ended)
        self._hear(att, files)
        if relay_thread is not None:
            relay_thread.join(timeout=5.0)  # the rest of the output (orphans may keep the pipe open)
        last = files.max_step()
        if last is not None:
            att.max_step = max(att.max_step or 0, last)
            step_seen.setdefault(last, att.ended)
        self._step_seen = step_seen
        self._last_pids, self._last_usage = pids, usage
        # Whatever is left of the dead attempt's group (DataLoader workers, torchrun workers)
        # would hold the store's writer lock and GPU memory: it goes with it.
        if proc.returncode != 0:
            killpg(proc.pid, signal.SIGKILL)
        committed = self.store.commits_since(position)
        start_step = att.began
        att.max_committed = max([*committed, start_step])
        self._checkpoint_seen()
        error = files.error()
        att.error = error
        progressed: bool | None = None
        if att.max_step is not None:
            progressed = att.max_step > start_step
        if committed and max(committed) > start_step:
            progressed = True
        oom_after = oom_kills()
        oom = proc.returncode == -signal.SIGKILL and (
            (oom_before is not None and oom_after is not None and oom_after > oom_before)
            or near_memory_limit(usage)
        )
        stop = fwd.stop if fwd.stop is not None and fwd.stopping_since is not None else None
        end = AttemptEnd(proc.returncode, progressed, error, hung, stop, fwd.preempt, oom)
        return att, end

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

    def _spawn(self, attempt: int, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], bool]:
        """The attempt's process: the spare, when one is ready for it, else a new interpreter."""
        spare, self.spare = self.spare, None
        if spare is not None:
            proc = spare.launch(env) if spare.wait_ready(SPARE_WAIT) else None
            if proc is not None:
                return proc, True
            self.emit(
                "warning",
                f"attempt {attempt}: no warm restart ({spare.failure}); starting a new interpreter, "
                "and so will later restarts",
            )
            spare.close()
            self._warm = None  # what failed would fail again
        pipe = subprocess.PIPE if self.opts.output is not None else None
        proc = subprocess.Popen(
            self.opts.command,
            env=env,
            start_new_session=True,
            stdout=pipe,
            stderr=subprocess.STDOUT if pipe else None,
        )
        return proc, False

    def _tend_spare(self, att: AttemptRecord, t_start: float) -> None:
        """Start the next attempt's spare once this one did its first step, and say once that it
        is ready, or why it failed. Not before: its imports would compete for the cores with this
        one's imports, restore and first step (a heartbeat is no sign of training: the restore
        beats too; on 2 cores a spare started then slowed a warm restart's restore and first
        resumed step, docs/recovery.md)."""
        if self._warm is None:
            return
        if self.spare is None:
            began, step = att.start_step, self.state.step
            stepped = began is not None and step is not None and step > began
            # with the hooks live a step says it trains; without them, only time can
            training = stepped or (not self.state.hooks_live and time.time() - t_start > HOOKS_GRACE)
            if not training or len(self.record.attempts) >= self.s.max_restarts:
                return
            started = Spare.start(
                self._warm, self._env(att.attempt + 1, self.record.mtbf), piped=self.opts.output is not None
            )
            if isinstance(started, str):
                self.emit("warning", f"warm restart off: no spare interpreter ({started})")
                self._warm = None
            else:
                self.spare = started
            return
        if self.spare.poll():
            info = self.spare.info or {}
            if not self._spare_said:
                self._spare_said = True
                self.emit(
                    "info",
                    f"warm restart: a spare interpreter (pid {info.get('ready')}) waits for the next "
                    f"restart; torch and smartckpt imported in {float(info.get('imported', 0)):.1f} s, "
                    f"{int(info.get('rss', 0)) / 2**20:.0f} MiB resident",
                )
        elif self.spare.failure is not None:
            self.emit(
                "warning", f"warm restart off: {self.spare.failure}; a restart starts a new interpreter"
            )
            self._drop_spare()
            self._warm = None

    def _drop_spare(self) -> None:
        if self.spare is not None:
            self.spare.close()
            self.spare = None

    def _hear(self, att: AttemptRecord, files: RunDir) -> None:
        """What the child says it did (report.<pid>.json): into the record, and said once."""
        report = lead_report(files.reports())
        if report is None:
            return
        self._report = report
        prev = self.record.attempts[-1] if self.record.attempts else None
        new = learn(att, report, self._script, prev)
        if report.get("first_step_done") is not None:
            self._flash_go.set()
        self._trouble_detail(att)
        for level, text in trouble_lines(att, new):
            self.emit(level, text)
        if "start" not in new:
            return
        if prev is not None and att.start_step is not None and prev.restart_from != att.start_step:
            # the restart began elsewhere than expected: what the dead attempt lost is counted again
            prev.restart_from = att.start_step
            record_lost(prev, self._step_seen)
            self._save_record()
        said = start_line(att, report, self._script, prev, corrected="corrected" in new)
        if said is not None:
            self.emit(*said)

    def _trouble_detail(self, att: AttemptRecord) -> None:
        """The reasons behind the heartbeat's trouble flags, for the status line."""
        detail = self.state.trouble_detail
        detail.clear()
        if att.checkpointing_off is not None:
            detail[proto.CHECKPOINTING_OFF] = (
                f"since step {att.checkpointing_off.get('step')}: {att.checkpointing_off.get('why')}"
            )
        if att.save_failures is not None:
            detail[proto.SAVE_FAILING] = (
                f"{att.save_failures.get('count')} failed, last: {att.save_failures.get('last')}"
            )
        if att.io_error is not None:
            detail[proto.IO_FAILING] = f"{att.io_error.get('what')}: {att.io_error.get('error')}"

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
