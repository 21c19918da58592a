"""When was each checkpoint taken? Placing journal entries on the traces' clock. Pure.

The journal orders checkpoints but carries no time (ordering is by journal position, never by
clock, DESIGN.md); the manifests carry a UTC second, but pruned checkpoints have lost theirs,
and reading thousands of manifests of a large model to learn a second would be slow. The traces
carry step and time for every evaluation, one file per process. So a checkpoint of step S is
placed in the trace of the process that took it, at the time that trace shows for step S
(interpolated between its rows). Which process? Walking the journal in order with a cursor
over the trace files, in time order:

- a process's steps only grow: a checkpoint whose step is below the previous one placed in the
  current file belongs to a later file (a restart went back to an older checkpoint);
- a file *covers* S when S lies within its rows' steps (for a precursor save from one below its
  first: it holds the step before its row; for any other save not so, since a restarted process's
  first row is the step after the checkpoint it resumed from, which belongs to the process before
  it, whose last flushed row may come a little earlier); a final or preemption save may lie after the last row
  (traces are written every ``eval_every`` steps), so for those the current file's span is
  widened by one evaluation gap first, for the others only after no file covers S strictly;
- a trace row whose ``decision`` is the checkpoint's reason, at S (or at S + 1 for a precursor),
  pins it exactly;
- where the manifest's UTC second is known (live checkpoints: few, cheap to read), the covering
  file whose time for S is nearest to it wins, which settles any remaining ambiguity.

What no trace covers is placed at its manifest's time, else between its journal neighbours
("order"), else nowhere ("none").
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Placed", "Track", "place"]


@dataclass
class Track:
    """One drawn trace file, as placement sees it: steps and absolute times of its rows."""

    steps: np.ndarray
    times: np.ndarray
    decisions: Mapping[int, str]  # step -> decision text
    gap: float  # median steps between rows (the evaluation interval)

    @classmethod
    def of(cls, steps: np.ndarray, times: np.ndarray, decisions: Mapping[int, str]) -> Track:
        d = np.diff(steps)
        gap = float(np.median(d)) if len(d) else 1.0
        return cls(steps, times, decisions, max(gap, 1.0))

    def covers(self, step: int, slack: float, before: int = 0) -> bool:
        return bool(self.steps[0] - before - slack <= step <= self.steps[-1] + slack)

    def time_at(self, step: float) -> float:
        s, t = self.steps, self.times
        if len(s) == 1:
            return float(t[0])
        if s[0] <= step <= s[-1]:
            return float(np.interp(step, s, t))
        # Outside the rows: continue at the file's mean pace.
        pace = (t[-1] - t[0]) / (s[-1] - s[0]) if s[-1] > s[0] else 0.0
        end = 0 if step < s[0] else -1
        return float(t[end] + (step - s[end]) * pace)

    def pins(self, step: int, reason: str) -> bool:
        if not reason:
            return False
        if self.decisions.get(step) == reason:
            return True
        return reason.startswith("precursor") and self.decisions.get(step + 1) == reason


@dataclass(frozen=True)
class Placed:
    time: float | None  # absolute (epoch seconds)
    source: str  # trace | manifest | order | none
    track: int | None  # index of the track it was placed in


def _pick(
    tracks: Sequence[Track], cur: int, prev: int | None, step: int, reason: str, utc: float | None
) -> int | None:
    later = range(cur + 1, len(tracks))
    here = [cur] if cur < len(tracks) and (prev is None or step >= prev) else []
    order = here + list(later)
    before = 1 if reason.startswith("precursor") else 0
    strict = [j for j in order if tracks[j].covers(step, 0, before)]
    loose = [j for j in order if tracks[j].covers(step, tracks[j].gap, before)]
    if utc is not None and loose:
        return min(loose, key=lambda j: abs(tracks[j].time_at(step) - utc))
    pinned = [j for j in loose if tracks[j].pins(step, reason)]
    if pinned:
        return pinned[0]
    ends_process = reason == "final" or reason.startswith("preemption")
    if ends_process and here and tracks[cur].covers(step, tracks[cur].gap):
        return cur  # taken as the process ends: after its last trace row, in the current file
    if strict:
        return strict[0]
    return loose[0] if loose else None


def place(
    items: Sequence[tuple[int, str]],
    tracks: Sequence[Track],
    utc: Sequence[float | None] | None = None,
) -> list[Placed]:
    """Times for journal entries ``(step, reason)``, given in journal order; ``utc``: the
    manifest's time of each where known."""
    out: list[Placed] = []
    cur, prev = 0, None
    for n, (step, reason) in enumerate(items):
        known = utc[n] if utc is not None else None
        j = _pick(tracks, cur, prev, step, reason, known)
        if j is None:
            out.append(Placed(known, "manifest" if known is not None else "none", None))
            continue
        if j != cur:
            cur, prev = j, None
        prev = step if prev is None else max(prev, step)
        out.append(Placed(tracks[j].time_at(step), "trace", j))
    # Nothing tells: between its journal neighbours (journal order is time order).
    known_at = [i for i, p in enumerate(out) if p.time is not None]
    for i, p in enumerate(out):
        if p.time is not None or not known_at:
            continue
        k = bisect.bisect_left(known_at, i)
        ref = out[known_at[k - 1]] if k > 0 else out[known_at[0]]
        out[i] = Placed(ref.time, "order", None)
    return out
