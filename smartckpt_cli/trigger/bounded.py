"""The lost-work budget around any policy: :class:`Bounded`. Whatever the inner policy says, a
save is forced once ``max_interval`` seconds or ``max_interval_steps`` steps have passed since the
newest checkpoint, and the policy's own saves are refused before ``min_interval`` seconds; memory
pressure (pressure.py) is judged here, so it acts whatever the policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from smartckpt_cli.trigger.context import Decision, TriggerContext
from smartckpt_cli.trigger.pressure import MemoryPressure

__all__ = ["Bounded"]


@dataclass
class Bounded:
    """The lost-work budget around any policy, and memory pressure (see the module docstring)."""

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
