"""Trace files as tracks: the ones drawn, one per process, with what is derived from their rows.

Files written over the same time are other ranks of one job; one of them (the longest) is
drawn: N identical loss lines would hide each other and the markers. Derived series are
computed here on full resolution, before any filtering or decimation:

- the loss median-filtered over ``smooth`` rows (when the trace has no raw loss beside the
  trainer's filtered one: then this is the smoother line);
- the work not yet in a checkpoint: seconds since the process's newest healthy checkpoint (or
  its start), which ``max_interval`` bounds; the budget line is drawn against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from smartckpt_cli.timeline.place import Track
from smartckpt_cli.timeline.tracetable import TraceTable

__all__ = ["Drawn", "drawn_tracks", "median_filter", "unsaved_work"]


@dataclass
class Drawn:
    table: TraceTable
    ranks: int  # trace files of the same time, this one included
    track: Track
    derived: dict[str, np.ndarray] = field(default_factory=dict)
    mask: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # rows shown

    def column(self, name: str) -> np.ndarray | None:
        return self.derived.get(name, self.table.columns.get(name))


def _drop_misstepped_head(t: TraceTable) -> TraceTable:
    """Within one process, rows are ``eval_every`` steps apart. A first row far below the next
    is labelled with the step before a restore (the first evaluation of a resumed zero-code
    process has been seen numbered 1, the next 45): drawn on the step axis it would pull every
    line back to the start, and it would make placement think the file covers steps it never
    ran. Such a row is left out."""
    st = t.columns["step"]
    if len(st) < 3:
        return t
    gap = float(np.median(np.diff(st[1:])))
    if st[1] - st[0] <= 10 * max(gap, 1.0):
        return t
    cols = {c: v[1:] for c, v in t.columns.items()}
    decisions = {i - 1: d for i, d in t.decisions.items() if i > 0}
    nonfinite = {c: v[v > 0] - 1 for c, v in t.nonfinite.items()}
    return TraceTable(t.path, cols, decisions, nonfinite, t.skipped + 1)


def drawn_tracks(tables: Sequence[TraceTable]) -> list[Drawn]:
    """One track per process, in time order."""
    tabs = sorted(
        (_drop_misstepped_head(t) for t in tables if t.rows), key=lambda t: float(t.columns["time"].min())
    )
    groups: list[tuple[list[TraceTable], float]] = []
    for t in tabs:
        start, end = float(t.columns["time"].min()), float(t.columns["time"].max())
        if groups and start < groups[-1][1]:
            groups[-1] = (groups[-1][0] + [t], max(groups[-1][1], end))
        else:
            groups.append(([t], end))
    out = []
    for members, _ in groups:
        t = max(members, key=lambda m: m.rows)
        steps, times = t.columns["step"], t.columns["time"]
        decisions = {int(steps[i]): d for i, d in t.decisions.items()}
        out.append(Drawn(t, len(members), Track.of(steps, times, decisions)))
    return out


def median_filter(v: np.ndarray, window: int, diverged: np.ndarray | None) -> np.ndarray:
    """Trailing median over ``window`` rows that have a loss (fewer at the start), as the
    trainer's own filter works. A loss written as nan/inf counts as +inf, so a divergence wins
    the median as it would in the trainer; such medians are not drawn (the non-finite marks
    show them)."""
    x = v.copy()
    if diverged is not None and len(diverged):
        x[diverged] = np.inf
    idx = np.flatnonzero(~np.isnan(x))
    xv = x[idx]
    out = np.full(len(v), np.nan)
    n = len(xv)
    if n == 0:
        return out
    med = np.empty(n)
    for i in range(min(window - 1, n)):
        med[i] = np.median(xv[: i + 1])
    if n >= window:
        med[window - 1 :] = np.median(np.lib.stride_tricks.sliding_window_view(xv, window), axis=1)
    med[~np.isfinite(med)] = np.nan
    out[idx] = med
    return out


def unsaved_work(times: np.ndarray, saves: np.ndarray) -> np.ndarray:
    """Seconds since the newest save at or before each row (``saves``: sorted absolute times
    of this process's healthy checkpoints), or since the process's start."""
    start = times[0]
    if len(saves) == 0:
        return times - start
    idx = np.searchsorted(saves, times, side="right") - 1
    base = np.where(idx >= 0, saves[np.clip(idx, 0, None)], start)
    return times - np.maximum(base, start)
