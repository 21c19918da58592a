"""The timeline behind ``smartckpt plot``, without I/O: trace columns by name, min/max
decimation, placing checkpoints on the traces' clock, and the assembled timeline (markers,
restart spans, filters, bad input)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from smartckpt_cli.errors import ConfigError, UsageError
from smartckpt_cli.timeline import (
    PlotOptions,
    StoreFacts,
    build_timeline,
    minmax,
    parse_steps,
    parse_table,
    reason_category,
    restart_label,
)
from smartckpt_cli.timeline.place import Track, place
from tests._names import cid as make_cid
from tests._names import commit

HEAD = "step,time,loss,curvature,grad_var,update,score,decision\n"


# ---------------------------------------------------------------- trace columns


def test_columns_are_read_by_name_unknown_ignored_empty_is_nan_written_nan_is_marked():
    text = (
        "time,step,future_col,loss,memory,decision,grad_var\n"
        "10.0,1,abc,,0.5,,1e-4\n"
        "11.0,2,x,nan,0.6,interval 10s,2e-4\n"
        "12.0,3,y,inf,,,\n"
    )
    t = parse_table(text, "t.csv")
    assert t.rows == 3 and t.skipped == 0
    assert "future_col" in t.columns  # unknown numeric-looking columns are read, never required
    assert t.columns["step"].tolist() == [1, 2, 3] and t.columns["time"].tolist() == [10, 11, 12]
    loss = t.columns["loss"]
    assert math.isnan(loss[0]) and math.isnan(loss[1]) and math.isinf(loss[2])
    assert t.nonfinite["loss"].tolist() == [1, 2]  # the empty one is no divergence
    assert t.columns["memory"][:2].tolist() == [0.5, 0.6] and math.isnan(t.columns["memory"][2])
    assert t.decisions == {1: "interval 10s"}  # decision not in the last column
    assert "update" not in t.columns  # missing columns are simply absent


def test_a_torn_last_line_is_dropped_and_a_damaged_line_skipped():
    text = HEAD + "1,10.0,2.0,,,,,\n2,11.0,1.9,,,,,lost-work budget\n3,12.0,1.8,,,,,\n4,13.0,1."
    t = parse_table(text)
    assert t.columns["step"].tolist() == [1, 2, 3] and t.decisions == {1: "lost-work budget"}
    damaged = HEAD + "1,10.0,2.0,,,,,\n2,11.0,zz,,,,,\n3,12\n4,13.0,1.7,,,,,final\n"
    t = parse_table(damaged)
    assert t.columns["step"].tolist() == [1, 2, 4] and t.skipped == 1
    assert math.isnan(t.columns["loss"][1]) and t.decisions == {2: "final"}


def test_a_file_without_step_and_time_is_not_a_trace():
    with pytest.raises(ConfigError) as err:
        parse_table("hello,time\n1,2\n", "x.csv")
    assert str(err.value) == "x.csv is not a smartckpt trace: no column step"


# ---------------------------------------------------------------- decimation


def test_minmax_keeps_each_columns_extremes_and_every_spike():
    rng = np.random.default_rng(3)
    x = np.sort(rng.random(100_000)) * 50
    y = rng.standard_normal(100_000)
    y[12_345] = 40.0  # a one-row spike
    y[777] = np.nan
    keep = minmax(x, y, 0.0, 50.0, 200)
    assert len(keep) <= 400 and 12_345 in keep and 777 not in keep
    col = np.clip((x / 50 * 200).astype(int), 0, 199)
    for c in range(200):
        rows = np.flatnonzero((col == c) & np.isfinite(y))
        kept = set(keep[np.isin(keep, rows)])
        assert rows[np.argmin(y[rows])] in kept and rows[np.argmax(y[rows])] in kept
    # x out of order (a step axis across a replay): the same points
    shuffled = rng.permutation(len(x))
    back = minmax(x[shuffled], y[shuffled], 0.0, 50.0, 200)
    assert sorted(shuffled[back].tolist()) == sorted(keep.tolist())
    assert minmax(x[:300], y[:300], 0, 50, 200).tolist() == [i for i in range(300) if i != 777]


# ---------------------------------------------------------------- placement


def _track(steps, t0, dt=1.0, decisions=None):
    s = np.asarray(steps, dtype=float)
    return Track.of(s, t0 + dt * (s - s[0]), decisions or {})


def test_checkpoints_go_to_the_process_that_took_them_across_a_restart():
    first = _track(range(1, 16), 100.0)  # killed after step 15 (its last flushed row)
    second = _track(range(11, 41), 200.0, decisions={25: "interval 10s"})  # resumed from 10
    items = [
        (5, "interval 5s"),
        (10, "interval 5s"),
        (15, "interval 5s"),
        (20, "x"),
        (25, "interval 10s"),
        (40, "final"),
    ]
    placed = place(items, [first, second])
    assert [p.track for p in placed] == [0, 0, 0, 1, 1, 1]
    assert [p.time for p in placed] == [104.0, 109.0, 114.0, 209.0, 214.0, 229.0]
    # a step below the previous one in the same file belongs to a later file
    placed = place([(12, ""), (11, "")], [first, second])
    assert [p.track for p in placed] == [0, 1]
    # the checkpoint a restart resumed from is the earlier process's, even where that process's
    # last flushed row came before it (sparse evaluations) and the new one's first row is just after
    sparse = _track(range(2, 9, 2), 100.0)  # rows 2..8, killed after the budget save of 10
    resumed = _track(range(11, 31), 200.0)
    (budget, later) = place([(10, "lost-work budget"), (20, "interval 5s")], [sparse, resumed])
    assert (budget.track, later.track) == (0, 1) and budget.time == pytest.approx(108.0), budget
    # a precursor save holds the step before its row; a final save may follow the last row
    t = _track(range(10, 101, 10), 0.0, dt=0.5, decisions={50: "precursor: planned update"})
    (pre, fin) = place([(49, "precursor: planned update"), (104, "final")], [t])
    assert pre.track == 0 and pre.time == pytest.approx(19.5) and fin.time == pytest.approx(47.0)


def test_the_manifest_time_settles_an_ambiguous_file_and_places_what_no_trace_covers():
    a, b = _track(range(1, 31), 100.0), _track(range(20, 61), 500.0)
    (p,) = place([(25, "")], [a, b], [505.0])
    assert p.track == 1 and p.time == 505.0
    p1, p2, p3 = place([(5, ""), (999, ""), (1000, "")], [a], [None, 700.0, None])
    assert (p2.source, p2.time) == ("manifest", 700.0)
    assert (p3.source, p3.time) == ("order", 700.0)  # between its journal neighbours
    assert p1.source == "trace"


# ---------------------------------------------------------------- the timeline


def _csv(steps, t0, *, dt=1.0, memory=False, decisions=None, bad=()):
    head = HEAD.replace("score,", "score,memory,") if memory else HEAD
    lines = [head.rstrip("\n")]
    for s in steps:
        loss = "nan" if s in bad else f"{2.0 - 0.01 * s:.4f}"
        mem = f",{0.4 + 0.001 * s:.3f}" if memory else ""
        lines.append(f"{s},{t0 + dt * s:.3f},{loss},0.001,1e-4,1e-3,0.1{mem},{(decisions or {}).get(s, '')}")
    return "\n".join(lines) + "\n"


def _commit(step, cid, reason, **kw):
    return commit(step, make_cid(cid), reason=reason, health=kw.get("health", "ok"), calm=kw.get("calm", True),
                  score=0.1)  # fmt: skip


def _facts(*, memory=False):
    """A run killed at step 37 (restarted from 30), resumed to 60; checkpoints every 10 steps
    plus a precursor at 44; the first two pruned; an unhealthy one at 50; a failed save."""
    first = parse_table(_csv(range(1, 31), 1000.0, memory=memory, decisions={10: "interval 10s"}), "a.csv")
    second = parse_table(_csv(range(31, 61), 1050.0, memory=memory, decisions={45: "precursor: planned update"}, bad={50}), "b.csv")  # fmt: skip
    events = [
        {"event": "init", "format": "smartckpt-journal", "v": 1, "store_id": "5" * 32},
        _commit(10, "c10", "interval 10s"),
        _commit(20, "c20", "lost-work budget"),
        _commit(30, "c30", "interval 10s", calm=False),
        {"event": "prune", "ids": [make_cid("c10"), make_cid("c20")]},
        _commit(40, "c40", "manual"),
        _commit(44, "c44", "precursor: planned update"),
        {"event": "save_failed", "step": 48, "error": "disk full"},
        _commit(50, "c50", "risk alarm", health="nonfinite-loss", calm=False),
        _commit(60, "c60", "final"),
    ]
    run = {
        "run_id": "r1", "started": 990.0, "ended": 1120.0, "outcome": "finished",
        "attempts": [
            {"attempt": 0, "started": 995.0, "ended": 1040.0, "category": "signal", "cause": "killed by SIGKILL",
             "max_step": 37, "restart_from": 30, "steps_lost": 7, "seconds_lost": 10.0},
            {"attempt": 1, "started": 1045.0, "ended": 1115.0, "category": "done", "cause": "finished"},
        ],
    }  # fmt: skip
    remote = {"remote": "s3://b/p", "pending": 1, "pending_steps": [60], "remote_steps": [40, 44]}
    return StoreFacts("store", [second, first], events, [run], remote=remote)


def test_the_timeline_has_every_checkpoint_restart_and_span_from_the_journal_and_run_record():
    tl = build_timeline(_facts(), PlotOptions(axis="step", bins=0))
    got = [(c.step, c.category, c.state, c.healthy, c.calm) for c in tl.checkpoints]
    assert got == [
        (10, "scheduled", "pruned", True, True),
        (20, "budget", "pruned", True, True),
        (30, "scheduled", "live", True, False),
        (40, "manual", "live", True, True),
        (44, "precursor", "live", True, True),
        (50, "signal", "live", False, False),
        (60, "final", "live", True, True),
    ]
    assert [c.remote for c in tl.checkpoints][-4:] == ["uploaded", "uploaded", None, "pending"]
    assert tl.t0 == 1000.0 + 1 and [c.time for c in tl.checkpoints][:2] == [9.0, 19.0]
    assert all(c.time_source == "trace" for c in tl.checkpoints)
    (r,) = tl.restarts
    assert (r.label, r.step, r.restart_from, r.lost_steps, r.restarted) == ("SIGKILL", 37, 30, (30, 37), True)
    assert r.lost_time == (1030.0 - tl.t0, 1040.0 - tl.t0)
    assert [(f.step, f.error) for f in tl.failed_saves] == [(48, "disk full")]
    assert [m.step for m in tl.nonfinite] == [50]
    assert [(s.first_step, s.last_step) for s in tl.segments] == [(1, 30), (31, 60)]
    assert "memory" not in tl.series and {"loss", "loss_median", "grad_var", "unsaved"} <= set(tl.series)
    # work not in a checkpoint: back to 0 at each healthy checkpoint, never across one
    un = tl.series["unsaved"]
    assert un.value[np.where(un.step == 20)[0][0]] == 0.0 and un.value[np.where(un.step == 29)[0][0]] == 9.0
    assert un.value[np.where(un.step == 55)[0][0]] == 11.0  # the unhealthy one at 50 does not count
    # the JSON form: the same, null between files, loadable by anything
    out = json.loads(json.dumps(tl.to_json()))
    assert out["format"] == "smartckpt-timeline" and out["version"] == 1
    assert [c["step"] for c in out["checkpoints"]] == [10, 20, 30, 40, 44, 50, 60]
    assert out["restarts"][0]["lost_steps"] == [30, 37]
    assert out["series"]["loss"]["step"].count(None) == 1  # the break between the two processes


def test_a_memory_column_gets_its_series_and_decimation_never_drops_a_marker():
    tl = build_timeline(_facts(memory=True), PlotOptions(bins=3))
    assert "memory" in tl.series and tl.series["memory"].rows == 60
    assert len(tl.series["loss"].value) <= 2 * 3 * 2 + 1  # 2 per column per file, and the break
    assert len(tl.checkpoints) == 7 and len(tl.restarts) == 1


def test_steps_and_run_filters():
    tl = build_timeline(_facts(), PlotOptions(axis="step", steps=(35, 52), bins=0))
    assert [c.step for c in tl.checkpoints] == [40, 44, 50]
    assert len(tl.restarts) == 1  # its lost span 30..37 reaches into the range
    assert tl.trace_rows == 18 and tl.t0 == 1030.0  # the earliest thing shown: the lost span's start
    assert parse_steps("10:") == (10, None) and parse_steps(":5") == (None, 5)
    tl = build_timeline(_facts(), PlotOptions(run_id="r1"))
    assert tl.run is not None and tl.run["run_id"] == "r1" and tl.run["restarts"] == 1


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        (PlotOptions(steps=(500, 600)), "steps 500:600 are outside the trace (steps 1..60)"),
        (PlotOptions(run_id="nope"), "no run 'nope' in store; its runs: r1"),
    ],
)
def test_bad_filters_are_one_line_usage_errors(opts, message):
    with pytest.raises(UsageError) as err:
        build_timeline(_facts(), opts)
    assert str(err.value) == message


@pytest.mark.parametrize("text", ["5", "a:b", "9:3", ""])
def test_bad_step_ranges(text):
    with pytest.raises(UsageError, match="--steps"):
        parse_steps(text)


def test_reason_categories_and_failure_labels():
    got = [
        reason_category(r)
        for r in ("interval 92s", "every 50 steps", "lost-work budget", "precursor: gradient variance",
                  "risk alarm", "seed score", "preemption (SIGTERM)", "final", "manual", "my reason")
    ]  # fmt: skip
    assert got == ["scheduled", "scheduled", "budget", "precursor", "signal", "signal", "preemption", "final", "manual", "manual"]  # fmt: skip
    assert restart_label("signal", "killed by SIGKILL") == "SIGKILL"
    assert [restart_label(c, "") for c in ("oom", "hang", "preempted", "gpu", "failed")] == [
        "OOM", "hang", "preemption", "GPU", "error"
    ]  # fmt: skip


def test_the_settings_a_run_recorded_are_those_of_the_run_asked_for_else_the_newest():
    from smartckpt_cli.timeline import recorded_settings

    old = {"run_id": "a", "started": 1.0, "settings": {"max_interval": 60.0}}
    new = {"run_id": "b", "started": 2.0, "settings": {"max_interval": 8.0}}
    bare = {"run_id": "c", "started": 3.0}  # a record from before records kept settings
    assert recorded_settings([old, new, bare], None) == {"max_interval": 8.0}
    assert recorded_settings([old, new, bare], "a") == {"max_interval": 60.0}
    assert recorded_settings([old, new, bare], "c") is None
    assert recorded_settings([], None) is None


def test_the_policy_named_is_the_one_the_checkpoints_were_taken_by():
    from smartckpt_cli.timeline.kinds import policies_shown

    assert policies_shown(["final", "every 10 steps", "lost-work budget", "every 10 steps"]) == [
        ("fixed", "every 10 steps")
    ]
    assert policies_shown(["every 2.5s", "risk alarm", "interval 92s", "seed score"]) == [
        ("fixed", "every 2.5s"), ("adaptive", ""), ("seed", "")
    ]  # fmt: skip
    # what says nothing of the policy: budget, preemption, the end, manual, another rank's echo
    assert (
        policies_shown(["lost-work budget", "preemption (SIGTERM)", "final", "manual", "rank 0 trigger"])
        == []
    )
    # the journal's reasons win over the settings (the default "adaptive" here)
    tl = build_timeline(_facts(), PlotOptions(axis="step", bins=0))
    assert (tl.policy, tl.policy_text) == ("adaptive", "adaptive")
    facts = _facts()
    every = [
        {**e, "reason": "every 10 steps"}
        if e.get("reason", "").startswith(("interval", "risk", "precursor"))
        else e
        for e in facts.events
    ]
    tl = build_timeline(StoreFacts("store", facts.tables, every, facts.runs), PlotOptions(policy="adaptive"))
    assert (tl.policy, tl.policy_text, tl.thresholds) == ("fixed", "fixed: every 10 steps", {})
    assert tl.to_json()["policy_text"] == "fixed: every 10 steps"
    # nothing shows a policy: the settings', said to be theirs
    only = [e for e in facts.events if e.get("reason") in (None, "final", "manual", "lost-work budget")]
    tl = build_timeline(StoreFacts("store", facts.tables, only, facts.runs), PlotOptions(policy="seed"))
    assert tl.policy == "seed" and tl.policy_text == "seed (the settings; no checkpoint shows a policy)"
    assert tl.thresholds == {"threshold": 0.65}


def test_the_figure_leaves_out_a_panel_with_nothing_to_draw_and_says_so_and_labels_every_axis():
    pytest.importorskip("matplotlib")
    from smartckpt_cli.figures.timeline import draw_timeline

    tl = build_timeline(_facts(), PlotOptions(axis="step", bins=0))
    full = draw_timeline(tl)
    n = len(full.axes)
    tl.series["curvature"].value[:] = np.nan  # a signal nobody traced
    tl.series["grad_var"].value[1:] = np.nan  # one value: no line
    upd = tl.series["update"].value
    upd[np.isfinite(upd)] = np.linspace(2e-3, 8e-3, int(np.isfinite(upd).sum()))  # inside one decade
    fig = draw_timeline(tl)
    assert len(fig.axes) == n - 2
    title = fig._suptitle.get_text()
    assert "not drawn: curvature (0 value(s) traced), gradient variance (1 value(s) traced)" in title
    assert "policy adaptive" in title
    fig.canvas.draw()
    for ax in fig.axes:
        assert ax.get_ylabel(), ax
        # a log panel inside one decade still has numbers on its axis
        lo, hi = sorted(ax.get_ylim())
        shown = ax.get_yticklabels(which="both")
        labels = [t.get_text() for t in shown if lo <= t.get_position()[1] <= hi and t.get_text()]
        assert labels, ax.get_ylabel()
    assert fig.axes[-1].get_xlabel() == "step"
