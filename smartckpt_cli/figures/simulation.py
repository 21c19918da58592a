"""Drawing ``smartckpt simulate --plot``: one trace, the checkpoints each policy would take.

The trace's loss on top with the divergence events shaded; below it one row per policy (fixed,
seed, adaptive), calibrated to the same number of checkpoints, each save a tick coloured by its
reason. For every onset, the checkpoint the policy could roll back to (the newest retained one
before it) is ringed and joined to the onset by a line labelled with the distance: the work a
rollback there would redo. Same colours as ``smartckpt plot``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from smartckpt_cli.figures.base import CATEGORY_COLORS, matplotlib, time_unit
from smartckpt_cli.simulate import Onset, PolicyResult, SimResult, Trace
from smartckpt_cli.timeline.decimate import minmax
from smartckpt_cli.timeline.kinds import CATEGORIES, reason_category

__all__ = ["draw_simulation"]

_ONSET = "#AA3377"


def draw_simulation(
    result: SimResult, trace: Trace, *, width: float = 12.0, dpi: int = 100, bins: int = 2000
) -> Any:
    matplotlib()
    from matplotlib.figure import Figure

    start = trace.start
    unit, per = time_unit(trace.duration)
    heights = [2.6] + [0.9] * len(result.policies)
    fig = Figure(figsize=(width, sum(heights) + 1.0), dpi=dpi, layout="constrained")
    axes = fig.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights})
    _draw_trace(axes, result, trace, per, bins)
    seen: set[str] = set()
    for ax, p in zip(axes[1:], result.policies, strict=True):
        seen.update(_draw_policy(ax, p, result.onsets, start, per))
    axes[-1].set_xlabel(f"time since the trace's start ({unit})")
    axes[-1].set_xlim(0, max(trace.duration, 1e-9) / per)
    for ax in axes:
        ax.tick_params(labelsize=8)
    handles = _legend_handles(result, seen)
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title="saves", title_fontsize=8)
    cfg = result.config
    fig.suptitle(
        f"{result.source}\nevery policy at {result.target} checkpoints · MTBF {cfg.mtbf:g} s · save cost "
        f"{cfg.save_cost:g} s · commit after {cfg.save_total:g} s",
        fontsize=9,
    )
    return fig


def _draw_trace(axes: Any, result: SimResult, trace: Trace, per: float, bins: int) -> None:
    """The trace's loss on the top panel, each divergence event shaded through every panel."""
    start = trace.start
    t = np.array([r.time - start for r in trace.rows])
    loss = np.array([np.nan if r.loss is None else r.loss for r in trace.rows], dtype=np.float64)
    keep = minmax(t, loss, 0.0, max(trace.duration, 1e-9), bins)
    axes[0].plot(t[keep] / per, loss[keep], color="#08519C", lw=1.0, label="loss (trace)")
    axes[0].set_ylabel("loss")
    for o in result.onsets:
        for ax in axes:
            ax.axvspan(
                (o.time - start) / per,
                max(o.end_time - start, o.time - start) / per,
                color=_ONSET,
                alpha=0.12,
                lw=0,
            )
        axes[0].text(
            (o.time - start) / per, 0.98, f"onset {o.step} ", transform=axes[0].get_xaxis_transform(),
            rotation=90, va="top", ha="right", fontsize=8, color=_ONSET,
        )  # fmt: skip


def _draw_policy(ax: Any, p: PolicyResult, onsets: Sequence[Onset], start: float, per: float) -> list[str]:
    """One policy's row: its saves, and for each onset the checkpoint it would roll back to,
    joined to the onset. Returns the saves' categories."""
    xs = np.array([(s.time - start) / per for s in p.saves])
    cats = [reason_category(s.reason) for s in p.saves]
    colors = [CATEGORY_COLORS[c] for c in cats]
    styles = ["-" if s.healthy else ":" for s in p.saves]
    if len(xs):
        ax.vlines(xs, 0.1, 0.9, colors=colors, linestyles=styles, lw=1.6, gid=f"saves:{p.name}")
    for o, res in zip(onsets, p.onsets, strict=True):
        if res.checkpoint_step is None:
            continue
        held = [s for s in p.saves if s.step == res.checkpoint_step and s.time <= o.time]
        if not held:
            continue
        x0, x1 = (held[-1].time - start) / per, (o.time - start) / per
        ax.plot([x0], [0.5], marker="o", ms=9, mfc="none", mec=_ONSET, mew=1.4)
        ax.annotate("", (x1, 0.5), (x0, 0.5), arrowprops={"arrowstyle": "->", "color": _ONSET, "lw": 1.0})
        ax.text((x0 + x1) / 2, 0.62, f"{res.distance:,.0f} s", ha="center", fontsize=7, color=_ONSET)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_ylabel(p.name, rotation=0, ha="right", va="center")
    mark = "" if p.exact_count else "*"
    ax.set_title(
        f"{p.checkpoints}{mark} checkpoints · {p.knob} · lost per failure {p.mean_lost:,.1f} s · "
        f"overhead {p.overhead:.2%}",
        fontsize=8,
        loc="left",
    )
    return cats


def _legend_handles(result: SimResult, seen: set[str]) -> list[Any]:
    """The save categories drawn, unhealthy saves and divergence events if any."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [
        Line2D([], [], color=CATEGORY_COLORS[c], lw=2, label=c) for c in CATEGORIES if c in seen
    ]
    if any(not s.healthy for p in result.policies for s in p.saves):
        handles.append(Line2D([], [], color="#777777", lw=2, ls=":", label="unhealthy (non-finite loss)"))
    if result.onsets:
        handles += [
            Patch(color=_ONSET, alpha=0.25, label="divergence event"),
            Line2D([], [], ls="", marker="o", mfc="none", mec=_ONSET, label="rolled back to"),
        ]
    return handles
