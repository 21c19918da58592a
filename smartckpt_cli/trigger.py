"""WHEN to save. Policies are pure: they see a :class:`TriggerContext` and answer a
:class:`Decision`; the manager does the saving.

Order of calls (manager, training thread): ``should_save(ctx)`` once per ``mgr.step``; after a
commit, ``committed(ctx)`` so the policy can learn what saves cost.

:class:`IntervalPolicy` is the lost-work budget every policy is bounded by: a save is due when
``max_interval`` seconds (default 180) or ``max_interval_steps`` steps have passed since the last
committed checkpoint, or on a fixed ``every_steps``/``every_seconds`` schedule when configured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["Decision", "IntervalPolicy", "Policy", "TriggerContext", "seed_score"]


@dataclass(frozen=True)
class TriggerContext:
    step: int
    now: float  # monotonic seconds
    last_save_step: int | None  # step of the newest committed (or in-flight) checkpoint
    last_save_time: float  # monotonic time of it (or of the start of the run)
    loss: float | None = None


@dataclass(frozen=True)
class Decision:
    save: bool
    reason: str = ""
    score: float | None = None


@runtime_checkable
class Policy(Protocol):
    def should_save(self, ctx: TriggerContext) -> Decision: ...


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def seed_score(curv: float, grad_var: float) -> float:
    """The seed's risk score, exactly: 0.7·sigmoid(|curv|/0.03) + 0.3·(1 − sigmoid(grad_var/1e-5)).

    The seed saves when it reaches 0.65. Note it *raises* the score when gradient variance is low.
    """
    return 0.7 * _sigmoid(abs(curv) / 0.03) + 0.3 * (1.0 - _sigmoid(grad_var / 1e-5))


@dataclass(frozen=True)
class IntervalPolicy:
    every_steps: int | None = None
    every_seconds: float | None = None
    max_interval: float = 180.0
    max_interval_steps: int | None = None

    def should_save(self, ctx: TriggerContext) -> Decision:
        since_steps = ctx.step - (ctx.last_save_step or 0)
        since_time = ctx.now - ctx.last_save_time
        if self.every_steps and since_steps >= self.every_steps:
            return Decision(True, f"every {self.every_steps} steps")
        if self.every_seconds and since_time >= self.every_seconds:
            return Decision(True, f"every {self.every_seconds:g}s")
        if self.max_interval_steps and since_steps >= self.max_interval_steps:
            return Decision(True, "lost-work budget (steps)")
        if since_time >= self.max_interval:
            return Decision(True, "lost-work budget")
        return Decision(False)
