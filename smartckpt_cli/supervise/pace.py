"""How fast the training goes, for the live view: steps per second over the last half minute of
one attempt (saves and pauses included: the pace a user waits on), and the time left to a
known total. Pure: the supervisor feeds it each poll's step and its clock."""

from __future__ import annotations

from collections import deque

__all__ = ["WINDOW", "Pace", "eta_text"]

WINDOW = 30.0  # seconds of steps the rate is taken over: recent enough to follow a change


class Pace:
    def __init__(self) -> None:
        self._seen: deque[tuple[float, int]] = deque()

    def note(self, now: float, step: int) -> None:
        """A poll's step. A step below the last one (a restart, a rollback) starts afresh."""
        if self._seen and step < self._seen[-1][1]:
            self._seen.clear()
        if not self._seen or step != self._seen[-1][1]:
            self._seen.append((now, step))
        # Keep one sample at or before the window's start, so the rate spans the whole window.
        while len(self._seen) > 2 and self._seen[1][0] <= now - WINDOW:
            self._seen.popleft()

    def rate(self, now: float) -> float | None:
        """Steps per second from the oldest kept step to now's; None before two steps."""
        if len(self._seen) < 2:
            return None
        (t0, s0), (_, s1) = self._seen[0], self._seen[-1]
        return (s1 - s0) / (now - t0) if now > t0 else None


def eta_text(step: int, total: int | None, rate: float | None) -> str | None:
    """``ETA 1h02m`` for the steps left at this rate; None without a total or a rate."""
    if total is None or rate is None or rate <= 0 or step >= total:
        return None
    left = (total - step) / rate
    if left >= 86400:
        return f"ETA {left / 86400:.1f} d"
    h, rest = divmod(int(left + 0.5), 3600)
    m, s = divmod(rest, 60)
    return f"ETA {h}h{m:02d}m" if h else f"ETA {m}m{s:02d}s" if m else f"ETA {s}s"
