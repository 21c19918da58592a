"""``smartckpt plot`` and ``smartckpt simulate --plot`` as a user runs them: real stores, real
processes, real files. The end-to-end test trains under ``smartckpt run`` with a SIGKILL and a
learning-rate jolt, plots it, and checks the figure's data against the journal and the run
record; the others check bad input, a missing matplotlib, and simulate's table widths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from smartckpt_cli.cli import app as cli_app

ROOT = Path(__file__).resolve().parents[1]
ZERO_CODE = ROOT / "tests" / "scripts" / "zero_code_train.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _smartckpt(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def _one_line_error(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("smartckpt: error: "), res.stderr
    assert res.stdout == ""
    return lines[0]


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def _assert_svg(path: Path) -> None:
    assert path.stat().st_size > 1000
    assert ET.parse(path).getroot().tag == "{http://www.w3.org/2000/svg}svg"


# ---------------------------------------------------------------- bad input


def _trace_rows(store: Path) -> list[int]:
    """The steps of the store's one signal trace (the trigger's evaluations: how many there are
    depends on the measured step time, so the tests read them instead of assuming them)."""
    import csv

    (trace,) = (store / "traces").glob("*.csv")
    with trace.open(newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def test_bad_input_is_one_line_and_exit_2(demo_store, child_env, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    rows = _trace_rows(demo_store)
    first, last = rows[0], rows[-1]
    cases = [
        (["plot", str(empty), "-o", "x.png"], f"{empty} is not a smartckpt checkpoint store (no journal.jsonl)"),
        (["plot", str(tmp_path / "missing"), "--json"], "does not exist"),
        (["plot", str(demo_store), "--run", "20990101-000000-abcdef", "-o", "x.png"],
         "no run '20990101-000000-abcdef' in"),
        (["plot", str(demo_store), "--steps", "5000:6000", "-o", "x.png"],
         f"steps 5000:6000 are outside the trace (steps {first}..{last})"),
        (["plot", str(demo_store), "--steps", "ten", "--json"], "--steps must be A:B"),
        (["plot", str(demo_store), "-o", "x.jpg"], "must end in .png, .svg or .html"),
    ]  # fmt: skip
    for args, message in cases:
        line = _one_line_error(_smartckpt(args, child_env, tmp_path))
        assert message in line, (args, line)
    assert not list(tmp_path.glob("x.*")) and not list(tmp_path.glob(".x.*"))  # nothing half-written


def test_without_matplotlib_drawing_names_the_extra_and_json_still_works(demo_store, tmp_path):
    poison = tmp_path / "poison"
    (poison / "matplotlib").mkdir(parents=True)
    (poison / "matplotlib" / "__init__.py").write_text('raise ImportError("no matplotlib here")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(poison), str(ROOT)])
    line = _one_line_error(_smartckpt(["plot", str(demo_store), "-o", "run.png"], env, tmp_path))
    assert "pip install 'smartckpt[plot]'" in line
    trace = next((demo_store / "traces").glob("*.csv"))
    line = _one_line_error(_smartckpt(["simulate", str(trace), "--plot", "sim.png"], env, tmp_path))
    assert "pip install 'smartckpt[plot]'" in line
    res = _smartckpt(["plot", str(demo_store), "--json"], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert [c["step"] for c in json.loads(res.stdout)["checkpoints"]] == [5, 10, 15, 20, 25, 30]


def test_plot_of_a_store_without_run_records(demo_store, child_env, tmp_path):
    res = _smartckpt(["plot", str(demo_store), "-o", "run.html", "--x", "step"], child_env, tmp_path)
    assert res.returncode == 0, res.stderr
    rows = len(_trace_rows(demo_store))
    assert rows >= 2
    assert res.stdout.startswith(
        f"wrote run.html: {rows} trace row(s) from 1 file(s), 6 checkpoint(s), 0 restart(s)"
    )
    page = (tmp_path / "run.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "<h2>Checkpoints</h2>" in page
    # The demo saves every 5 steps: the figure names that policy, not the settings' default.
    res = _smartckpt(["plot", str(demo_store), "--json"], child_env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["policy_text"] == "fixed: every 5 steps"


# ---------------------------------------------------------------- simulate


def _trace(path: Path, n: int = 300) -> Path:
    lines = ["step,time,loss,curvature,grad_var,update,score,decision"]
    for i in range(n):
        loss = 2.0 - 0.001 * i + (0.02 if i % 7 == 0 else 0.0) + (1.0 if 200 <= i < 215 else 0.0)
        lines.append(f"{i + 1},{1000.0 + i},{loss},0.001,{1e-4 * (1 + (i % 5) / 10)},1e-3,,")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("columns", [80, 160])
def test_simulate_table_is_readable_at_80_columns_and_full_when_wider(tmp_path, columns):
    trace = _trace(tmp_path / "t.csv")
    args = ["simulate", str(trace), "--max-interval", "40", "--min-interval", "2"]
    res = CliRunner().invoke(cli_app.app, args, env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    assert "…" not in res.output  # no header (or cell) cut short
    lines = res.output.splitlines()
    assert max(len(ln) for ln in lines) <= columns
    for word in ("policy", "overhead", "failure s", "expected", "rollback", "fixed", "seed", "adaptive"):
        assert word in res.output, word
    knobs = [ln for ln in lines if ln.strip().startswith(("fixed ", "seed ", "adaptive "))]
    header = next(ln for ln in lines if ln.lstrip().startswith("policy"))
    if columns == 80:
        # each policy's setting on a line of its own above the table, numbers below
        assert "setting" not in header and header.split()[:2] == ["policy", "saves"]
        assert [ln.split()[1] for ln in knobs[:3]] == ["every", "threshold", "interval"]
        assert "mean/max s" in res.output
    else:
        assert header.split()[:3] == ["policy", "setting", "checkpoints"] and "onset dist" in res.output
        assert any(
            "every" in ln and ln.rstrip()[-1].isdigit() for ln in knobs
        )  # setting and numbers in one row


def test_simulate_plot_writes_the_figure(tmp_path, child_env):
    trace = _trace(tmp_path / "t.csv")
    res = _smartckpt(
        ["simulate", str(trace), "--max-interval", "40", "--min-interval", "2", "--json", "--plot", "sim.svg"],
        child_env, tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["target_checkpoints"] > 0
    _assert_svg(tmp_path / "sim.svg")
    res = _smartckpt(["simulate", str(trace), "--plot", "sim.png"], child_env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "wrote sim.png" in res.stdout
    _assert_png(tmp_path / "sim.png")


# ---------------------------------------------------------------- a real run, killed and jolted


def _journal(store: Path) -> list[dict]:
    return [json.loads(ln) for ln in (store / "journal.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_killed_and_jolted_run_plots_what_its_journal_and_run_record_say(tmp_path, child_env):
    env = dict(child_env)
    env.update(
        SMARTCKPT_EVAL_EVERY="1",  # every step traced, so the jolt's step is evaluated
        SMARTCKPT_MIN_INTERVAL="0",
        SMARTCKPT_MAX_INTERVAL="1",  # budget saves along the way
        SMARTCKPT_KEEP_LAST="2",  # and some pruned
        SMARTCKPT_RESTART_BACKOFF="0.1",
    )
    run = _smartckpt(
        ["run", "--dir", "ck", "--", sys.executable, str(ZERO_CODE), "--total", "80", "--kill-at", "50",
         "--jolt-at", "25", "--step-time", "0.05"],
        env, tmp_path, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    store = tmp_path / "ck"
    (record_path,) = (store / "runs").glob("*.json")
    record = json.loads(record_path.read_text())
    killed = record["attempts"][0]
    assert killed["cause"] == "killed by SIGKILL" and killed["max_step"] == 50
    # the settings the run ran with, as its environment set them
    ran = record["settings"]
    assert (ran["eval_every"], ran["max_interval"], ran["keep_last"], ran["dir"]) == (1, 1.0, 2, "ck"), ran

    # the budget line is the run's own max_interval (its record), whatever the shell now says
    res = _smartckpt(
        ["plot", "ck", "--json", "--x", "step", "--points", "0"],
        {**env, "SMARTCKPT_MAX_INTERVAL": "99"},
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["max_interval"] == 1.0

    # every commit of the journal, in order, with its reason, health, calm flag and fate
    journal = _journal(store)
    pruned = {cid for ev in journal if ev["event"] == "prune" for cid in ev["ids"]}
    commits = [ev for ev in journal if ev["event"] == "commit"]
    assert [
        (c["step"], c["id"], c["reason"], c["health"], c["calm"], c["state"]) for c in data["checkpoints"]
    ] == [
        (c["step"], c["id"], c["reason"], c["health"], c["calm"], "pruned" if c["id"] in pruned else "live")
        for c in commits
    ]
    assert pruned and all(c["time_source"] == "trace" for c in data["checkpoints"])
    times = [c["time"] for c in data["checkpoints"]]
    assert times == sorted(times)  # journal order is time order
    # the jolt: the planned update peaks at its step, and a save was taken for it
    update = data["series"]["update"]
    peak = max(range(len(update["value"])), key=lambda i: update["value"][i] or 0.0)
    assert update["step"][peak] == 26
    assert any(
        c["category"] in ("precursor", "signal") and c["step"] in (25, 26) for c in data["checkpoints"]
    )
    # the kill: one restart, its cause, and the work it lost exactly as the run record says
    (restart,) = data["restarts"]
    assert (restart["label"], restart["category"], restart["restarted"]) == ("SIGKILL", "signal", True)
    assert restart["lost_steps"] == [killed["restart_from"], killed["max_step"]]
    assert restart["steps_lost"] == killed["steps_lost"] == 50 - killed["restart_from"]
    assert restart["lost_time"][1] + data["t0"] == pytest.approx(killed["ended"], abs=1e-5)
    assert restart["lost_time"][1] - restart["lost_time"][0] == pytest.approx(
        killed["seconds_lost"], abs=1e-5
    )
    assert len(data["segments"]) == 2  # two processes, a line break between them
    assert data["series"]["loss"]["step"].count(None) == 1
    # the trace's raw_loss column: the unfiltered loss drawn under the filtered one, as traced
    assert data["series"]["loss_raw"]["step"] == data["series"]["loss"]["step"]
    assert data["series"]["loss_raw"]["value"] != data["series"]["loss"]["value"]

    # the figure object shows the same markers and spans
    from smartckpt_cli.figures.timeline import draw_timeline
    from smartckpt_cli.timeline import PlotOptions, build_timeline, load_store

    fig = draw_timeline(build_timeline(load_store(store), PlotOptions(axis="step")))
    strip = [c for ax in fig.axes for c in ax.collections if (c.get_gid() or "").startswith("checkpoints:")]
    assert sorted(x for c in strip for x in c.get_offsets()[:, 0]) == sorted(c["step"] for c in commits)
    (span,) = [p for ax in fig.axes for p in ax.patches if p.get_gid() == f"lost:{record['run_id']}:0"]
    xs = (
        [span.get_x(), span.get_x() + span.get_width()]
        if hasattr(span, "get_x")
        else sorted({v[0] for v in span.get_xy()})
    )
    assert xs == [killed["restart_from"], killed["max_step"]]
    (line,) = [ln for ax in fig.axes for ln in ax.lines if ln.get_gid() == f"restart:{record['run_id']}:0"]
    assert list(line.get_xdata()) == [killed["max_step"]] * 2

    # and it is drawn: PNG and SVG, of this run alone and of a step range
    for args, out in (
        (["-o", "run.png"], "run.png"),
        (["-o", "run.svg", "--run", record["run_id"], "--steps", "20:60"], "run.svg"),
    ):
        res = _smartckpt(["plot", "ck", *args], env, tmp_path)
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith(f"wrote {out}:")
    _assert_png(tmp_path / "run.png")
    _assert_svg(tmp_path / "run.svg")
