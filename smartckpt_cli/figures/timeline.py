"""Drawing a :class:`~smartckpt_cli.timeline.Timeline`: one figure, panels sharing the x axis.

Top to bottom: the loss (the traced line and a smoother one, every checkpoint as a marker *on*
the loss, so "was the checkpoint before or after the loss blew up?" is read at a glance); a
strip with one row per checkpoint category (how often, and why, it saved); then curvature,
gradient variance and planned update (log scales), the trigger's score with its threshold, the
work not yet in a checkpoint with the ``max_interval`` budget as a line, and memory when the
trace records it. Restarts are dashed lines through every panel, labelled with their cause, and
the work each lost is a shaded span.

Marker code: colour = reason category; shape = health (circle calm, triangle saved while the
signals were not calm, cross unhealthy); faded = pruned or rolled back; a ring = not yet uploaded
to the remote tier. Artists carry ids (``gid``) that tests and SVG readers can find:
``checkpoints:<shape>`` (the strip's markers), ``restart:<run>:<attempt>`` and
``lost:<run>:<attempt>``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from smartckpt_cli.figures.base import CATEGORY_COLORS, LOST, RESTART, matplotlib, table_html, time_unit
from smartckpt_cli.timeline.kinds import CATEGORIES
from smartckpt_cli.timeline.model import CheckpointMark, RestartMark, Series, Timeline

__all__ = ["draw_timeline", "timeline_html", "timeline_title"]

_PANELS = (
    # (series, y label, height)
    ("curvature", "curvature", 1.1),
    ("grad_var", "gradient\nvariance", 1.1),
    ("update", "planned\nupdate", 1.1),
    ("score", "trigger\nscore", 1.1),
    ("unsaved", "unsaved\nwork (s)", 1.1),
    ("memory", "memory\nin use", 1.0),
)
_SHAPES = (("calm", "o"), ("unsettled", "^"), ("unhealthy", "X"))
_REMOTE = "#7F3C8D"


def _shape(c: CheckpointMark) -> str:
    return "unhealthy" if not c.healthy else "calm" if c.calm else "unsettled"


def _finite(s: Series) -> int:
    return int(np.isfinite(s.value).sum())


def _decades(s: Series) -> float:
    """How many powers of ten a log panel's values span (0 without two positive values)."""
    v = s.value[np.isfinite(s.value) & (s.value > 0)]
    return float(np.log10(v.max() / v.min())) if len(v) >= 2 else 0.0


def timeline_title(tl: Timeline) -> str:
    restarts = sum(r.restarted for r in tl.restarts)
    what = f"run {tl.run['run_id']}" if tl.run else tl.store
    return f"{what}: {len(tl.checkpoints)} checkpoint(s), {restarts} restart(s)"


def _nearest(series: Series | None, axis: str, xs: np.ndarray) -> np.ndarray:
    """The line's value at each x (nearest drawn point), so markers sit on the loss."""
    if series is None or len(xs) == 0:
        return np.zeros(len(xs))
    x, y = series.x(axis), series.value
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) == 0:
        return np.zeros(len(xs))
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    i = np.clip(np.searchsorted(x, xs), 1, max(len(x) - 1, 1))
    left = np.clip(i - 1, 0, len(x) - 1)
    right = np.clip(i, 0, len(x) - 1)
    pick = np.where(np.abs(xs - x[left]) <= np.abs(x[right] - xs), left, right)
    return y[pick]


@dataclass(frozen=True)
class _Scale:
    """The x axis: time (in ``per`` seconds a unit) or step."""

    axis: str
    per: float

    def xs(self, values: Any) -> np.ndarray:
        return np.asarray(values, dtype=np.float64) / self.per

    def of_mark(self, time_: float | None, step: float | None) -> float | None:
        v = time_ if self.axis == "time" else step
        return None if v is None else float(v) / self.per


