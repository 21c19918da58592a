"""The schedules without memory: :class:`FixedPolicy` (every N steps or seconds, ``--every``) and
:class:`SeedPolicy` (the seed's score against a threshold, on evaluation steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from smartckpt_cli.trigger.context import Decision, TriggerContext
from smartckpt_cli.trigger.scores import seed_score

__all__ = ["FixedPolicy", "SeedPolicy"]


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
