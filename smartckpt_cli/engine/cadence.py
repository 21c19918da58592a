"""How often the per-step machinery does anything: the measured step time, and how far apart
several ranks agree on a save (pure functions and one small clock; no torch).

A training step that neither evaluates the signals nor saves should cost the loop a few
microseconds of Python: a call, a comparison with the next evaluation step, with the step or time
before which the policy cannot save (``quiet_until``, trigger.py) and, with several ranks, with
the next agreed decision step. The rarer things (an evaluation, a collective) are spaced by
what they cost against the step time measured here.
"""

from __future__ import annotations

import math

__all__ = ["DECIDE_LATENCY", "DECIDE_SHARE", "StepClock", "decide_gap"]

# Several ranks: the decision collective may take this share of the training time (measured in
# the loop: its 0.2-3 ms on a busy machine include waiting for the slowest rank)...
DECIDE_SHARE = 0.0025
# ...but ranks agree at least this often (seconds): a preemption signal or a save the trigger
# wants waits at most this long (plus a step). SLURM's warning comes tens of seconds early.
DECIDE_LATENCY = 1.0


class StepClock:
    """Seconds per step, smoothed, from the time and step between the step boundaries it is shown
    (not every step: ``step()``'s fast path does not call it). Intervals with a save (or a
    restore) in them are left out: they say nothing of the training."""

    __slots__ = ("_last", "seconds")

    def __init__(self) -> None:
        self._last: tuple[float, int] | None = None
        self.seconds = 0.0

    def tick(self, now: float, step: int) -> float:
        last, self._last = self._last, (now, step)
        if last is None or step <= last[1]:
            return self.seconds
        dt = (now - last[0]) / (step - last[1])
        if self.seconds == 0.0:
            self.seconds = dt
        else:  # one slow step (a GC pause, a log line) moves it a little, not all the way
            self.seconds = 0.9 * self.seconds + 0.1 * min(dt, 4.0 * self.seconds)
        return self.seconds

    def skip(self) -> None:
        """The interval up to the next tick is not training (a save, a restore ran in it)."""
        self._last = None


def decide_gap(step: int, step_time: float, cost: float, due_step: float) -> int:
    """Steps from ``step`` to the next decision of several ranks: as many as keep the
    collective (``cost`` seconds) under :data:`DECIDE_SHARE` of the training time, no more than
    :data:`DECIDE_LATENCY` seconds of steps, and landing exactly on ``due_step`` (the step at
    which the policy saves by steps, inf when none), so step schedules stay exact."""
    if step_time <= 0.0:
        return 1
    gap = math.ceil(cost / (DECIDE_SHARE * step_time)) if cost > 0.0 else 1
    gap = min(gap, max(1, int(DECIDE_LATENCY / step_time)))
    if math.isfinite(due_step) and due_step > step:
        gap = min(gap, int(due_step) - step)
    return max(1, gap)
