"""WHEN to save. Policies are pure: they see a :class:`TriggerContext` and answer a
:class:`Decision`; the manager does the saving and feeds the costs back.

Order of calls (manager, training thread): once per ``mgr.step``, ``should_save(ctx)`` on the
policy returned by :func:`make_policy`, which is always wrapped in :class:`Bounded`, the lost-work
budget: whatever a policy says, a save is forced once ``max_interval`` seconds (default 180) or
``max_interval_steps`` steps have passed since the newest checkpoint, and a policy's own save is
refused before ``min_interval`` seconds (a noisy loss cannot make it save every evaluation).
``ctx.reading`` carries the signals on evaluation steps (every ``eval_every`` steps) only.

Policies, selectable by name (``policy:`` setting):

* ``fixed``  – every ``every_steps`` steps or ``every_seconds`` seconds (``--every``).
* ``seed``   – the seed's score (:func:`seed_score`), save when it reaches ``threshold``.
* ``adaptive`` (default) – :class:`AdaptivePolicy`: a cost-aware interval on a clock the risk
  speeds up, and a save before the optimizer update at a precursor (a surge of the planned
  update, or of the gradient variance).

A policy may also define ``before_update(ctx) -> Decision``: the manager asks it from the
optimizer's step pre-hook on evaluation steps, with that step's reading, and a "save" there
checkpoints the state of the *previous* step, before the update runs; and ``precursor`` (a bool):
whether ``before_update`` may say save at all (on CUDA the manager waits for the reading in the
pre-hook only then).

And ``quiet_until(ctx) -> (step, time)``: ``should_save`` is sure to answer no at every step below
``step`` and every monotonic time below ``time`` (``inf``: never by steps, or by time), unless a
reading arrives or a save is taken first. The manager asks the policy again only at a reading, at
that step or time, or after a save commits (save costs feed the interval), so a step that neither
evaluates nor saves costs the policy nothing. A policy without it is asked at every step.

**Memory pressure** (:class:`MemoryPressure`, in :class:`Bounded`, so whatever the policy): a
reading's ``memory`` (the fraction in use of the tightest memory ceiling, memory.py) that climbs
steadily towards 1, or reaches ``memory_high`` at a new high, saves at once with the reason
``memory pressure``, before the likely out-of-memory kill.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from smartckpt_cli.trigger.reading import SignalReading

__all__ = [
    "AdaptivePolicy",
    "Bounded",
    "Decision",
    "FixedPolicy",
    "MemoryPressure",
    "Policy",
    "SeedPolicy",
    "TriggerContext",
    "make_policy",
    "seed_score",
    "young_daly",
]


@dataclass(frozen=True)
class TriggerContext:
    step: int
    now: float  # seconds, monotonic
    last_save_step: int | None  # newest checkpoint taken (committed or in flight)
    last_save_time: float  # when it was taken (or when the run started)
    loss: float | None = None
    reading: SignalReading | None = None  # only on evaluation steps
    save_cost: float = 0.0  # seconds the loop loses per save (recent, smoothed)
    save_total: float = 0.0  # seconds from a save's start to its commit (recent, smoothed)
    mtbf: float | None = None  # mean time between failures, seconds


@dataclass(frozen=True)
class Decision:
    save: bool
    reason: str = ""
    score: float | None = None
    calm: bool = True  # taken while the signals looked calm: a known-good candidate


@runtime_checkable
class Policy(Protocol):
    def should_save(self, ctx: TriggerContext) -> Decision: ...


def _sigmoid(x: float) -> float:
    if x < -60:
        return 0.0
    return 1.0 / (1.0 + math.exp(-x))


def seed_score(curv: float, grad_var: float) -> float:
    """The seed's risk score, exactly: 0.7·sigmoid(|curv|/0.03) + 0.3·(1 − sigmoid(grad_var/1e-5)).

    The seed saves when it reaches 0.65. As written it *raises* the score when gradient variance
    is low (and, since sigmoid(|x|) ≥ 0.5, the score is never below 0.35). It is kept exactly as
    the seed wrote it; smartckpt's default policy treats variance the other way round.
    """
    return 0.7 * _sigmoid(abs(curv) / 0.03) + 0.3 * (1.0 - _sigmoid(grad_var / 1e-5))


def young_daly(cost: float, mtbf: float) -> float:
    """The first-order optimal checkpoint interval sqrt(2·C·MTBF) (Young 1974, Daly 2006)."""
    return math.sqrt(2.0 * max(cost, 0.0) * max(mtbf, 0.0))


@dataclass
class FixedPolicy:
    every_steps: int | None = None
    every_seconds: float | None = None

    def should_save(self, ctx: TriggerContext) -> Decision:
        if self.every_steps and ctx.step - (ctx.last_save_step or 0) >= self.every_steps:
            return Decision(True, f"every {self.every_steps} steps")
        if self.every_seconds and ctx.now - ctx.last_save_time >= self.every_seconds:
            return Decision(True, f"every {self.every_seconds:g}s")
        return Decision(False)

    def quiet_until(self, ctx: TriggerContext) -> tuple[float, float]:
        step = (ctx.last_save_step or 0) + self.every_steps if self.every_steps else math.inf
        when = ctx.last_save_time + self.every_seconds if self.every_seconds else math.inf
        return step, when


@dataclass
class SeedPolicy:
    threshold: float = 0.65

    def should_save(self, ctx: TriggerContext) -> Decision:
        r = ctx.reading
        if r is None or r.curvature is None or r.grad_var is None:
            return Decision(False)
        score = seed_score(r.curvature, r.grad_var)
        return Decision(score >= self.threshold, "seed score", score, calm=score < self.threshold)

    def quiet_until(self, ctx: TriggerContext) -> tuple[float, float]:
        return math.inf, math.inf  # it only ever saves on a reading


def _robust_z(x: float, history: deque[float], floor: float) -> float:
    """|x − median| / (1.4826 · MAD) of ``history`` (the MAD scaled to a normal σ), with the
    scale floored at ``floor`` so a constant history does not make every wiggle infinite."""
    med = statistics.median(history)
    mad = statistics.median(abs(h - med) for h in history)
    return abs(x - med) / max(1.4826 * mad, floor)


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

    * the planned update (signals.py: the norm of the step the optimizer is about to apply), on
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
                z_var = _robust_z(log_var, self._vars, 0.1)
            self._vars.append(log_var)
        if reading.update is not None and reading.update > 0 and math.isfinite(reading.update):
            log_upd = math.log2(reading.update)
            if len(self._upds) >= 5 and log_upd > statistics.median(self._upds):  # a surge only
                z_upd = _robust_z(log_upd, self._upds, 0.1)
            self._upds.append(log_upd)
        if reading.curvature is not None and math.isfinite(reading.curvature):
            if len(self._curvs) >= 5:
                loss = reading.loss if reading.loss is not None and math.isfinite(reading.loss) else 0.0
                z_curv = _robust_z(reading.curvature, self._curvs, max(0.01 * abs(loss), 1e-12))
            self._curvs.append(reading.curvature)
        self._z_var, self._z_upd = z_var, z_upd
        if reading.loss is not None:
            self._track_loss(reading.loss)
        self._risk = _sigmoid(2.0 * (max(z_var, z_curv, z_upd) - 4.0))
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


@dataclass
class MemoryPressure:
    """Save before the likely out-of-memory kill (pure: fed the memory fraction of each reading).

    An alarm when the fraction in use of the tightest memory ceiling (memory.py)

    * climbs steadily — at least 3 of every 4 readings higher than the one before, over the last
      ``window`` — and the climb, fitted by least squares, reaches the ceiling within the time a
      save needs to commit plus two evaluations (``lead``, at least ``min_lead`` seconds); or
    * reaches ``high`` at a new high, one percent of the ceiling above every earlier reading (a
      process that sits at 93 % of a GPU by design, as a tuned batch size does, is not in
      danger: only growth past ``high`` is).

    One alarm per episode: it re-arms once the fraction is back below ``high`` − 0.1 and no
    longer climbing. The checkpoint's state is no worse for the pressure, so the save keeps the
    policy's calm flag.
    """

    high: float = 0.9
    window: int = 6
    min_lead: float = 1.0
    _hist: deque[tuple[float, float]] = field(init=False, repr=False)
    _armed: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        self._hist = deque(maxlen=max(4, self.window))

    def time_to_ceiling(self) -> float | None:
        """Seconds until the fitted steady climb reaches 1; None when not climbing steadily."""
        h = list(self._hist)
        if len(h) < 4:
            return None
        ups = sum(b[1] > a[1] for a, b in itertools.pairwise(h))
        if 4 * ups < 3 * (len(h) - 1):
            return None
        mt = statistics.fmean(t for t, _ in h)
        mf = statistics.fmean(f for _, f in h)
        var = sum((t - mt) ** 2 for t, _ in h)
        slope = sum((t - mt) * (f - mf) for t, f in h) / var if var > 0 else 0.0
        if slope <= 0:
            return None
        return max(0.0, (1.0 - h[-1][1]) / slope)

    def judge(self, now: float, fraction: float, save_total: float) -> bool:
        """One reading; True: save now."""
        peak = max((f for _, f in self._hist), default=None)
        self._hist.append((now, fraction))
        ttc = self.time_to_ceiling()
        if not self._armed:
            if fraction < self.high - 0.1 and ttc is None:
                self._armed = True
            return False
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(self._hist)]
        lead = max(self.min_lead, 2.0 * save_total + 2.0 * (max(gaps) if gaps else 0.0))
        # a new high: one percent of the ceiling past every earlier reading (three at least)
        fire = (ttc is not None and ttc <= lead) or (
            fraction >= self.high and len(self._hist) > 3 and peak is not None and fraction > peak + 0.01
        )
        if fire:
            self._armed = False
        return fire


@dataclass
class Bounded:
    """The lost-work budget around any policy, and memory pressure (see module docstring)."""

    inner: Any
    min_interval: float = 10.0
    max_interval: float = 180.0
    max_interval_steps: int | None = None
    bound_inner: bool = True  # fixed schedules are the user's explicit wish: not floored
    memory: MemoryPressure | None = None
    _last_precursor: float = field(default=-math.inf, init=False, repr=False)
    _memory_judged: Any = field(default=None, init=False, repr=False)

    @property
    def precursor(self) -> bool:
        return bool(getattr(self.inner, "precursor", hasattr(self.inner, "before_update")))

    def should_save(self, ctx: TriggerContext) -> Decision:
        since_t = ctx.now - ctx.last_save_time
        since_s = ctx.step - (ctx.last_save_step or 0)
        if since_t >= self.max_interval or (self.max_interval_steps and since_s >= self.max_interval_steps):
            inner = self.inner.should_save(ctx)  # keep the inner policy's view up to date
            return Decision(True, "lost-work budget", inner.score, calm=inner.calm)
        decision = self.inner.should_save(ctx)
        r = ctx.reading
        if (
            self.memory is not None
            and r is not None
            and r.memory is not None
            and r is not self._memory_judged
        ):
            self._memory_judged = r
            if self.memory.judge(ctx.now, r.memory, ctx.save_total):
                return Decision(True, "memory pressure", decision.score, calm=decision.calm)
        if decision.save and self.bound_inner and since_t < self.min_interval:
            return Decision(False, score=decision.score, calm=decision.calm)
        return decision

    def quiet_until(self, ctx: TriggerContext) -> tuple[float, float]:
        ask = getattr(self.inner, "quiet_until", None)
        if ask is None:
            return ctx.step, ctx.now  # a policy that cannot tell: asked at every step
        step, when = ask(ctx)
        if self.bound_inner:  # the inner policy's saves are refused before min_interval
            when = max(when, ctx.last_save_time + self.min_interval)
        if self.max_interval_steps:
            step = min(step, (ctx.last_save_step or 0) + self.max_interval_steps)
        return step, min(when, ctx.last_save_time + self.max_interval)

    def before_update(self, ctx: TriggerContext) -> Decision:
        """The inner policy's save before the optimizer update (only policies that define
        ``before_update`` take one). ``min_interval`` spaces these saves from one another, not
        from the regular ones: a precursor right after a scheduled save still saves the state
        before the update it warns about (alarms re-arm only once the signal is calm again, so
        they stay rare). The budget is not checked here: it is kept at the step boundary."""
        ask = getattr(self.inner, "before_update", None)
        if ask is None:
            return Decision(False)
        decision: Decision = ask(ctx)
        if decision.save and self.bound_inner and ctx.now - self._last_precursor < self.min_interval:
            return Decision(False, score=decision.score, calm=decision.calm)
        if decision.save:
            self._last_precursor = ctx.now
        return decision


def make_policy(settings: Any) -> Bounded:
    """The policy a Settings object asks for, inside the lost-work budget."""
    name = settings.policy
    inner: Any
    if settings.every_steps or settings.every_seconds:
        name = "fixed"
    if name == "fixed":
        inner = FixedPolicy(settings.every_steps, settings.every_seconds)
    elif name == "seed":
        inner = SeedPolicy(settings.threshold)
    else:
        inner = AdaptivePolicy(
            mtbf=settings.mtbf, max_interval=settings.max_interval, alarm_z=settings.alarm_z
        )
    return Bounded(
        inner,
        min_interval=settings.min_interval,
        max_interval=settings.max_interval,
        max_interval_steps=settings.max_interval_steps,
        bound_inner=name != "fixed",
        memory=MemoryPressure(high=settings.memory_high) if settings.memory_high > 0 else None,
    )