def draw_timeline(tl: Timeline, *, width: float = 12.0, dpi: int = 100) -> Any:
    """A matplotlib Figure (not shown, not saved: see :func:`~smartckpt_cli.figures.base.save`)."""
    matplotlib()  # the one import check, and the Agg backend
    from matplotlib.figure import Figure

    panels, not_drawn = _panels(tl)
    cats = [c for c in CATEGORIES if any(k.category == c for k in tl.checkpoints)]
    strip_rows = cats + (["failed save"] if tl.failed_saves else [])
    heights = [3.2, 0.45 + 0.28 * max(len(strip_rows), 1)] + [h for _, _, h in panels]
    fig = Figure(figsize=(width, sum(heights) + 1.1), dpi=dpi, layout="constrained")
    axes = fig.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights})
    ax_loss, ax_strip = axes[0], axes[1]

    lo, hi = tl.x_range()
    if tl.axis == "time":
        unit, per = time_unit(hi - lo)
        start = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(tl.t0))
        xlabel = f"time since {start} ({unit})"
    else:
        unit, per, xlabel = "", 1.0, "step"
    scale = _Scale(tl.axis, per)

    loss = _draw_loss(ax_loss, tl, scale)
    pending = _draw_checkpoints(ax_loss, ax_strip, tl, scale, loss, strip_rows)
    for ax, (name, label, _) in zip(axes[2:], panels, strict=True):
        _draw_signal(ax, tl, name, label, scale)
    for r in tl.restarts:
        _draw_restart(axes, r, tl.axis, scale)

    # ---- axes, legend, title
    pad = (hi - lo) * 0.01 if hi > lo else 1.0
    axes[-1].set_xlim((lo - pad) / per, (hi + pad) / per)
    for ax in axes:
        ax.tick_params(which="both", labelsize=8)
    handles = _legend_handles(cats, pending=pending, restarts=bool(tl.restarts))
    if ax_loss.get_legend_handles_labels()[0]:
        ax_loss.legend(loc="upper right", fontsize=8, framealpha=0.85)
    if not (tl.segments or tl.checkpoints or tl.restarts):
        ax_loss.text(0.5, 0.5, "nothing recorded yet", ha="center", va="center", transform=ax_loss.transAxes)
        xlabel = "time (s)" if tl.axis == "time" else "step"
    axes[-1].set_xlabel(xlabel)
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title="checkpoints", title_fontsize=8)
    fig.suptitle(timeline_title(tl) + "\n" + " · ".join(_subtitle(tl, not_drawn)), fontsize=10)
    return fig


def _panels(tl: Timeline) -> tuple[list[tuple[str, str, float]], list[str]]:
    """(the signal panels drawn, the signals not drawn, in words). A panel needs two finite
    values to draw a line; one with fewer is named in the subtitle instead of drawn empty (a
    short run traces a few rows, a policy may not trace a signal)."""
    panels = [p for p in _PANELS if p[0] in tl.series and _finite(tl.series[p[0]]) >= 2]
    not_drawn = [
        f"{label.replace(chr(10), ' ')} ({_finite(tl.series[name])} value(s) traced)"
        for name, label, _ in _PANELS
        if name in tl.series and _finite(tl.series[name]) < 2
    ]
    return panels, not_drawn


def _draw_loss(ax_loss: Any, tl: Timeline, scale: _Scale) -> Series | None:
    """The traced loss, a smoother one, non-finite losses and where each process starts.
    Returns the line the checkpoint markers sit on."""
    thin = tl.series.get("loss_raw") or tl.series.get("loss")
    thick = tl.series.get("loss") if "loss_raw" in tl.series else tl.series.get("loss_median")
    if thin is not None:
        ax_loss.plot(scale.xs(thin.x(tl.axis)), thin.value, color="#9ECAE1", lw=0.8, label=thin.label)
    if thick is not None:
        ax_loss.plot(scale.xs(thick.x(tl.axis)), thick.value, color="#08519C", lw=1.5, label=thick.label)
    ax_loss.set_ylabel("loss")
    if tl.nonfinite:
        ax_loss.scatter(
            [scale.of_mark(m.time, m.step) for m in tl.nonfinite],
            [0.97] * len(tl.nonfinite),
            transform=ax_loss.get_xaxis_transform(),
            marker="|",
            s=80,
            color=RESTART,
            label="loss nan/inf",
            zorder=4,
        )
    for seg in tl.segments[1:]:  # a new process starts here
        ax_loss.axvline(scale.of_mark(seg.start, seg.first_step), color="#BBBBBB", lw=0.7, ls=":", zorder=1)
    return thick or thin


