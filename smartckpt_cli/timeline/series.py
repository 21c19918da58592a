"""The series of a timeline: each signal's shown rows, decimated per track to pixel columns,
tracks joined by a NaN (no line across a restart); and the non-finite loss marks."""

from __future__ import annotations

import numpy as np

from smartckpt_cli.timeline.decimate import minmax
from smartckpt_cli.timeline.model import Mark, Segment, Series, Timeline
from smartckpt_cli.timeline.tracks import Drawn

__all__ = ["SERIES", "add_series", "data_range"]

# (name, trace column or derived name, label, log scale)
SERIES = (
    ("loss_raw", "raw_loss", "loss", False),
    ("loss", "loss", "loss (median-filtered, as the trigger sees it)", False),
    ("loss_median", "loss_median", "loss, median of {smooth} rows", False),
    ("curvature", "curvature", "curvature", False),
    ("grad_var", "grad_var", "gradient variance", True),
    ("update", "update", "planned update", True),
    ("score", "score", "trigger score", False),
    ("unsaved", "unsaved", "work not in a checkpoint (s)", False),
    ("memory", "memory", "memory in use (of the tightest ceiling)", False),
)


def data_range(drawn: list[Drawn], axis: str, t0: float) -> list[float]:
    """The smallest and largest x of the shown rows (empty when none is shown)."""
    xs: list[float] = []
    for d in drawn:
        if d.mask.any():
            v = d.table.columns["time" if axis == "time" else "step"][d.mask]
            off = t0 if axis == "time" else 0.0
            xs += [float(v.min()) - off, float(v.max()) - off]
    return xs


def add_series(tl: Timeline, drawn: list[Drawn], lo: float, hi: float, smooth: int) -> None:
    """Fill ``tl.series``, ``tl.segments`` and ``tl.nonfinite`` from the shown rows."""
    gap = np.array([np.nan])
    for name, col, label, log in SERIES:
        steps: list[np.ndarray] = []
        times: list[np.ndarray] = []
        values: list[np.ndarray] = []
        rows = 0
        for d in drawn:
            y_all = d.column(col)
            if y_all is None or not d.mask.any():
                continue
            m = d.mask
            st, tm, y = d.table.columns["step"][m], d.table.columns["time"][m] - tl.t0, y_all[m]
            if log:
                y = np.where(y > 0, y, np.nan)
            rows += int(np.isfinite(y).sum())
            keep = minmax(tm if tl.axis == "time" else st, y, lo, hi, tl.bins)
            if len(keep):
                steps += [st[keep], gap]
                times += [tm[keep], gap]
                values += [y[keep], gap]
        if rows == 0 or not values:
            continue
        if name == "loss" and "loss_raw" in tl.series:
            label = "loss (median-filtered by the trainer)"
        elif name == "loss":
            label = "loss (as traced: median-filtered by the trainer)"
        tl.series[name] = Series(
            name,
            label.format(smooth=smooth),
            np.concatenate(steps[:-1]),
            np.concatenate(times[:-1]),
            np.concatenate(values[:-1]),
            rows,
            log,
        )
    for d in drawn:
        if not d.mask.any():
            continue
        st, tm = d.table.columns["step"][d.mask], d.table.columns["time"][d.mask] - tl.t0
        tl.segments.append(
            Segment(d.table.path, int(st[0]), int(st[-1]), float(tm.min()), float(tm.max()), len(st), d.ranks)
        )
        tl.nonfinite += _nonfinite(d, tl, lo, hi)


def _nonfinite(d: Drawn, tl: Timeline, lo: float, hi: float) -> list[Mark]:
    """Rows whose loss was written nan/inf (a divergence), one mark per pixel column."""
    bad = d.table.nonfinite.get("loss")
    if bad is None:
        return []
    bad = bad[d.mask[bad]]
    steps, times = d.table.columns["step"][bad], d.table.columns["time"][bad] - tl.t0
    x = times if tl.axis == "time" else steps
    span = hi - lo if hi > lo else 1.0
    cols = np.floor((x - lo) / span * tl.bins) if tl.bins else np.arange(len(bad))
    _, first = np.unique(cols, return_index=True)
    return [Mark(int(steps[i]), float(times[i])) for i in sorted(first.tolist())]
