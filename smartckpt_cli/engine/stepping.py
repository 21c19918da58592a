"""The per-step path of :class:`~smartckpt_cli.engine.manager.CheckpointManager`: what ``mgr.step()``
and the optimizer step pre-hook do at every step, and how rarely anything more happens.

Order of calls (training thread), for step N of a loop ``forward; backward; opt.step(); ...;
mgr.step(N)``:

1. ``opt.step()`` runs the pre-hook (``_before_optimizer_step``, :mod:`.prehook`): the lazy snapshot's guard;
   on an evaluation step (``Signals.due``) the gradient statistics, and, when the policy can
   save before the update (one process), the evaluation itself and ``policy.before_update``.
2. ``mgr.step(N)``: the loss joins the window if an evaluation is near; an evaluation not taken
   in the pre-hook is launched, a reading read back (CPU: at once; CUDA: once its event has
   passed); the policy is asked only at a reading, a pending wish or signal, after a commit, or
   from the step/time ``quiet_until`` named (cadence.py); the coordinator agrees on the save
   and any rank's preemption signal (several ranks: only at decision steps, coordinator.py);
   then the save, if any.

Everything else of a step is a few comparisons. This is a mixin: the state it reads is the
manager's, set up in its ``__init__``. Where the saves are staged (prepared at a step) is
:mod:`.staging`'s.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from smartckpt_cli.config import Settings
from smartckpt_cli.engine import heartbeat
from smartckpt_cli.engine.cadence import StepClock
from smartckpt_cli.engine.coordinator import NO, Coordinator, Proposal, Verdict
from smartckpt_cli.engine.preempt import PreemptionWatch
from smartckpt_cli.engine.prestep import Boundary
from smartckpt_cli.engine.ramtier import RamTier
from smartckpt_cli.engine.report import report
from smartckpt_cli.engine.resumecheck import ResumeCheck, check_job, expect_job
from smartckpt_cli.engine.saverecord import SaveRecord
from smartckpt_cli.engine.schedule import SaveSchedule
from smartckpt_cli.engine.writer import Persister
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.trigger.memory import MemoryProbe
from smartckpt_cli.trigger.policies import Decision, Policy, TriggerContext
from smartckpt_cli.trigger.reading import SignalReading
from smartckpt_cli.trigger.signals import Signals
from smartckpt_cli.trigger.trace import TraceWriter

if TYPE_CHECKING:
    from smartckpt_cli.engine.saving import SaveHandle

__all__ = ["StepPath", "StepResult"]

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    saved: bool = False
    reason: str = ""
    handle: SaveHandle | None = None
    failures: int = 0  # background saves that failed so far
    last_error: str | None = None


class StepPath:
    """The manager's per-step methods (module docstring)."""

    settings: Settings
    policy: Policy
    _precursor: bool
    _signals: Signals
    _memory: MemoryProbe
    _clock: StepClock
    _quiet: tuple[float, float]
    _quiet_commits: int
    _news: Any  # queue.SimpleQueue[str] (manager.py)
    _commits_seen: int
    _failures_seen: tuple[int, str | None]
    _calm_after: Callable[[int], None]  # calm.py
    _wish: Decision | None
    _eval_cost: float
    _prepare: bool
    _coord: Coordinator
    _boundary: Boundary
    _pre_reading: SignalReading | None
    _pre_hooks: int
    _pre_saved: tuple[SaveHandle, str] | None
    _precursor_refused: set[str]  # what is said once: a refused precursor, a failed evaluation
    _optimizers: list[Any]
    _objects: dict[str, tuple[str, Any]]
    _record: SaveRecord
    _inflight: SaveHandle | None
    _preempt: PreemptionWatch
    _trace: TraceWriter
    _last_step: int
    _last_loss: torch.Tensor | float | None
    _last_reading: SignalReading | None
    _schedule: SaveSchedule
    _calm_step: int
    _record_until: int
    _keep_from: int
    _next_eval: int
    _calm_time: float
    _beating: bool
    _check: ResumeCheck
    _saver: Any
    store: StoreDir
    heartbeat: bool
    # the manager's own
    _ram: RamTier | None
    _persister: Persister
    _ram_due: float
    _first_step_report: bool
    _save: Callable[..., SaveHandle]
    _preempted: Callable[[int, int, StepResult], StepResult]
    _prepare_staging: Callable[[], None]  # staging.py

    def _launch(self, step: int) -> None:
        """Start the evaluation of ``step``: the memory ceiling read on the host, the signals'
        one readback."""
        sample = self._memory.read()
        self._signals.launch(step, memory=sample.fraction if sample is not None else None)

    def step(
        self,
        step: int,
        loss: torch.Tensor | float | None = None,
        *,
        loss_scale: torch.Tensor | float | None = None,
        can_save: bool = True,
    ) -> StepResult:
        """Tell the manager a training step finished; it saves when the policy says so, or takes
        a blocking save and hands the signal on when a preemption signal arrived.

        The loss stays on its device (kept only for the few steps before an evaluation);
        ``loss_scale``: the factor it was multiplied by before backward (a GradScaler's scale),
        divided out only for those steps. A step that does not evaluate costs a few comparisons
        (cadence.py). Evaluations read the signals back once (signals.py); with a registered
        optimizer (one process) and a policy that can save before the update, that happens in
        its step pre-hook, before the update, where a precursor can save the previous step
        (``_before_update``); this step's result then reports that save.

        ``can_save=False``: the state of this step cannot be snapshotted now (zero-code mode
        when it did not record the step's boundary, see :meth:`may_save`); a save asked for
        waits for the next step that can, a preemption signal too."""
        now = time.monotonic()
        if (
            step < self._calm_step
            and now < self._calm_time
            and self._pre_reading is None
            and self._pre_saved is None
            and self._preempt.arrivals == self._preempt.taken  # no signal (preempt.py)
            and self._news.empty()
            and self._commits_seen == self._quiet_commits
        ):
            # Nothing can happen at this step: no evaluation at the next one, no signal, no
            # decision step, the policy cannot save yet. Each line of Python here costs about a
            # microsecond in a training loop (cold caches after the step's kernels), so this path
            # is these comparisons, the heartbeat under `smartckpt run` (a memory write) and the
            # loss for the next evaluation's window, kept as a detached device tensor.
            self._last_step = step
            if self._beating:
                heartbeat.beat_step(step)
            if step >= self._keep_from and loss is not None:
                self._last_loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
                self._signals.add_loss(self._last_loss if loss_scale is None else loss / loss_scale)
            return StepResult(failures=self._failures_seen[0], last_error=self._failures_seen[1])
        self._take_news()
        return self._boundary_step(step, loss, loss_scale, can_save, now)

    def _take_news(self) -> None:
        """What the save thread said since the last step (engine/saving.py puts a "commit" or a
        "failure"): commits counted here, the failures read from the save record."""
        failed = False
        while not self._news.empty():
            if self._news.get_nowait() == "commit":
                self._commits_seen += 1
            else:
                failed = True
        if failed:
            self._failures_seen = self._record.failure_count()

    def _boundary_step(
        self,
        step: int,
        loss: torch.Tensor | float | None,
        loss_scale: torch.Tensor | float | None,
        can_save: bool,
        now: float,
    ) -> StepResult:
        """``step()`` where something may happen (an evaluation, its loss window, a signal, a
        decision step, a policy that may save, a heartbeat due)."""
        self._signals.step_time = self._clock.tick(now, step)
        self._last_step = step
        if self._first_step_report:  # the first step after a restore: a recovery's last phase
            self._first_step_report = False
            report(first_step_done=time.time(), first_step=step)
        if self._check.step >= 0:
            self._take_check(step, loss, loss_scale)
        # A reading the optimizer pre-hook took (the losses up to the previous step) stands for
        # this step's evaluation; this step's loss joins the next one's window.
        reading, self._pre_reading = self._pre_reading, None
        pre_saved, self._pre_saved = self._pre_saved, None
        self._pre_hooks = 0
        self._keep_loss(step, loss, loss_scale)
        if self._prepare:
            self._prepare_staging()
        if reading is None:
            reading = self._evaluate(step)
        self._beat(step, reading)
        self._arm_next(step, can_save)
        result = StepResult()
        if pre_saved is not None:
            result.saved, result.handle, result.reason = True, pre_saved[0], pre_saved[1]
        decision = self._decide(step, reading, pre_saved, now)
        verdict = self._agree(step, decision, can_save, now)
        decision, signum, self._wish = verdict.decision, verdict.signum, verdict.wish
        if verdict.agreed:
            self._signals.agreed = verdict.spacing  # rank 0's evaluation spacing, from the next launch on
        if verdict.skipped:
            self._record.skip(step)
        if signum is not None:
            self._preempt.take()
            return self._preempted(step, signum, result)
        if decision.save:
            result.handle = self._save(step, decision, lazy=bool(self._optimizers))
            result.saved, result.reason = result.handle.error is None, decision.reason
        elif verdict.ram:  # the RAM tier's cadence, apart from the disk's (ramtier.py)
            self._save(step, Decision(True, "ram"), lazy=bool(self._optimizers), ram_only=True)
        result.failures, result.last_error = self._record.failure_count()
        self._calm_after(step)
        return result

    def _keep_loss(self, step: int, loss: Any, loss_scale: Any) -> None:
        if loss is not None:
            # detached: the caller's reference alone decides when its graph goes, as without us
            self._last_loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
            if self._signals.keeps_loss(step):
                self._signals.add_loss(loss if loss_scale is None else loss / loss_scale)

    def _evaluate(self, step: int) -> SignalReading | None:
        """The evaluation the pre-hook did not take: launched when due, read back when ready."""
        sig = self._signals
        reading = None
        if sig.due(step):
            t0 = time.monotonic()
            self._launch(step)
            self._eval_cost += time.monotonic() - t0
        if sig.pending:  # CPU: at once; CUDA: once its event has passed, a later step
            reading = sig.poll()
        return reading

    def _beat(self, step: int, reading: SignalReading | None) -> None:
        # Under `smartckpt run`: a heartbeat (the loss only when this step read it back anyway).
        if self.heartbeat:
            heartbeat.beat(
                step,
                reading.raw_loss if reading else None,
                committed_step=self._schedule.committed_step(),
            )
            self._beating = heartbeat.heartbeat_on()
        else:  # zero-code mode: its hook beats the step; what only the manager knows goes here
            heartbeat.beat(
                None,
                reading.raw_loss if reading else None,
                committed_step=self._schedule.committed_step(),
            )
            self._beating = False

    def _arm_next(self, step: int, can_save: bool) -> None:
        """Arm the next step's evaluation; its pre-hook may save this step, so the boundary is
        captured now, while this step's state is still the one a precursor would save."""
        due_next = self._signals.due(step + 1)
        self._signals.arm(due_next)
        if due_next and can_save and self._coord.hooks_may_save and self._optimizers and self._precursor:
            t0 = time.monotonic()
            self._boundary.capture(step, self._objects)
            self._eval_cost += time.monotonic() - t0
        elif self._boundary.step is not None:
            self._boundary.clear()

    def _decide(
        self,
        step: int,
        reading: SignalReading | None,
        pre_saved: tuple[SaveHandle, str] | None,
        now: float,
    ) -> Decision:
        """This rank's wish, asking the policy only when something may have changed its mind
        (cadence.py); an evaluation's reading goes to the trace with its cost."""
        decision = NO
        if (
            reading is not None
            or self._wish is not None
            or self._preempt.pending is not None
            or step >= self._quiet[0]
            or now >= self._quiet[1]
            or self._commits_seen != self._quiet_commits
            or step >= self._coord.next_point
        ):
            t0 = time.monotonic()
            try:
                decision = self._consult(step, reading)
            except Exception as err:
                # A failing evaluation must neither raise into the loop nor keep this rank from the
                # decision collective below (the other ranks would wait for it): no save wished
                # at this step, reported once per cause.
                decision = NO
                cause = f"{type(err).__name__}: {err}"
                if cause not in self._precursor_refused:
                    self._precursor_refused.add(cause)
                    logger.error("step %d: the trigger's evaluation failed (%s); no save wished", step, cause)
            if reading is not None:
                reason = decision.reason if decision.save else pre_saved[1] if pre_saved else ""
                self._trace.add(reading, decision.score, reason)
                self._signals.charge(self._eval_cost + time.monotonic() - t0)
                self._eval_cost = 0.0
        return decision

    def _agree(self, step: int, decision: Decision, can_save: bool, now: float) -> Verdict:
        # One process: at once. Several ranks: rank 0's trigger decides for all at the agreed
        # decision steps; any rank's preemption signal makes every rank take the blocking save.
        # Several ranks agree only at decision steps: the next one lands on the step the RAM
        # tier's clock is due at, as on the policy's step of interest.
        quiet_step = self._quiet[0]
        if math.isfinite(self._ram_due) and self._clock.seconds > 0.0:
            ahead = max(1, math.ceil((self._ram_due - now) / self._clock.seconds))
            quiet_step = min(quiet_step, float(step + ahead))
        return self._coord.agree_to_save(
            Proposal(
                step,
                decision,
                self._wish,
                can_save,
                self._busy(),
                self._preempt.pending,
                self._clock.seconds,
                quiet_step,
                self._signals.own_spacing(),
                now >= self._ram_due and not (self._inflight is not None and not self._inflight.done()),
            )
        )

    def _take_check(self, step: int, loss: Any, loss_scale: Any) -> None:
        """The resume check's values of ``step`` when it is armed for it; what to do with them
        runs on the save thread, after the save it follows (resumecheck.py)."""
        try:
            taken = self._check.take(step, loss, loss_scale)
            if taken is None:
                return
            values, saved, restored = taken
            append = self.store.journal.append if self._coord.leads else None
            if saved is not None and append is not None:
                self._saver.submit(_quietly, expect_job, values, saved, append)
            if self._ram is not None:
                # A restore from the RAM snapshot of step - 1 checks them too: written into its
                # record off the training thread, and not behind that snapshot's disk write.
                self._persister.pool.submit(_quietly, self._ram.note_next_step, values)
            if restored is not None:
                self._saver.submit(_quietly, check_job, values, restored, append, report)
        except Exception as err:  # the check never breaks the training step
            logger.warning("resume check skipped at step %d: %s", step, err)

    def _busy(self) -> bool:
        return self._inflight is not None and not self._inflight.done() and self.settings.inflight == "skip"

    def _consult(self, step: int, reading: SignalReading | None) -> Decision:
        """Ask the policy, and until when it need not be asked again."""
        ctx = self._context(step, reading)
        decision = self.policy.should_save(ctx)
        if reading is not None:
            self._last_reading = reading
        quiet = getattr(self.policy, "quiet_until", None)
        self._quiet = quiet(ctx) if quiet is not None else (step, ctx.now)
        self._quiet_commits = self._commits_seen
        if not decision.save and self._wish is not None:
            decision = self._wish
        return decision

    def _context(self, step: int, reading: SignalReading | None) -> TriggerContext:
        now = self._schedule.view()  # one consistent reading: the save thread updates it
        return TriggerContext(
            step,
            time.monotonic(),
            now.scheduled_step,
            now.scheduled_time,
            loss=reading.raw_loss if reading else None,
            reading=reading,
            save_cost=now.save_wait,
            save_total=now.save_total,
            mtbf=self.settings.mtbf,
        )


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    """A resume-check job on the save thread: its failure is logged, never raised."""
    try:
        fn(*args)
    except Exception as err:
        logger.warning("resume check: %s: %s", type(err).__name__, err)
