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

**Memory pressure** (:class:`MemoryPressure`, pressure.py, in :class:`Bounded`, so whatever the
policy): a reading's ``memory`` (the fraction in use of the tightest memory ceiling, memory.py)
that climbs steadily towards 1, or reaches ``memory_high`` at a new high, saves at once with the
reason ``memory pressure``, before the likely out-of-memory kill.

This module is the interface (:class:`Policy`) and the factory (:func:`make_policy`); it
re-exports the names a caller needs. The parts: context.py (:class:`TriggerContext`,
:class:`Decision`), scores.py (the seed's score, Young/Daly's interval), simple.py (``fixed``,
``seed``), adaptive.py (``adaptive``), pressure.py (memory pressure), bounded.py (the budget).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from smartckpt_cli.trigger.adaptive import AdaptivePolicy
from smartckpt_cli.trigger.bounded import Bounded
from smartckpt_cli.trigger.context import Decision, TriggerContext
from smartckpt_cli.trigger.pressure import MemoryPressure
from smartckpt_cli.trigger.scores import seed_score, young_daly
from smartckpt_cli.trigger.simple import FixedPolicy, SeedPolicy

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


@runtime_checkable
class Policy(Protocol):
    def should_save(self, ctx: TriggerContext) -> Decision: ...


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
