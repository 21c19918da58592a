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
* ``adaptive`` (default) – :class:`AdaptivePolicy`: a cost-aware interval moved by the risk.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from smartckpt_cli.signals import SignalReading

__all__ = [
    "AdaptivePolicy",
    "Bounded",
    "Decision",
    "FixedPolicy",
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


@dataclass
class SeedPolicy:
    threshold: float = 0.65

    def should_save(self, ctx: TriggerContext) -> Decision:
        r = ctx.reading
        if r is None or r.curvature is None or r.grad_var is None:
            return Decision(False)
        score = seed_score(r.curvature, r.grad_var)
        return Decision(score >= self.threshold, "seed score", score, calm=score < self.threshold)


@dataclass
class AdaptivePolicy:
    """smartckpt's default: a cost-aware interval, moved earlier or later by the risk.

    **Interval.** The base interval is Young/Daly's T = sqrt(2·C·MTBF), with C what a checkpoint
    costs the training: the loop's measured wait per save plus ``background_share`` of the
    save's total time (the background encoding competes with training for CPU cores; on a GPU
    machine it hardly does). This is the seed's feedback loop made explicit: a larger or slower
    checkpoint raises C, so T grows and saves become rarer; a cheap one lets them come closer.
    Before any save has been measured, C is unknown and T is ``max_interval`` / 2.

    **Risk.** Each signal is judged against its own recent history (the last ``history``
    evaluations), so no absolute threshold depends on the model's loss scale:

    * gradient variance: r_v = log2(var / median of recent var). Rising gradient variance is the
      usual precursor of a loss spike (it grows before the loss does), so *high* variance raises
      the risk — the opposite of the seed's formula, which scores low variance as risky.
    * loss curvature (median-filtered second difference): r_c = |curv| / (3 · median |curv|), a
      robust z-score; sharp bends of the filtered loss mean the run is changing regime.

    risk = sigmoid(2·(max(r_v, r_c − 1) − 0.5)) ∈ (0, 1). The next save is due after
    T · 2^(1 − 2·risk): calm training (risk → 0) waits up to 2T, risky training (risk → 1) saves
    after T/2. When the risk passes ``alarm`` (a precursor), it saves at once (still subject to
    ``min_interval``), so a known-good state exists right before a spike; saves taken while the
    risk is high are marked not calm, and retention keeps the newest calm one.
    """

    mtbf: float = 6 * 3600.0
    background_share: float = 0.1
    alarm: float = 0.9
    history: int = 20
    max_interval: float = 180.0
    _vars: deque[float] = field(default_factory=lambda: deque(maxlen=20), repr=False)
    _curvs: deque[float] = field(default_factory=lambda: deque(maxlen=20), repr=False)
    _risk: float = 0.5

    def risk(self, reading: SignalReading) -> float:
        parts: list[float] = []
        if reading.grad_var is not None and reading.grad_var > 0:
            if len(self._vars) >= 3:
                base = statistics.median(self._vars)
                if base > 0:
                    parts.append(math.log2(reading.grad_var / base))
            self._vars.append(reading.grad_var)
        if reading.curvature is not None and math.isfinite(reading.curvature):
            if len(self._curvs) >= 3:
                scale = statistics.median(self._curvs)
                if scale > 0:
                    parts.append(abs(reading.curvature) / (3.0 * scale) - 1.0)
            self._curvs.append(abs(reading.curvature))
        if not parts:
            return 0.5
        return _sigmoid(2.0 * (max(parts) - 0.5))

    def interval(self, ctx: TriggerContext) -> float:
        cost = ctx.save_cost + self.background_share * ctx.save_total
        base = young_daly(cost, ctx.mtbf or self.mtbf) if cost > 0 else self.max_interval / 2
        return base * 2.0 ** (1.0 - 2.0 * self._risk)

    def should_save(self, ctx: TriggerContext) -> Decision:
        if ctx.reading is not None:
            self._risk = self.risk(ctx.reading)
        risk = self._risk
        calm = risk < 0.5
        if ctx.reading is not None and risk >= self.alarm:
            return Decision(True, "risk alarm", risk, calm=False)
        due = self.interval(ctx)
        if ctx.now - ctx.last_save_time >= due:
            return Decision(True, f"interval {due:.0f}s", risk, calm=calm)
        return Decision(False, score=risk, calm=calm)


@dataclass
class Bounded:
    """The lost-work budget around any policy (see module docstring)."""

    inner: Any
    min_interval: float = 10.0
    max_interval: float = 180.0
    max_interval_steps: int | None = None
    bound_inner: bool = True  # fixed schedules are the user's explicit wish: not floored

    def should_save(self, ctx: TriggerContext) -> Decision:
        since_t = ctx.now - ctx.last_save_time
        since_s = ctx.step - (ctx.last_save_step or 0)
        if since_t >= self.max_interval or (self.max_interval_steps and since_s >= self.max_interval_steps):
            inner = self.inner.should_save(ctx)  # keep the inner policy's view up to date
            return Decision(True, "lost-work budget", inner.score, calm=inner.calm)
        decision = self.inner.should_save(ctx)
        if decision.save and self.bound_inner and since_t < self.min_interval:
            return Decision(False, score=decision.score, calm=decision.calm)
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
        inner = AdaptivePolicy(mtbf=settings.mtbf, max_interval=settings.max_interval)
    return Bounded(
        inner,
        min_interval=settings.min_interval,
        max_interval=settings.max_interval,
        max_interval_steps=settings.max_interval_steps,
        bound_inner=name != "fixed",
    )
