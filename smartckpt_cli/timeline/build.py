"""Assemble a :class:`~smartckpt_cli.timeline.model.Timeline` from what a store holds. Pure:
:mod:`~smartckpt_cli.timeline.load` does the reading and hands over :class:`StoreFacts`.

Order of work, and why:

1. **Trace files → tracks.** One file per process; files written over the same time are other
   ranks of one job, and one of them (the longest) is drawn: N identical loss lines would hide
   each other and the markers.
2. **Journal → checkpoint times** (:mod:`~smartckpt_cli.timeline.place`), on the *whole* traces,
   before any filtering, so that ``--steps`` or ``--run`` cannot change where a checkpoint lands.
3. **Derived series on full resolution**: the median-filtered loss, and the work not yet in a
   checkpoint (seconds since the newest healthy checkpoint of the process, or its start), which
   ``max_interval`` bounds: the budget line is drawn against it.
4. **Filter** rows, checkpoints and restarts by ``--run`` (the run record's time window and its
   attempts) and ``--steps``.
5. **Decimate** each series per track (:mod:`~smartckpt_cli.timeline.decimate`) over the x range
   of everything drawn; markers are never decimated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from smartckpt_cli.errors import UsageError
from smartckpt_cli.store.journal import CheckpointRecord, fold
from smartckpt_cli.timeline.kinds import policies_shown, reason_category, restart_label
from smartckpt_cli.timeline.model import CheckpointMark, FailedSave, RestartMark, Timeline
from smartckpt_cli.timeline.place import Placed, place
from smartckpt_cli.timeline.series import add_series, data_range
from smartckpt_cli.timeline.tracetable import TraceTable
from smartckpt_cli.timeline.tracks import Drawn, drawn_tracks, median_filter, unsaved_work

__all__ = ["PlotOptions", "StoreFacts", "build_timeline", "parse_steps", "recorded_settings"]


@dataclass(frozen=True)
class PlotOptions:
    axis: str = "time"  # time | step
    steps: tuple[int | None, int | None] | None = None
    run_id: str | None = None
    bins: int = 2000  # pixel columns to decimate to (0: keep every row)
    smooth: int = 9  # rows in the plot's own median filter of the loss
    max_interval: float = 180.0
    policy: str = "adaptive"
    threshold: float = 0.65  # the seed policy's


@dataclass(frozen=True)
class StoreFacts:
    """What the loader read from a store."""

    store: str
    tables: Sequence[TraceTable]
    events: Sequence[dict[str, Any]]  # journal events, in journal order
    runs: Sequence[dict[str, Any]] = ()  # run records (``<dir>/runs/*.json``)
    manifest_utc: Mapping[str, float] = field(default_factory=dict)  # checkpoint id -> epoch s
    remote: dict[str, Any] | None = None  # ``remote-status.json``


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """``A:B``, ``A:`` or ``:B`` (inclusive)."""
    a, sep, b = text.partition(":")
    try:
        if not sep:
            raise ValueError
        lo = int(a) if a.strip() else None
        hi = int(b) if b.strip() else None
    except ValueError:
        raise UsageError(f"--steps must be A:B, A: or :B (steps, inclusive), not {text!r}") from None
    if lo is not None and hi is not None and hi < lo:
        raise UsageError(f"--steps {text}: the range ends before it starts")
    return lo, hi


def _in_steps(step: float, steps: tuple[int | None, int | None] | None) -> bool:
    if steps is None:
        return True
    lo, hi = steps
    return (lo is None or step >= lo) and (hi is None or step <= hi)


def _thresholds(policy: str, threshold: float) -> dict[str, float]:
    if policy == "seed":
        return {"threshold": threshold}
    if policy == "adaptive":
        from smartckpt_cli.trigger.adaptive import AdaptivePolicy

        # The adaptive risk is sigmoid(2 (z - 4)) of the signals' robust z; below 0.5 a save is
        # calm, and z >= alarm_z on the variance or the planned update raises the alarm.
        return {"calm": 0.5, "alarm": 1.0 / (1.0 + math.exp(-2.0 * (AdaptivePolicy.alarm_z - 4.0)))}
    return {}


def _policy(reasons: list[str], configured: str) -> tuple[str, str]:
    """(the policy whose lines are drawn, how the title names it). The checkpoints' reasons are
    the evidence (a store saved "every 10 steps" was not adaptive, whatever the settings here
    say); the settings only when no checkpoint shows a policy."""
    shown = policies_shown(reasons)
    if not shown:
        return configured, f"{configured} (the settings; no checkpoint shows a policy)"
    return shown[-1][0], ", then ".join(f"{name}: {detail}" if detail else name for name, detail in shown)


# ---------------------------------------------------------------- runs


def recorded_settings(runs: Sequence[dict[str, Any]], run_id: str | None) -> dict[str, Any] | None:
    """The settings a run started with, from its run record: the run ``run_id``, else the newest
    run that recorded them; None when no record has them (records written before they did)."""
    chosen = [r for r in runs if run_id is None or r.get("run_id") == run_id]
    with_settings = [r for r in chosen if isinstance(r.get("settings"), dict) and r["settings"]]
    if not with_settings:
        return None
    return dict(max(with_settings, key=lambda r: r.get("started") or 0)["settings"])


def _select_run(runs: Sequence[dict[str, Any]], run_id: str | None, store: str) -> dict[str, Any] | None:
    if run_id is None:
        return None
    for r in runs:
        if r.get("run_id") == run_id:
            return r
    if not runs:
        raise UsageError(f"no run {run_id!r} in {store}: it has no run records (smartckpt run writes them)")
    ids = [str(r.get("run_id")) for r in sorted(runs, key=lambda r: r.get("started") or 0)]
    listed = ", ".join(ids[-5:]) + (f" (and {len(ids) - 5} older)" if len(ids) > 5 else "")
    raise UsageError(f"no run {run_id!r} in {store}; its runs: {listed}")


Failure = tuple[dict[str, Any], dict[str, Any], bool]  # (run, attempt, another attempt followed)


def _restarts(runs: Sequence[dict[str, Any]]) -> list[Failure]:
    """(run, attempt, another attempt followed) for every attempt that ended other than done."""
    out = []
    for run in sorted(runs, key=lambda r: r.get("started") or 0):
        attempts = list(run.get("attempts") or [])
        for n, att in enumerate(attempts):
            if att.get("category") in (None, "", "done"):
                continue
            out.append((run, att, n + 1 < len(attempts)))
    return out


# ---------------------------------------------------------------- the timeline


Entry = CheckpointRecord | dict[str, Any]  # a commit, or a save_failed event


def _entries(facts: StoreFacts) -> tuple[list[Entry], list[CheckpointRecord]]:
    """Commits and failed saves, in journal order; and every checkpoint record."""
    _, records, _ = fold(list(facts.events))
    by_pos = {r.position: r for r in records}
    out: list[Entry] = []
    for pos, ev in enumerate(facts.events):
        if ev.get("event") == "commit" and pos in by_pos:
            out.append(by_pos[pos])
        elif ev.get("event") == "save_failed" and isinstance(ev.get("step"), int):
            out.append(ev)
    return out, records


def _step(e: Entry) -> int:
    return e.step if isinstance(e, CheckpointRecord) else int(e["step"])


def _show_rows(
    drawn: list[Drawn], window: tuple[float, float], steps: tuple[int | None, int | None] | None
) -> int:
    total = 0
    for d in drawn:
        st, tm = d.table.columns["step"], d.table.columns["time"]
        m = (tm >= window[0]) & (tm <= window[1])
        if steps is not None:
            if steps[0] is not None:
                m &= st >= steps[0]
            if steps[1] is not None:
                m &= st <= steps[1]
        d.mask = m
        total += int(m.sum())
    return total


def _outside(
    drawn: list[Drawn],
    window: tuple[float, float],
    records: list[CheckpointRecord],
    steps: tuple[int | None, int | None],
) -> UsageError:
    shown = f"{'' if steps[0] is None else steps[0]}:{'' if steps[1] is None else steps[1]}"
    spans = [
        (float(d.table.columns["step"].min()), float(d.table.columns["step"].max()))
        for d in drawn
        if ((d.table.columns["time"] >= window[0]) & (d.table.columns["time"] <= window[1])).any()
    ]
    if spans:
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
        return UsageError(f"steps {shown} are outside the trace (steps {lo:.0f}..{hi:.0f})")
    ck = [r.step for r in records]
    where = f"outside the checkpoints (steps {min(ck)}..{max(ck)})" if ck else "and no checkpoints either"
    return UsageError(f"steps {shown} are outside the trace: the store has no trace rows, {where}")


def _restart_mark(run: dict[str, Any], a: dict[str, Any], again: bool, t0: float) -> RestartMark:
    ended = float(a["ended"]) if a.get("ended") else None
    lost_s = a.get("seconds_lost")
    frm, top = a.get("restart_from"), a.get("max_step")
    category, cause = str(a.get("category", "")), str(a.get("cause", ""))
    return RestartMark(
        run_id=str(run.get("run_id", "")),
        attempt=int(a.get("attempt", 0)),
        category=category,
        cause=cause,
        label=restart_label(category, cause),
        time=None if ended is None else ended - t0,
        step=top,
        restart_from=frm,
        steps_lost=a.get("steps_lost"),
        seconds_lost=lost_s,
        lost_time=(ended - float(lost_s) - t0, ended - t0)
        if ended is not None and lost_s is not None
        else None,
        lost_steps=(int(frm), int(top)) if frm is not None and top is not None and top >= frm else None,
        restarted=again,
    )


def _checkpoint_mark(
    e: CheckpointRecord, p: Placed, t0: float, remote: dict[str, Any] | None
) -> CheckpointMark:
    where = None
    if remote:
        where = (
            "pending" if e.step in (remote.get("pending_steps") or [])
            else "uploaded" if e.step in (remote.get("remote_steps") or [])
            else None
        )  # fmt: skip
    return CheckpointMark(
        step=e.step,
        id=e.id,
        position=e.position,
        time=None if p.time is None else p.time - t0,
        time_source=p.source,
        reason=e.reason,
        category=reason_category(e.reason),
        health=e.health,
        calm=e.calm,
        state="pruned" if e.pruned else "rolled back" if e.rolled_back else "live",
        score=e.score,
        remote=where,
    )


def _remote_json(remote: dict[str, Any] | None, t0: float) -> dict[str, Any] | None:
    if not remote:
        return None
    updated = remote.get("updated")
    return {
        "remote": remote.get("remote"),
        "pending": remote.get("pending"),
        "pending_steps": remote.get("pending_steps"),
        "remote_steps": remote.get("remote_steps"),
        "last_error": remote.get("last_error"),
        "updated": updated - t0 if isinstance(updated, int | float) else None,
    }


def build_timeline(facts: StoreFacts, opts: PlotOptions) -> Timeline:
    """The timeline of a store (or of one run, or a range of steps): see the module docstring."""
    drawn = drawn_tracks(facts.tables)
    entries, records = _entries(facts)
    utc = [facts.manifest_utc.get(e.id) if isinstance(e, CheckpointRecord) else None for e in entries]
    placed = place(
        [(_step(e), e.reason if isinstance(e, CheckpointRecord) else "") for e in entries],
        [d.track for d in drawn],
        utc,
    )
    _derive(drawn, entries, placed, opts.smooth)

    run = _select_run(facts.runs, opts.run_id, facts.store)
    window = (-math.inf, math.inf)
    if run is not None:
        window = (float(run.get("started") or -math.inf), float(run.get("ended") or math.inf))
    rows = _show_rows(drawn, window, opts.steps)
    kept = [
        (e, p)
        for e, p in zip(entries, placed, strict=True)
        if (run is None or (p.time is not None and window[0] <= p.time <= window[1]))
        and _in_steps(_step(e), opts.steps)
    ]
    failures = _restarts([run] if run is not None else facts.runs)
    if opts.steps is not None:
        failures = _failures_in(failures, opts.steps)
        if rows == 0 and not any(isinstance(e, CheckpointRecord) for e, _ in kept):
            raise _outside(drawn, window, records, opts.steps)
    t0 = _time_zero(drawn, kept, failures, run)
    tl = _timeline(facts, opts, t0, kept, failures, rows, sum(d.table.skipped for d in drawn))
    if run is not None:
        tl.run = _run_json(run, t0)
    xs = data_range(drawn, tl.axis, t0)
    if tl.checkpoints or tl.restarts:
        xs += list(tl.x_range())
    lo, hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
    add_series(tl, drawn, lo, hi, opts.smooth)
    return tl


def _derive(drawn: list[Drawn], entries: list[Entry], placed: list[Placed], smooth: int) -> None:
    """Step 3 (module docstring): each track's median-filtered loss and unsaved work, on the
    whole trace."""
    for j, d in enumerate(drawn):
        cols = d.table.columns
        if "loss" in cols and "raw_loss" not in cols:
            d.derived["loss_median"] = median_filter(
                cols["loss"], max(1, smooth), d.table.nonfinite.get("loss")
            )
        saves = sorted(
            p.time
            for e, p in zip(entries, placed, strict=True)
            if isinstance(e, CheckpointRecord) and e.health == "ok" and p.track == j and p.time is not None
        )
        d.derived["unsaved"] = unsaved_work(cols["time"], np.asarray(saves, dtype=np.float64))


def _failures_in(failures: list[Failure], steps: tuple[int | None, int | None]) -> list[Failure]:
    """The failures whose step, or whose lost span of steps, is in ``steps``."""
    lo_s, hi_s = steps
    return [
        (r, a, again)
        for r, a, again in failures
        if _in_steps(a.get("max_step") or -1, steps)
        or (
            a.get("restart_from") is not None
            and a.get("max_step") is not None
            and (hi_s is None or a["restart_from"] <= hi_s)
            and (lo_s is None or a["max_step"] >= lo_s)
        )
    ]


def _time_zero(
    drawn: list[Drawn], kept: list[tuple[Entry, Placed]], failures: list[Failure], run: dict[str, Any] | None
) -> float:
    """Time 0: the earliest thing shown."""
    starts = [float(d.table.columns["time"][d.mask].min()) for d in drawn if d.mask.any()]
    starts += [p.time for _, p in kept if p.time is not None]
    starts += [
        float(a["ended"]) - float(a["seconds_lost"])
        for _, a, _ in failures
        if a.get("ended") and a.get("seconds_lost") is not None
    ]
    if run is not None and run.get("started"):
        starts.append(float(run["started"]))
    return min(starts) if starts else 0.0


def _timeline(
    facts: StoreFacts,
    opts: PlotOptions,
    t0: float,
    kept: list[tuple[Entry, Placed]],
    failures: list[Failure],
    rows: int,
    skipped: int,
) -> Timeline:
    """The timeline's markers, spans and settings, times from ``t0``; no series yet."""
    policy, policy_text = _policy([e.reason for e, _ in kept if isinstance(e, CheckpointRecord)], opts.policy)
    return Timeline(
        store=facts.store,
        t0=t0,
        axis=opts.axis,
        segments=[],
        series={},
        checkpoints=[
            _checkpoint_mark(e, p, t0, facts.remote) for e, p in kept if isinstance(e, CheckpointRecord)
        ],
        restarts=[_restart_mark(r, a, again, t0) for r, a, again in failures],
        failed_saves=[
            FailedSave(_step(e), None if p.time is None else p.time - t0, str(e.get("error", "")))
            for e, p in kept
            if not isinstance(e, CheckpointRecord)
        ],
        max_interval=opts.max_interval,
        policy=policy,
        policy_text=policy_text,
        thresholds=_thresholds(policy, opts.threshold),
        steps=opts.steps,
        remote=_remote_json(facts.remote, t0),
        bins=opts.bins,
        trace_rows=rows,
        skipped_rows=skipped,
    )


def _run_json(run: dict[str, Any], t0: float) -> dict[str, Any]:
    return {
        "run_id": run.get("run_id"),
        "outcome": run.get("outcome"),
        "started": None if not run.get("started") else float(run["started"]) - t0,
        "ended": None if not run.get("ended") else float(run["ended"]) - t0,
        "restarts": max(0, len(run.get("attempts") or []) - 1),
        "command": run.get("command"),
    }
