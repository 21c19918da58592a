"""Where the saves stand: shared by the thread that takes them and the thread that commits them.

The training thread takes a snapshot (:meth:`SaveSchedule.taken`) and asks the trigger with
:meth:`SaveSchedule.view`; the save thread reports the commit (:meth:`committed`) or the failure
(:meth:`failed`), which moves the schedule back so the next trigger tries again. Every read and
write is under one lock: no field crosses the two threads otherwise.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from smartckpt_cli.trigger.cost import SaveCost

__all__ = ["SaveSchedule", "Standing"]


@dataclass(frozen=True)
class Standing:
    """One consistent reading of the schedule."""

    scheduled_step: int | None  # the newest checkpoint taken (committed or in flight)
    scheduled_time: float  # its monotonic time
    committed_step: int | None  # the newest committed one
    save_wait: float  # smoothed seconds the loop waits per save (trigger/cost.py)
    save_total: float  # smoothed seconds from a snapshot to its commit


class SaveSchedule:
    def __init__(self, now: float) -> None:
        self._lock = threading.Lock()
        self._committed: tuple[int | None, float] = (None, now)
        self._scheduled: tuple[int | None, float] = self._committed
        self._cost = SaveCost()

    def view(self) -> Standing:
        with self._lock:
            return Standing(*self._scheduled, self._committed[0], self._cost.wait, self._cost.total)

    def committed_step(self) -> int | None:
        """The newest committed step alone: what every step's heartbeat carries (no reading built)."""
        with self._lock:
            return self._committed[0]

    def restored(self, step: int, now: float) -> None:
        """A checkpoint was restored: it is the newest committed and taken."""
        with self._lock:
            self._committed = self._scheduled = (step, now)

    def taken(self, step: int, now: float) -> None:
        """Training thread: a healthy snapshot of ``step`` went to the save thread."""
        with self._lock:
            self._scheduled = (step, now)

    def committed(self, step: int, taken_at: float, *, healthy: bool, wait: float, total: float) -> None:
        """Save thread: the checkpoint of ``step`` (taken at ``taken_at``) is committed; one with
        non-finite weights does not count against the lost-work budget."""
        with self._lock:
            if healthy:
                self._committed = (step, taken_at)
            else:
                self._scheduled = self._committed
            self._cost.add(wait, total)

    def failed(self) -> None:
        """Save thread: the save in flight did not commit: the schedule goes back to the newest
        committed checkpoint, so the next trigger tries again."""
        with self._lock:
            self._scheduled = self._committed