def _draw_checkpoints(
    ax_loss: Any, ax_strip: Any, tl: Timeline, scale: _Scale, loss: Series | None, strip_rows: list[str]
) -> bool:
    """Every checkpoint on the loss and in its category's row of the strip, failed saves in
    theirs. Returns whether any is not yet remote (ringed)."""
    from matplotlib.colors import to_rgba

    marks = [c for c in tl.checkpoints if scale.of_mark(c.time, c.step) is not None]
    mx = np.array([scale.of_mark(c.time, c.step) for c in marks], dtype=np.float64)
    on_loss = _nearest(loss, tl.axis, mx * scale.per)
    row_of = {name: i for i, name in enumerate(strip_rows)}
    # Thousands of markers (a week of saves) would bury the loss line: smaller as they get many.
    size = 42.0 if len(marks) <= 150 else max(8.0, 42.0 * (150 / len(marks)) ** 0.5)
    for shape, marker in _SHAPES:
        idx = [i for i, c in enumerate(marks) if _shape(c) == shape]
        if not idx:
            continue
        colors = [
            to_rgba(CATEGORY_COLORS[marks[i].category], 0.3 if marks[i].state != "live" else 1.0) for i in idx
        ]
        edge = "black" if shape == "unhealthy" else "white"
        kw = {"marker": marker, "c": colors, "edgecolors": edge, "linewidths": 0.6, "zorder": 5}
        ax_loss.scatter(mx[idx], on_loss[idx], s=size, gid=f"loss-checkpoints:{shape}", **kw)
        ax_strip.scatter(
            mx[idx], [row_of[marks[i].category] for i in idx], s=size * 1.1, gid=f"checkpoints:{shape}", **kw
        )
    pending = [i for i, c in enumerate(marks) if c.remote == "pending"]
    if pending:
        for ax, ys in ((ax_loss, on_loss[pending]), (ax_strip, [row_of[marks[i].category] for i in pending])):
            ax.scatter(
                mx[pending], ys, s=130, facecolors="none", edgecolors=_REMOTE, linewidths=1.2, zorder=6
            )
    if tl.failed_saves:
        fx = [scale.of_mark(f.time, f.step) for f in tl.failed_saves]
        keep = [x for x in fx if x is not None]
        ax_strip.scatter(keep, [row_of["failed save"]] * len(keep), marker="x", color="black", s=40, zorder=5)
    ax_strip.set_yticks(range(len(strip_rows)), strip_rows, fontsize=8)
    ax_strip.set_ylim(-0.7, max(len(strip_rows), 1) - 0.3)
    ax_strip.invert_yaxis()
    ax_strip.set_ylabel("checkpoints")
    ax_strip.grid(axis="x", color="#EEEEEE", lw=0.6)
    return bool(pending)


def _draw_signal(ax: Any, tl: Timeline, name: str, label: str, scale: _Scale) -> None:
    """One signal panel, with the score's thresholds, the unsaved work's budget line, or the
    memory's range from 0."""
    from matplotlib.ticker import NullFormatter

    s = tl.series[name]
    ax.plot(scale.xs(s.x(tl.axis)), s.value, color="#444444", lw=0.9)
    ax.set_ylabel(label, fontsize=9)
    if s.log:
        ax.set_yscale("log")
        if _decades(s) > 1.0:  # decades only: minor labels overlap; inside one, matplotlib's own
            ax.yaxis.set_minor_formatter(NullFormatter())
    if name == "score":
        for n, (what, v) in enumerate(sorted(tl.thresholds.items(), key=lambda kv: kv[1])):
            color = "#CC3311" if what in ("alarm", "threshold") else "#999999"
            ax.axhline(v, color=color, ls="--", lw=0.9, label=f"{what} {v:.2f}", zorder=n)
        ax.set_ylim(-0.03, 1.03)
        if tl.thresholds:
            ax.legend(loc="upper left", fontsize=7, framealpha=0.8)
    elif name == "unsaved":
        ax.axhline(
            tl.max_interval, color=CATEGORY_COLORS["budget"], ls="--", lw=1.1, label="max_interval budget"
        )
        top = float(np.nanmax(s.value)) if np.isfinite(s.value).any() else 0.0
        ax.set_ylim(0, max(tl.max_interval, top) * 1.12)
        ax.legend(loc="upper right", fontsize=7, framealpha=0.8)
    elif name == "memory":
        top = float(np.nanmax(s.value)) if np.isfinite(s.value).any() else 1.0
        ax.set_ylim(0, max(1.0, top) * 1.05)


