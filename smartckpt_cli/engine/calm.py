"""Until which step nothing can happen, for :class:`~smartckpt_cli.engine.manager.CheckpointManager`:
the horizon of ``step()``'s fast path (the next evaluation's loss window, the policy's quiet step
and time, the next decision step of several ranks, the resume check's step, the RAM tier's
clock), and whether a step may save (zero-code mode skips recording a boundary no save can take).

Apart from :mod:`.stepping` because it is the one place the fast path's conditions are set: a
new reason for a step to look again goes here. A mixin, as :mod:`.stepping` is: the state it
reads is the manager's, all of it the training thread's.
"""

from __future__ import annotations

import math
import time
from typing import Any

from smartckpt_cli.engine.cadence import StepClock
from smartckpt_cli.engine.coordinator import Coordinator
from smartckpt_cli.engine.preempt import PreemptionWatch
from smartckpt_cli.engine.resumecheck import ResumeCheck
from smartckpt_cli.trigger.policies import Decision
from smartckpt_cli.trigger.signals import Signals

__all__ = ["CalmPath"]


class CalmPath:
    """The manager's fast-path horizon (module docstring)."""

    _signals: Signals
    _next_eval: int
    _wish: Decision | None
    _prepare: bool
    _calm_step: int
    _calm_time: float
    _record_until: int
    _keep_from: int
    _quiet: tuple[float, float]
    _quiet_commits: int
    _coord: Coordinator
    _check: ResumeCheck
    _ram_due: float
    _pre_reading: Any
    _preempt: PreemptionWatch
    _news: Any  # queue.SimpleQueue[str] (manager.py)
    _commits_seen: int
    _clock: StepClock

    def _calm_after(self, step: int) -> None:
        """Until which step and time nothing can happen (the fast path of ``step``): the first
        step whose loss the next evaluation keeps, the policy's quiet step and time, the next
        decision step of several ranks, the next heartbeat; nothing while a reading, a wish or a
        preparation is pending."""
        sig = self._signals
        self._next_eval = sig.next_due(step + 1)
        if sig.pending or self._wish is not None or self._prepare:
            self._calm_step, self._calm_time, self._record_until = -1, -math.inf, -1
            return
        # the losses of the window are kept on the fast path; the step before the evaluation arms
        # its statistics (and captures the boundary a precursor would save)
        self._keep_from = self._next_eval - self._signals.window - 1
        calm = min(float(self._next_eval - 1), self._quiet[0], self._coord.next_point)
        if self._check.step >= 0:
            calm = min(calm, float(self._check.step))  # that step takes the resume check's values
        self._calm_step = int(calm) if math.isfinite(calm) else 1 << 62
        self._calm_time = min(self._quiet[1], self._ram_due)
        # may_save: the step before the evaluation (a save before its update) and the evaluation
        # step (its reading) may save, as may the policy's quiet step and a decision step
        self._record_until = self._calm_step

    def _uncalm(self) -> None:
        """The schedule moved (a save, a restore, a registration): the next step looks again."""
        self._calm_step, self._calm_time, self._next_eval = -1, -math.inf, -1
        self._keep_from, self._record_until = 1 << 62, -1

    def may_save(self, step: int) -> bool:
        """Whether :meth:`step` for ``step`` (or a save before the next step's update) might
        take a save; True whenever in doubt. A caller that prepares what a save of ``step``
        reads (zero-code mode records the boundary's RNG, data position and buffers) may skip
        that when this is False, and calls ``step(step, ..., can_save=False)``."""
        if (
            step < self._record_until
            and self._pre_reading is None
            and self._preempt.arrivals == self._preempt.taken  # no signal (preempt.py)
            and self._news.empty()
            and self._commits_seen == self._quiet_commits
        ):
            # the step call comes up to a step later (zero-code: the next pre-hook)
            return time.monotonic() + 2.0 * self._clock.seconds >= min(self._quiet[1], self._ram_due)
        return True
