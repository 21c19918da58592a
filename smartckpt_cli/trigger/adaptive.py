"""smartckpt's default trigger policy, :class:`AdaptivePolicy` (the ``adaptive`` policy): a
cost-aware interval on a clock the risk speeds up, and a save before the optimizer update at a
precursor. The class docstring carries the design.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from smartckpt_cli.trigger.context import Decision, TriggerContext
from smartckpt_cli.trigger.reading import SignalReading
from smartckpt_cli.trigger.scores import robust_z, sigmoid, young_daly

__all__ = ["AdaptivePolicy"]


@dataclass
class AdaptivePolicy:
    """smartckpt's default: the Young/Daly interval, run on a clock that speeds up with the risk,
    and a save *before the optimizer update* when the planned update or the gradient variance
    breaks from its own history.

    **Interval.** The base interval is Young/Daly's T = sqrt(2·C·MTBF), with C what a checkpoint
    costs the training: the loop's measured wait per save plus ``background_share`` of the
    save's total time (the background encoding competes with training for CPU cores; on a GPU
    machine it hardly does). This is the seed's feedback loop made explicit: a larger or slower
    checkpoint raises C, so T grows and saves become rarer; a cheap one lets them come closer.
    Before any save has been measured, C is unknown and T is ``max_interval`` / 2. Machine
    failures do not care how calm the loss is, so calm training saves every T, the optimum for
    the configured MTBF.

    **Signals.** Each is judged against its own last ``history`` evaluations by a robust
    z-score, |x − median| / (1.4826 · MAD), so no threshold depends on the model's loss or
    gradient scale and the natural noise of each signal sets its own yardstick:

    * the planned update (planned.py: the norm of the step the optimizer is about to apply), on
      a log scale, *one-sided*: a surge is the direct cause of a loss spike — a learning rate
      that jumps, or a gradient far above Adam's running RMS (the usual mechanism of Adam's loss
      spikes) — and it is read before the weights move. A shrinking update is harmless.
    * gradient variance, on a log scale, *two-sided*: a surge and a collapse (the gradients of
      a run that has just diverged into a flat region) both count. On real fine-tuning traces
      its z-score stays below 5 in calm training and passes 6 right after an instability; it
      reacts with the loss, rarely before it (measured: within noise while a ramped learning
      rate already raised the loss).
    * loss curvature (second difference of the median-filtered loss): a sharp bend means the
      run is changing regime. It only moves the interval, never forces a save: on the same
      traces the curvature of a median-filtered per-batch loss is heavy-tailed (z > 6 several
      times in a calm run), so an alarm on it would spend checkpoints on noise.

    **Risk and clock.** risk = sigmoid(2·(z − 4)) with z the largest of the three z-scores: ~0
    in calm training, 0.5 at z = 4. Time since the newest checkpoint is counted on a clock that
    runs sqrt(1 + (``hazard`` − 1)·risk) times faster than the wall clock — Young/Daly's
    interval for a failure rate ``hazard`` times higher at full risk; the default 4 halves the
    interval — and a save is due when that clock reaches T. Integrating the rate, rather than
    comparing the elapsed time with an interval recomputed from the latest reading, keeps one
    noisy reading from pulling a save forward: saves stay evenly spaced while the risk merely
    fluctuates, which is what keeps the expected lost work of random failures at the fixed
    schedule's.

    **Alarm.** When the planned update's or the variance's z-score reaches ``alarm_z``,
    :meth:`before_update` — asked by the manager from the optimizer's step pre-hook, where both
    are measured — answers "save now": the manager then saves the state of the previous step,
    which the suspicious update has not touched yet (a known-good candidate, calm unless the
    loss is already in an excursion). Where that save cannot be taken (another precursor save
    less than ``min_interval`` ago, several ranks, a buffer forward already changed), the alarm
    stays pending and ``should_save`` takes it at the step boundary, after the update, marked
    not calm. One anomaly costs one
    checkpoint: the alarm re-arms once both z-scores are back below ``alarm_z`` / 2.

    **Calm.** A save is calm (a known-good candidate that retention never evicts while it is
    the newest calm one) when the risk is below 0.5 and the filtered loss itself is not in an
    upward excursion: a loss at least 4 robust z above the median of its last ``history``
    non-excursion evaluations starts one, which lasts until the loss is back within 2 z of
    that frozen median (or, after 4 × ``history`` evaluations, the new level is accepted). The
    loss level is no precursor — it rises with the spike — so it neither moves the clock nor
    alarms; but saves taken during a spike hold damaged weights, and a spike can outlast
    ``keep_last`` saves: marking them not calm is what keeps the last state from before it.
    """

    mtbf: float = 6 * 3600.0
    background_share: float = 0.1
    alarm_z: float = 6.0
    hazard: float = 4.0
    history: int = 50
    max_interval: float = 180.0
    _vars: deque[float] = field(init=False, repr=False)
    _curvs: deque[float] = field(init=False, repr=False)
    _risk: float = field(default=0.0, init=False)
    _z_var: float = field(default=0.0, init=False, repr=False)
    _z_upd: float = field(default=0.0, init=False, repr=False)
    _upds: deque[float] = field(init=False, repr=False)
    _judged: SignalReading | None = field(default=None, init=False, repr=False)
    _cause: str = field(default="", init=False, repr=False)
    _anchor: float | None = field(default=None, init=False, repr=False)  # newest save seen
    _clock: float = field(default=0.0, init=False, repr=False)  # risk-weighted seconds since it
    _seen: float = field(default=0.0, init=False, repr=False)  # ctx.now of the previous call
    _armed: bool = field(default=True, init=False, repr=False)
    _alarm: bool = field(default=False, init=False, repr=False)
    _alarm_by: SignalReading | None = field(default=None, init=False, repr=False)  # who raised it
    _losses: deque[float] = field(init=False, repr=False)
    _surge: tuple[float, float, int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._vars = deque(maxlen=self.history)
        self._curvs = deque(maxlen=self.history)
        self._upds = deque(maxlen=self.history)
        self._losses = deque(maxlen=self.history)

    @property
    def in_surge(self) -> bool:
        """Whether the filtered loss is in an upward excursion (see the class docstring)."""
        return self._surge is not None

    def _track_loss(self, loss: float) -> None:
        x = loss if math.isfinite(loss) else math.inf
        if self._surge is not None:
            med, scale, n = self._surge
            # Over when the loss is back near its old level, or after 4 × history evaluations
            # (then the new level is accepted as the run's own).
            self._surge = None if x - med < 2.0 * scale or n >= 4 * self.history else (med, scale, n + 1)
            if self._surge is None and x - med >= 2.0 * scale:
                self._losses.clear()
        elif len(self._losses) >= 5:
            med = statistics.median(self._losses)
            mad = statistics.median(abs(h - med) for h in self._losses)
            scale = max(1.4826 * mad, 0.01 * abs(med), 1e-12)
            if (x - med) / scale >= 4.0:
                self._surge = (med, scale, 1)
        if self._surge is None and math.isfinite(x):
            self._losses.append(x)

    def risk(self, reading: SignalReading) -> float:
        """Judge one evaluation (and add it to the history); returns the risk in [0, 1).
        The same reading object is judged once, however often it is shown."""
        if reading is self._judged:
            return self._risk
        self._judged = reading
        z_var = z_curv = z_upd = 0.0
        if reading.grad_var is not None and reading.grad_var > 0 and math.isfinite(reading.grad_var):
            log_var = math.log2(reading.grad_var)
            if len(self._vars) >= 5:
                z_var = robust_z(log_var, self._vars, 0.1)
            self._vars.append(log_var)
        if reading.update is not None and reading.update > 0 and math.isfinite(reading.update):
            log_upd = math.log2(reading.update)
            if len(self._upds) >= 5 and log_upd > statistics.median(self._upds):  # a surge only
                z_upd = robust_z(log_upd, self._upds, 0.1)
            self._upds.append(log_upd)
        if reading.curvature is not None and math.isfinite(reading.curvature):
            if len(self._curvs) >= 5:
                loss = reading.loss if reading.loss is not None and math.isfinite(reading.loss) else 0.0
                z_curv = robust_z(reading.curvature, self._curvs, max(0.01 * abs(loss), 1e-12))
            self._curvs.append(reading.curvature)
        self._z_var, self._z_upd = z_var, z_upd
        if reading.loss is not None:
            self._track_loss(reading.loss)
        self._risk = sigmoid(2.0 * (max(z_var, z_curv, z_upd) - 4.0))
        z = max(z_var, z_upd)
        if z >= self.alarm_z and self._armed:
            self._alarm, self._armed, self._alarm_by = True, False, reading
            self._cause = "planned update" if z_upd >= z_var else "gradient variance"
        elif z < self.alarm_z / 2:
            self._armed = True
        return self._risk

    def interval(self, ctx: TriggerContext) -> float:
        """Young/Daly's T for the measured save cost (risk-free: the clock carries the risk)."""
        cost = ctx.save_cost + self.background_share * ctx.save_total
        return young_daly(cost, ctx.mtbf or self.mtbf) if cost > 0 else self.max_interval / 2

    def rate(self) -> float:
        """How fast the clock runs at the current risk."""
        return math.sqrt(1.0 + (self.hazard - 1.0) * self._risk)

    def _advance(self, ctx: TriggerContext) -> None:
        """Move the risk-weighted clock to ``ctx.now``; judge the reading, if any."""
        if ctx.last_save_time != self._anchor:  # a save happened (ours, the budget's, a manual one)
            self._anchor = ctx.last_save_time
            self._clock = max(0.0, ctx.now - ctx.last_save_time)
            self._alarm = False
        else:
            self._clock += max(0.0, ctx.now - self._seen) * self.rate()
        self._seen = ctx.now
        if ctx.reading is not None:
            self.risk(ctx.reading)

    def before_update(self, ctx: TriggerContext) -> Decision:
        """Asked from the optimizer's step pre-hook of an evaluation step, before the update: a
        precursor alarm saves the state as it is *before* the update it warns about. Only the
        reading that raised the alarm does: one step later, the state has taken that update."""
        self._advance(ctx)
        if self._alarm and ctx.reading is self._alarm_by:
            return Decision(True, f"precursor: {self._cause}", self._risk, calm=self._surge is None)
        return Decision(False, score=self._risk, calm=self._risk < 0.5 and self._surge is None)

    def should_save(self, ctx: TriggerContext) -> Decision:
        self._advance(ctx)
        risk = self._risk
        calm = risk < 0.5 and self._surge is None
        if self._alarm:  # not taken before the update: the weights already moved
            return Decision(True, "risk alarm", risk, calm=False)
        due = self.interval(ctx)
        if self._clock >= due:
            return Decision(True, f"interval {due:.0f}s", risk, calm=calm)
        return Decision(False, score=risk, calm=calm)

    @property
    def precursor(self) -> bool:
        """Whether :meth:`before_update` can save (an infinite ``alarm_z`` turns it off)."""
        return math.isfinite(self.alarm_z)

    def quiet_until(self, ctx: TriggerContext) -> tuple[float, float]:
        """No save before the risk-weighted clock reaches the interval: the rate is constant
        until the next reading, so that moment is known in advance."""
        if self._alarm:
            # pending: ask again at once, in time only, so that Bounded's floor can defer it
            return math.inf, ctx.now
        clock = self._clock
        if ctx.last_save_time != self._anchor:
            clock = max(0.0, ctx.now - ctx.last_save_time)
        else:
            clock += max(0.0, ctx.now - self._seen) * self.rate()
        return math.inf, ctx.now + max(0.0, self.interval(ctx) - clock) / self.rate()