def _draw_restart(axes: Any, r: RestartMark, axis: str, scale: _Scale) -> None:
    """A restart and the work it lost, through every panel; its cause on the loss panel."""
    tag = f"{r.run_id}:{r.attempt}"
    span = r.lost_time if axis == "time" else r.lost_steps
    x = scale.of_mark(r.time, r.step)
    for n, ax in enumerate(axes):
        if span is not None:
            ax.axvspan(
                span[0] / scale.per,
                span[1] / scale.per,
                color=LOST,
                alpha=0.13,
                lw=0,
                gid=f"lost:{tag}" if n == 0 else None,
            )
        if x is not None:
            ax.axvline(x, color=RESTART, lw=1.1, ls="--", gid=f"restart:{tag}" if n == 0 else None)
    if x is not None:
        axes[0].text(
            x,
            0.99,
            _restart_text(r) + " ",
            transform=axes[0].get_xaxis_transform(),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color=RESTART,
        )


def _restart_text(r: RestartMark) -> str:
    lost = []
    if r.steps_lost is not None:
        lost.append(f"{r.steps_lost} steps")
    if r.seconds_lost is not None:
        lost.append(f"{r.seconds_lost:,.1f} s")
    text = r.label + (f": lost {', '.join(lost)}" if lost else "")
    if r.restart_from == 0 and r.restarted and (r.step or 0) > 0:
        text += " (began again at step 0)"
    return text


def _legend_handles(cats: list[str], *, pending: bool, restarts: bool) -> list[Any]:
    """The figure's legend: the categories shown, the marker code, rings and restarts if drawn."""
    from matplotlib.colors import to_rgba
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [Line2D([], [], ls="", marker="o", color=CATEGORY_COLORS[c], label=c) for c in cats]
    handles += [
        Line2D([], [], ls="", marker="o", mfc="#777777", mec="white", label="calm"),
        Line2D([], [], ls="", marker="^", mfc="#777777", mec="white", label="not calm"),
        Line2D([], [], ls="", marker="X", mfc="#777777", mec="black", label="unhealthy"),
        Line2D(
            [], [], ls="", marker="o", mfc=to_rgba("#777777", 0.3), mec="white", label="pruned / rolled back"
        ),
    ]
    if pending:
        handles.append(
            Line2D([], [], ls="", marker="o", mfc="none", mec=_REMOTE, ms=10, label="not yet remote")
        )
    if restarts:
        handles += [
            Line2D([], [], color=RESTART, ls="--", label="restart (cause)"),
            Patch(color=LOST, alpha=0.25, label="work lost"),
        ]
    return handles


def _subtitle(tl: Timeline, not_drawn: list[str]) -> list[str]:
    sub = [f"policy {tl.policy_text or tl.policy}", f"max_interval {tl.max_interval:g} s"]
    if tl.steps:
        sub.append(
            f"steps {tl.steps[0] if tl.steps[0] is not None else ''}:{tl.steps[1] if tl.steps[1] is not None else ''}"
        )
    if not_drawn:
        sub.append("not drawn: " + ", ".join(not_drawn))
    if tl.remote:
        sub.append(f"remote {tl.remote.get('remote')}: {tl.remote.get('pending') or 0} not yet uploaded")
    return sub


def timeline_html(tl: Timeline) -> str:
    """The tables below the figure in ``-o run.html``."""

    def when(t: float | None) -> str:
        return (
            ""
            if t is None or not math.isfinite(t)
            else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(tl.t0 + t))
        )

    ck = [
        [
            c.step,
            when(c.time),
            c.reason,
            c.category,
            c.health,
            "yes" if c.calm else "no",
            c.state,
            c.remote or "",
        ]
        for c in tl.checkpoints
    ]
    rs = [
        [r.run_id, r.attempt, when(r.time), r.cause, r.step, r.restart_from, r.steps_lost, r.seconds_lost]
        for r in tl.restarts
    ]
    return table_html(
        "Checkpoints", ["step", "taken (UTC)", "reason", "category", "health", "calm", "state", "remote"], ck
    ) + table_html(
        "Failures",
        ["run", "attempt", "ended (UTC)", "cause", "step", "restarted from", "steps lost", "seconds lost"],
        rs,
    )
