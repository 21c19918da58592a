"""**Memory pressure**: save before the likely out-of-memory kill. :class:`MemoryPressure` is pure
(fed the ``memory`` fraction of each reading, measured by memory.py) and sits in
:class:`~smartckpt_cli.trigger.bounded.Bounded`, so it acts whatever the policy: a fraction that
climbs steadily towards 1, or reaches ``memory_high`` at a new high, saves at once with the reason
``memory pressure``.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["MemoryPressure"]


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
