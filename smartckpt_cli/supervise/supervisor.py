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
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smartckpt_cli.config import Settings
from smartckpt_cli.errors import SmartckptError
from smartckpt_cli.hooks import _smartckpt_protocol as proto
from smartckpt_cli.supervise.child import RunDir, alive, child_env, hooks_dir, interpreter_flags_warning
from smartckpt_cli.supervise.monitor import GpuMonitor, TreeMonitor, Usage, near_memory_limit, oom_kills
from smartckpt_cli.supervise.policy import (
    EXIT_CRASH_LOOP,
    EXIT_GAVE_UP,
    AttemptEnd,
    CrashLoop,
    HangClock,
    backoff,
    classify,
)
from smartckpt_cli.supervise.records import (
    RUNS_DIR,
    AttemptRecord,
    RunRecord,
    StoreView,
    learned_mtbf,
    new_run_id,
)

__all__ = ["RunOptions", "RunState", "Supervisor"]

logger = logging.getLogger(__name__)

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
HOOKS_GRACE = 20.0  # seconds after start without a hooks file before warning that hooks are not live
STACK_WAIT = 5.0  # seconds to wait for a stack dump after SIGQUIT

Emit = Callable[[str, str], None]


@dataclass
class RunOptions:
    command: list[str]  # the full child command (``python train.py ...`` already expanded)
    settings: Settings
    sources: dict[str, str] = field(default_factory=dict)  # load_settings' sources
    run_id: str | None = None
    first_attempt: int = 0
    poll: float = 0.2
    # Where the child's output goes: None = inherited (straight to our stdout/stderr); a callable
    # gets each line (stdout and stderr merged), so a live panel can print above itself.
    output: Callable[[str], None] | None = None


@dataclass
class RunState:
    """What the CLI shows; updated in place by the supervisor."""

    run_id: str = ""
    command: str = ""
    attempt: int = 0
    restarts: int = 0
    pid: int | None = None
    phase: str = "starting"  # starting | running | stopping | restarting | finished
    step: int | None = None
    loss: float | None = None
    child_state: str = ""
    heartbeat: bool = False
    hooks_live: bool = False
    checkpoint_step: int | None = None
    checkpoint_seen: float | None = None  # wall time the supervisor first saw that checkpoint
    checkpoints_taken: int = 0
    hang_timeout: float | None = None
    usage: Usage = field(default_factory=Usage)
    started: float = field(default_factory=time.time)


