"""Divergence events: onset detection on the median-filtered loss, and what retention keeps before each."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from smartckpt_cli.simulate.replay import Save
from smartckpt_cli.simulate.trace import TraceRow
from smartckpt_cli.store.journal import CheckpointRecord
from smartckpt_cli.store.retention import select_prunable


@dataclass(frozen=True)
class Onset:
    index: int  # row of the onset
    step: int
    time: float
    end_index: int  # row where the event ends (the rollback is decided there)
    end_step: int
    end_time: float


def _filtered(rows: Sequence[TraceRow], window: int) -> list[float | None]:
    out: list[float | None] = []
    recent: deque[float] = deque(maxlen=window)
    for r in rows:
        if r.loss is None:
            out.append(None)
            continue
        recent.append(r.loss if math.isfinite(r.loss) else math.inf)  # nan/inf: a divergence
        out.append(statistics.median(recent))
    return out


class _Baseline:
    """The robust baseline of the non-event rows: the level is the median of the last ``level``
    of them; the noise is the MAD of the last ``noise`` residuals (each row minus the level just
    before it), so a trend (a falling loss) moves the level instead of inflating the MAD."""

    def __init__(self, level: int, noise: int) -> None:
        self.recent: deque[float] = deque(maxlen=level)
        self.resid: deque[float] = deque(maxlen=noise)

    def threshold(self, k: float, min_resid: int) -> float:
        if len(self.recent) < 5 or len(self.resid) < min_resid:
            return math.inf
        level = statistics.median(self.recent)
        center = statistics.median(self.resid)
        mad = statistics.median(abs(r - center) for r in self.resid)
        return level + k * max(mad, 1e-9 * max(abs(level), 1e-12))

    def add(self, f: float) -> None:
        if len(self.recent) >= 5:
            self.resid.append(f - statistics.median(self.recent))
        self.recent.append(f)


def detect_onsets(
    rows: Sequence[TraceRow],
    *,
    k: float = 6.0,
    window: int = 3,
    baseline: int = 20,
    noise: int = 200,
    given: Sequence[int] | None = None,
) -> list[Onset]:
    """Divergence events: detected (see module docstring) or, with ``given`` steps or an
    ``onset`` column, those onsets with their ends found the same way."""
    f = _filtered(rows, window)
    forced: set[int] | None = None
    if given is not None:
        forced = {next((i for i, r in enumerate(rows) if r.step >= s), -1) for s in given} - {-1}
    elif any(r.onset for r in rows):
        forced = {i for i, r in enumerate(rows) if r.onset}
    base = _Baseline(baseline, noise)
    min_resid = min(noise, 30)
    out: list[Onset] = []
    open_at: int | None = None
    thr = math.inf
    for i, fi in enumerate(f):
        is_forced = forced is not None and i in forced
        if open_at is not None:
            if is_forced or (fi is not None and fi <= thr):
                out.append(_onset(rows, open_at, i))
                open_at = None
            if not is_forced:
                continue  # rows of an event never enter the baseline
        thr_i = base.threshold(k, min_resid)
        if is_forced or (forced is None and fi is not None and fi > thr_i):
            if fi is None or fi <= thr_i:  # a given onset the loss does not show: ends at once
                out.append(_onset(rows, i, i))
            else:
                open_at, thr = i, thr_i
            continue
        if fi is not None and math.isfinite(fi):
            base.add(fi)
    if open_at is not None:
        out.append(_onset(rows, open_at, len(rows) - 1))
    return out


def _onset(rows: Sequence[TraceRow], i: int, end: int) -> Onset:
    return Onset(i, rows[i].step, rows[i].time, end, rows[end].step, rows[end].time)


def retained_before(saves: Sequence[Save], onset: Onset, keep_last: int) -> Save | None:
    """The newest checkpoint taken strictly before ``onset`` (by step) that retention still
    holds when the rollback is decided (at the event's end)."""
    records: list[CheckpointRecord] = []
    by_id: dict[str, Save] = {}
    for n, s in enumerate(sorted((s for s in saves if s.commit <= onset.end_time), key=lambda s: s.commit)):
        rec = CheckpointRecord(
            s.step, str(n), "", "", n, health="ok" if s.healthy else "nonfinite-loss", calm=s.calm
        )
        records.append(rec)
        by_id[rec.id] = s
        for doomed in select_prunable(records, keep_last):  # as the writer does after each commit
            doomed.pruned = True
    held = [by_id[r.id] for r in records if r.live and r.health == "ok" and r.step < onset.step]
    return max(held, key=lambda s: s.step) if held else None
