"""Min/max decimation: at most two points per pixel column, and the line looks the same.

A line drawn through a million points over 1,200 pixel columns paints, in each column, a vertical
stroke from the column's smallest value to its largest. Keeping exactly those two points per
column (in their x order, so the stroke joins its neighbours the same way) draws the same
picture from 2,400 points: every spike survives, however narrow. Averaging or striding would
not: a one-row loss spike is what a reader is looking for.

Markers (checkpoints, restarts, non-finite losses) are never decimated: they are few and each
one matters; they are handled by the callers and never pass through here.

Pure numpy, no I/O: ``minmax`` takes x (non-decreasing within the segment) and y and returns the
indices to keep.
"""

from __future__ import annotations

import numpy as np

__all__ = ["minmax"]


def minmax(x: np.ndarray, y: np.ndarray, lo: float, hi: float, bins: int) -> np.ndarray:
    """Indices of the rows to keep: in each of ``bins`` equal columns of [lo, hi], the row of
    the smallest and of the largest finite y, in row order. Rows with a non-finite y are left
    out (a line cannot draw them; callers mark non-finite losses separately). ``bins`` <= 0, or
    fewer rows than 2 × bins: every finite row."""
    finite = np.flatnonzero(np.isfinite(y))
    if bins <= 0 or len(finite) <= 2 * bins:
        return finite
    xs, ys = x[finite], y[finite]
    span = hi - lo if hi > lo else 1.0
    col = np.clip(((xs - lo) / span * bins).astype(np.int64), 0, bins - 1)
    if len(col) > 1 and bool((col[1:] < col[:-1]).any()):
        return finite[_sorted_pick(col, ys)]
    # x in order (the usual case: a trace's time and step only grow): each column is a run of
    # rows, and its extremes come from one pass of reduceat, no sort.
    starts = np.flatnonzero(np.r_[True, col[1:] != col[:-1]])
    group = np.cumsum(np.r_[True, col[1:] != col[:-1]]) - 1
    keep = np.union1d(
        _first_in_group(ys == np.minimum.reduceat(ys, starts)[group], group),
        _first_in_group(ys == np.maximum.reduceat(ys, starts)[group], group),
    )
    return finite[keep]


def _first_in_group(hit: np.ndarray, group: np.ndarray) -> np.ndarray:
    rows = np.flatnonzero(hit)
    g = group[rows]
    return rows[np.r_[True, g[1:] != g[:-1]]]


def _sorted_pick(col: np.ndarray, ys: np.ndarray) -> np.ndarray:
    # Sorting by (column, y) puts each column's minimum first and its maximum last.
    order = np.lexsort((ys, col))
    col_sorted = col[order]
    first = np.flatnonzero(np.r_[True, col_sorted[1:] != col_sorted[:-1]])
    last = np.r_[first[1:] - 1, len(order) - 1]
    return np.union1d(order[first], order[last])  # sorted: row order; one point if min is max