class Supervisor:
    def __init__(self, options: RunOptions, on_event: Emit | None = None) -> None:
        self.opts = options
        self.s = options.settings
        self.emit: Emit = on_event or (lambda level, msg: logger.log(getattr(logging, level.upper()), msg))
        self.run_id = options.run_id or new_run_id()
        self.dir = Path(self.s.dir).resolve()
        self.run_dir = self.dir / RUNS_DIR / self.run_id
        self.store = StoreView(self.dir, self.s.meta_dir)
        self.record = RunRecord(self.run_id, list(options.command), str(self.dir), time.time())
        self.state = RunState(run_id=self.run_id, command=" ".join(options.command))
        self.gpu = GpuMonitor()
        self.crash = CrashLoop(limit=self.s.crash_loop)
        self._pending: list[int] = []
        self._stop: int | None = None  # TERM/INT received
        self._preempt: int | None = None  # USR1/USR2 received during this attempt
        self._previous: dict[int, Any] = {}
        self._start_position = -1
        self._stopping_since: float | None = None
        self._step_seen: dict[int, float] = {}
        self._last_pids: set[int] = set()
        self._last_usage: Usage | None = None

    # ------------------------------------------------------------------ the run

    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._slurm_job()
        self._start_position = self.store.position()
        warn = interpreter_flags_warning(self.opts.command)
        if warn:
            self.emit("warning", warn)
        self._install()
        try:
            return self._loop()
        finally:
            self._uninstall()
            self.record.ended = time.time()
            self.record.checkpoints_taken = len(self.store.commits_since(self._start_position))
            self._save_record()
            self.state.phase = "finished"

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
            if outcome.category == "oom" and self._last_usage is not None:
                u = self._last_usage
                att.cause += (
                    f"; last sample: {u.rss / 2**30:.2f} GiB resident, {u.mem_available / 2**30:.2f} GiB free"
                )
            self.record.attempts.append(att)
            if outcome.action == "done":
                return self._finish(
                    "finished", 0, f"training finished after {self.record.restarts} restart(s)"
                )
            if outcome.action == "signalled":
                return self._finish("stopped", outcome.exit_code, f"child {outcome.cause}")
            if outcome.action == "preempted":
                return self._preempted(outcome.exit_code, outcome.cause)
            if outcome.action == "stop":
                return self._finish(
                    "failed", outcome.exit_code, f"not restarting: the child {outcome.cause}", "error"
                )
            # restart
            max_committed = att.max_committed if att.max_committed is not None else att.start_step
            verdict = self.crash.record(att.start_step, max_committed)
            failures_in_row = 1 if max_committed > att.start_step else failures_in_row + 1
            if verdict == "stop":
                return self._finish("crash-loop", EXIT_CRASH_LOOP, self._diagnosis(att), "error")
            if verdict == "rollback":
                self._rollback(att)
            att.restart_from = self.store.newest_step()
            self._lost(att)
            if self.record.restarts >= self.s.max_restarts:
                return self._finish(
                    "gave-up",
                    EXIT_GAVE_UP,
                    f"giving up after {self.record.restarts} restart(s) (max_restarts); last: {outcome.cause}",
                    "error",
                )
            att.delay = backoff(failures_in_row, self.s.restart_backoff)
            lost = f"{att.steps_lost} step(s), " if att.steps_lost is not None else ""
            self.emit(
                "warning",
                f"attempt {att.attempt} {outcome.cause}; lost {lost}{att.seconds_lost or 0:.1f} s of work; "
                f"restarting from step {att.restart_from} in {att.delay:.1f} s "
                f"(restart {self.record.restarts + 1} of at most {self.s.max_restarts})",
            )
            self._save_record()
            self.state.phase = "restarting"
            if not self._between_attempts(att):
                return self._finish(
                    "stopped", 128 + int(self._stop or signal.SIGTERM), "stopped while waiting to restart"
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
        return code

    # ------------------------------------------------------------------ one attempt

    def _attempt(self, attempt: int) -> tuple[AttemptRecord, AttemptEnd]:
        start_step = self.store.newest_step()
        position = self.store.position()
        t_start = time.time()
        files = RunDir(self.run_dir)
        files.mark(t_start)
        oom_before = oom_kills()
        mtbf = None if "mtbf" in self.opts.sources else learned_mtbf(self.dir, self.record)
        self.record.mtbf = mtbf if mtbf is not None else self.record.mtbf
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
        pipe = subprocess.PIPE if self.opts.output is not None else None
        if pipe:
            env.setdefault("PYTHONUNBUFFERED", "1")  # a pipe would hold its lines back until exit
        proc = subprocess.Popen(
            self.opts.command,
            env=env,
            start_new_session=True,
            stdout=pipe,
            stderr=subprocess.STDOUT if pipe else None,
        )
        relay = self._relay(proc)
        att = AttemptRecord(attempt, proc.pid, t_start, start_step)
        self.state.attempt, self.state.pid, self.state.phase = attempt, proc.pid, "running"
        self.state.step, self.state.loss, self.state.heartbeat = None, None, False
        self.emit("info", f"attempt {attempt}: started pid {proc.pid} (restores step {start_step})")
        self._preempt, self._stopping_since = None, None
        tree = TreeMonitor(proc.pid)
        pids: set[int] = {proc.pid}
        clock = HangClock(override=self.s.hang_timeout)
        clock.start(time.monotonic())
        step_seen: dict[int, float] = {start_step: t_start}
        hung = warned_hooks = warned_beat = False
        usage: Usage | None = None
        last_sample = 0.0
        while proc.poll() is None:
            now = time.monotonic()
            self._forward(proc.pid)
            if (
                self._stop is not None
                and self._stopping_since is not None
                and now - self._stopping_since > self.s.grace_period
            ):
                self.emit("warning", f"grace period of {self.s.grace_period:g} s over: killing the child")
                _killpg(proc.pid, signal.SIGKILL)
                self._stopping_since = float("inf")
            beats = files.beats()
            hooks = files.hooks_pids()
            self.state.hooks_live = bool(hooks)
            if beats:
                self._observe(beats, clock, now, att, step_seen)
            elif time.time() - t_start > HOOKS_GRACE and not warned_beat:
                warned_beat = True
                self.emit(
                    "warning",
                    "no heartbeat from the child yet: hang detection is off until one arrives "
                    "(are the hooks live? see the warning above)"
                    if not hooks
                    else "no heartbeat from the child yet: hang detection is off until the first step",
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
            self.state.hang_timeout = clock.timeout() if beats else None
            if beats and self._stop is None and not hung and clock.hung(now):
                hung = True
                self._hang_kill(proc.pid, clock, att, hooks, files)
            if now - last_sample >= 1.0:
                last_sample = now
                usage = tree.sample()
                self.gpu.sample(usage, set(tree.pids()))
                pids.update(tree.pids())
                self.state.usage = usage
                self._checkpoint_seen(position)
            time.sleep(self.opts.poll)
        att.ended = time.time()
        att.returncode = proc.returncode
        if relay is not None:
            relay.join(timeout=5.0)  # the rest of the output (orphans may keep the pipe open)
        last = files.max_step()
        if last is not None:
            att.max_step = max(att.max_step or 0, last)
            step_seen.setdefault(last, att.ended)
        self._step_seen = step_seen
        self._last_pids, self._last_usage = pids, usage
        # Whatever is left of the dead attempt's group (DataLoader workers, torchrun workers)
        # would hold the store's writer lock and GPU memory: it goes with it.
        if proc.returncode != 0:
            _killpg(proc.pid, signal.SIGKILL)
        committed = self.store.commits_since(position)
        att.max_committed = max([*committed, start_step])
        self._checkpoint_seen(position)
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
        stop = self._stop if self._stop is not None and self._stopping_since is not None else None
        end = AttemptEnd(proc.returncode, progressed, error, hung, stop, self._preempt, oom)
        return att, end

    def _relay(self, proc: subprocess.Popen[bytes]) -> threading.Thread | None:
        out, sink = proc.stdout, self.opts.output
        if out is None or sink is None:
            return None

        def pump() -> None:
            for raw in iter(out.readline, b""):
                sink(raw.decode(errors="replace").rstrip("\n"))
            out.close()

        t = threading.Thread(target=pump, name="smartckpt-child-output", daemon=True)
        t.start()
        return t

    def _observe(
        self,
        beats: list[proto.Beat],
        clock: HangClock,
        now: float,
        att: AttemptRecord,
        seen: dict[int, float],
    ) -> None:
        step = min(b.step for b in beats)
        paused = any(b.state in (proto.SAVING, proto.RESTORING) for b in beats)
        clock.observe(step, paused, now)
        lead = min(beats, key=lambda b: (b.rank if b.rank >= 0 else 0, b.pid))
        self.state.heartbeat = True
        self.state.step, self.state.child_state = step, lead.state_name
        self.state.loss = lead.loss if lead.loss == lead.loss else None
        att.max_step = max(att.max_step or 0, step)
        seen.setdefault(step, time.time())

    def _checkpoint_seen(self, position: int) -> None:
        newest = self.store.newest_step()
        if newest != self.state.checkpoint_step:
            self.state.checkpoint_step, self.state.checkpoint_seen = newest, time.time()
        self.state.checkpoints_taken = len(self.store.commits_since(self._start_position))

    def _hang_kill(
        self, pid: int, clock: HangClock, att: AttemptRecord, hooks: list[int], files: RunDir
    ) -> None:
        self.emit(
            "warning",
            f"the child hangs: no progress past step {clock.last_step} for "
            f"{clock.timeout() or 0:.0f} s (hang timeout); dumping stacks and killing it",
        )
        live = [p for p in hooks if alive(p)]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, getattr(signal, proto.STACK_SIGNAL_NAME))
        dumps: list[str] = []
        deadline = time.monotonic() + STACK_WAIT
        while live and time.monotonic() < deadline and len(dumps) < len(live):
            dumps = [files.stacks(p) for p in live]
            dumps = [d for d in dumps if os.path.exists(d) and os.path.getsize(d) > 0]
            time.sleep(0.2)
        time.sleep(0.3)  # let faulthandler finish writing
        if dumps:
            att.stacks = dumps[0]
            head = Path(dumps[0]).read_text(errors="replace").splitlines()[:25]
            self.emit("warning", f"stacks of the hung child in {', '.join(dumps)}:\n" + "\n".join(head))
        else:
            self.emit("warning", "no stack dump: the hooks are not live in the hung process")
        _killpg(pid, signal.SIGKILL)

    # ------------------------------------------------------------------ between attempts

    def _lost(self, att: AttemptRecord) -> None:
        """Steps and wall time the restart throws away: from the checkpoint it restores to the
        attempt's death (the whole attempt when it never reached that checkpoint)."""
        frm = att.restart_from if att.restart_from is not None else att.start_step
        if att.max_step is not None:
            att.steps_lost = max(0, att.max_step - frm)
        # The first time a heartbeat showed the restored step or later (polls skip fast steps).
        seen = [t for step, t in self._step_seen.items() if step >= frm]
        reached = min(seen) if seen and frm >= att.start_step else None
        att.seconds_lost = att.ended - (reached if reached is not None else att.started)

    def _rollback(self, att: AttemptRecord) -> None:
        steps = self.store.live_steps()
        bad = att.start_step
        prev = next((s for s in steps if s < bad), 0)
        why = (
            f"crash loop: {self.s.crash_loop} attempts died without getting past the checkpoint of step {bad}"
        )
        self.store.rollback(prev, why)
        att.rollback_to = prev
        self.emit(
            "warning", f"{why}; rolled back to step {prev} (the checkpoint of step {bad} is kept, marked)"
        )

    def _diagnosis(self, att: AttemptRecord) -> str:
        stuck = [
            a for a in self.record.attempts if a.start_step == att.start_step or a.rollback_to is not None
        ]
        causes = sorted({a.cause for a in self.record.attempts[-self.s.crash_loop - 1 :] if a.cause})
        where = f"step {att.max_step}" if att.max_step is not None else "an unknown step"
        rb = next((a.rollback_to for a in reversed(self.record.attempts) if a.rollback_to is not None), None)
        text = (
            f"crash loop: attempts keep dying at {where} without getting past the checkpoint of step "
            f"{self.crash.mark if self.crash.mark is not None else att.start_step}"
        )
        if rb is not None:
            text += f"; rolling back to step {rb} did not help"
        text += f" ({len(stuck)} attempts; cause: {'; '.join(causes)}). "
        text += "The failure is deterministic at that point of training: look at the data at that step"
        if att.stacks:
            text += f" and the stack dump {att.stacks}"
        elif att.error:
            text += f" and the error: {att.error.get('type')}: {att.error.get('message')}"
        return text + ". Not restarting."

    def _between_attempts(self, att: AttemptRecord) -> bool:
        """Wait for the GPU memory of the dead attempt and the backoff; False when stopped."""
        freed, waited = self.gpu.wait_freed(self._last_pids, timeout=120.0)
        if waited > 0.5:
            self.emit("info", f"waited {waited:.1f} s for the dead attempt's GPU memory to be freed")
        if not freed:
            self.emit(
                "warning", "GPU memory of the dead attempt is still held after 120 s; restarting anyway"
            )
        deadline = time.monotonic() + att.delay
        while time.monotonic() < deadline:
            if self._take_stop():
                return False
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return not self._take_stop()

    def _take_stop(self) -> bool:
        while self._pending:
            sig = self._pending.pop(0)
            if sig in STOP_SIGNALS:
                self._stop = sig
                return True
        return False

    # ------------------------------------------------------------------ signals

    def _install(self) -> None:
        for sig in FORWARDED:
            self._previous[sig] = signal.signal(sig, self._handler)

    def _uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handler(self, signum: int, _frame: Any) -> None:
        self._pending.append(signum)

    def _forward(self, pid: int) -> None:
        while self._pending:
            sig = self._pending.pop(0)
            name = signal.Signals(sig).name
            if sig in STOP_SIGNALS:
                if self._stopping_since is not None:  # a second one: no more waiting
                    self.emit("warning", f"second {name}: killing the child now")
                    _killpg(pid, signal.SIGKILL)
                    continue
                self._stop, self._stopping_since = sig, time.monotonic()
                self.state.phase = "stopping"
                self.emit(
                    "warning",
                    f"{name} received: passed to the child, which saves and exits "
                    f"(killed after {self.s.grace_period:g} s)",
                )
            else:
                self._preempt = sig
                self.emit("info", f"{name} received: passed to the child")
            _killpg(pid, sig)

    def _save_record(self) -> None:
        try:
            self.record.save()
        except OSError as err:
            self.emit("warning", f"cannot write the run record {self.record.path()}: {err}")


def _killpg(pgid: int, sig: int) -> None:
    # A SIGKILL must reach every descendant: torchrun starts each rank in a session of its own, so
    # the child's process group alone would leave ranks running (holding ports, GPUs, the store).
    # They are listed before the kill, while they are still the child's descendants.
    tree = _descendants(pgid) if sig == signal.SIGKILL else []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []
