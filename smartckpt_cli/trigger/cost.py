"""What a save costs, as the trigger sees it: a moving average of recent saves.

Two numbers per committed save: ``wait``, the seconds the training loop waited for it (the eager
snapshot copy plus what the optimizer pre-hook waited for the lazy copies), and ``total``, the
seconds from the snapshot to the commit line. The policies weigh a save's cost against the work
at risk (:class:`~smartckpt_cli.trigger.policies.TriggerContext` ``save_cost``/``save_total``).

The newest save counts 0.3, the history 0.7: a slow first save (allocation, cold page cache)
fades within a few saves, one slow write does not swing the schedule. Until a save with a
non-zero total was seen, the newest sample is taken as it is. Pure: no clock, no I/O, no lock
(the manager updates it under its own).
"""

from __future__ import annotations

__all__ = ["SaveCost"]

# The weight of the newest save in the average.
WEIGHT = 0.3


class SaveCost:
    """The smoothed cost of recent saves (module docstring); both 0.0 before the first."""

    __slots__ = ("total", "wait")

    def __init__(self) -> None:
        self.wait = 0.0  # seconds the training loop waited
        self.total = 0.0  # seconds until the commit

    def add(self, wait: float, total: float) -> None:
        """A committed save: ``wait`` seconds of the loop, ``total`` seconds until its commit."""
        if self.total == 0.0:
            self.wait, self.total = wait, total
            return
        self.wait = (1.0 - WEIGHT) * self.wait + WEIGHT * wait
        self.total = (1.0 - WEIGHT) * self.total + WEIGHT * total

    def __repr__(self) -> str:
        return f"SaveCost(wait={self.wait:.4g}, total={self.total:.4g})"
