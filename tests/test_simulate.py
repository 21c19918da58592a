"""The trace simulator: exact lost-work integrals, onset detection, retention at the rollback,
calibration to the same number of checkpoints, and the ``smartckpt simulate`` command."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import smartckpt_cli as sc
from smartckpt_cli.cli import app as cli_app
from smartckpt_cli.errors import ConfigError
from smartckpt_cli.simulate import (
    Onset,
    Save,
    SimConfig,
    Trace,
    TraceRow,
    detect_onsets,
    mean_lost_work,
    read_trace,
    replay,
    retained_before,
    simulate,
)
from smartckpt_cli.trigger.bounded import Bounded
from smartckpt_cli.trigger.simple import FixedPolicy
from smartckpt_cli.trigger.trace import COLUMNS

REPO = Path(__file__).resolve().parents[1]


def _rows(n=600, *, spike_at=None, spike_len=20, precursor=4, seed=0, dt=1.0):
    """A fine-tune-like trace: slowly falling noisy loss, noisy gradient variance; optionally a
    loss spike at row ``spike_at`` whose gradient variance rises ``precursor`` rows earlier."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        loss = 2.0 - 0.0005 * i + rng.gauss(0, 0.01)
        var = 1e-4 * (1 + 0.2 * rng.random())
        if spike_at is not None and spike_at <= i < spike_at + spike_len:
            loss += 1.0
        if spike_at is not None and spike_at - precursor <= i < spike_at + spike_len:
            var *= 8
        rows.append(TraceRow(i + 1, 1000.0 + dt * i, loss, rng.gauss(0, 0.005), var))
    return rows


def _write(path: Path, rows, extra: dict[int, str] | None = None) -> Path:
    lines = [",".join(COLUMNS)]
    for r in rows:
        lines.append(f"{r.step},{r.time:.3f},{r.loss!r},{r.curvature!r},{r.grad_var!r},,")
    path.write_text("\n".join(lines) + "\n")
    return path


def _fixed(every, *, lo=0.0, hi=1e9):
    return Bounded(FixedPolicy(every_seconds=every), lo, hi, bound_inner=False)


# ---------------------------------------------------------------- lost work


def test_fixed_interval_on_a_uniform_trace_loses_half_the_interval_plus_commit_latency():
    rows = [TraceRow(i, float(i), 1.0, 0.0, 1e-4) for i in range(1001)]  # t = 0..1000
    cfg = SimConfig(save_cost=0.5, save_total=3.0)
    saves, stall = replay(rows, _fixed(50), cfg)
    assert [s.step for s in saves] == list(range(50, 1001, 50)) and stall == 0.0
    assert [s.commit for s in saves] == [t + 3.0 for t in range(50, 1001, 50)]
    # Exactly: [0,53) from the start, 18 periods of ((53)²-(3)²)/2, the tail [953,1000).
    exact = (53**2 / 2 + 18 * (53**2 - 3**2) / 2 + (50**2 - 3**2) / 2) / 1000
    lost = mean_lost_work(saves, 0.0, 1000.0)
    assert lost == pytest.approx(exact, rel=1e-12)
    assert lost == pytest.approx(50 / 2 + 3, rel=0.01)  # interval/2 + commit latency
    assert mean_lost_work([], 0.0, 1000.0) == pytest.approx(500.0)  # no checkpoint: T/2
    unhealthy = [Save(s.step, s.time, s.commit, s.calm, False, "") for s in saves]
    assert mean_lost_work(unhealthy, 0.0, 1000.0) == pytest.approx(500.0)  # restores nothing


def test_one_save_in_flight_at_a_time_and_the_wait_counts_as_overhead():
    rows = [TraceRow(i, float(i), 1.0, 0.0, 1e-4) for i in range(1, 21)]
    saves, stall = replay(rows, _fixed(1e-3), SimConfig(save_total=5.0))
    assert [s.step for s in saves] == list(range(2, 21))  # the first row is the start
    assert [s.commit for s in saves] == [7.0 + 5 * k for k in range(19)]  # back to back
    assert stall == pytest.approx(sum(5.0 * k - k for k in range(19)))  # waited for the previous


def test_a_save_at_a_nonfinite_loss_is_taken_but_restores_nothing():
    rows = [TraceRow(i, float(i), 1.0 if i != 10 else math.nan, 0.0, 1e-4) for i in range(1, 31)]
    saves, _ = replay(rows, _fixed(1e-3, lo=0), SimConfig(save_total=0.0))
    bad = next(s for s in saves if s.step == 10)
    assert not bad.healthy and not bad.calm


# ---------------------------------------------------------------- divergence events


def test_spike_onset_detection_finds_an_injected_onset_and_nothing_else():
    quiet = _rows(600)
    assert detect_onsets(quiet) == []  # a noisy, falling loss is not a divergence
    spiky = _rows(600, spike_at=400)
    (o,) = detect_onsets(spiky)
    # Spiking rows are steps 401-420; the 3-row median needs two high rows of three.
    assert o.step == 402 and o.end_step == 422
    div = [TraceRow(r.step, r.time, r.loss if r.step < 300 else math.nan, 0.0, 1e-4) for r in quiet]
    (d,) = detect_onsets(div)
    assert d.step == 301 and d.end_index == len(div) - 1  # a diverged run never recovers


def test_given_onsets_win_over_detection():
    rows = _rows(600, spike_at=400)
    (o,) = detect_onsets(rows, given=[390])
    assert o.step == 390 and o.end_step == 390  # the loss does not show it: ends at once
    marked = [TraceRow(*r.__dict__.values()) if r.step != 200 else _mark(r) for r in rows]
    assert [o.step for o in detect_onsets(marked)] == [200]


def _mark(r):
    return TraceRow(r.step, r.time, r.loss, r.curvature, r.grad_var, onset=True)


def test_retention_at_the_rollback_keeps_the_newest_calm_checkpoint_before_the_onset():
    onset = Onset(index=100, step=100, time=100.0, end_index=160, end_step=160, end_time=160.0)
    before = [Save(s, float(s), s + 1.0, True, True, "") for s in (20, 40, 60, 80)]
    # Three more saves during the spike, before the rollback is decided: keep_last=3 holds them.
    risky = [Save(s, float(s), s + 1.0, False, True, "risk alarm") for s in (105, 120, 140)]
    assert retained_before(before + risky, onset, keep_last=3).step == 80  # calm: never evicted
    calm_after = [Save(s.step, s.time, s.commit, True, True, "") for s in risky]
    assert retained_before(before + calm_after, onset, keep_last=3) is None  # all evicted
    assert retained_before(before + calm_after, onset, keep_last=4).step == 80
    late = [Save(s, float(s), s + 1.0, True, True, "") for s in (105, 170, 180)]  # after the end
    assert retained_before(before + late, onset, keep_last=3).step == 80
    assert retained_before([Save(100, 100.0, 101.0, True, True, "")], onset, 3) is None  # not before


# ---------------------------------------------------------------- the simulation


def test_simulate_calibrates_every_policy_to_the_same_count():
    trace = Trace(tuple(_rows(400, spike_at=300)), "synthetic")
    cfg = SimConfig(mtbf=3600, save_cost=0.5, save_total=2.0, min_interval=2, max_interval=120)
    res = simulate(trace, cfg)
    counts = {p.name: p.checkpoints for p in res.policies}
    assert set(counts.values()) == {res.target} and all(p.exact_count for p in res.policies)
    fixed, adaptive = res.policy("fixed"), res.policy("adaptive")
    assert fixed.overhead == pytest.approx(res.target * 0.5 / trace.duration)
    assert fixed.expected_lost == pytest.approx(fixed.mean_lost * trace.duration / 3600)
    # The best fixed schedule with N saves is about evenly spaced: T/(N+1)/2 + commit latency.
    assert fixed.mean_lost == pytest.approx(trace.duration / (res.target + 1) / 2 + 2.0, rel=0.1)
    # The variance precursor (rows 297-300, the spike from 301): the adaptive policy alarms on it
    # before the update, so the save holds the step before the alarming row.
    assert any(s.reason == "precursor: gradient variance" and 296 <= s.step <= 299 for s in adaptive.saves)
    (o,) = adaptive.onsets
    assert o.checkpoint_step is not None and 296 <= o.checkpoint_step < 302 and o.distance <= 6.0
    res10 = simulate(trace, replace(cfg, checkpoints=10, rollback="onset"))
    assert {p.checkpoints for p in res10.policies} == {10}
    for p in res10.policies:  # decided at the onset: rolling back loses exactly the distance
        assert [o.rollback_lost for o in p.onsets] == [o.distance for o in p.onsets]


def test_read_trace_from_a_real_run_and_from_a_store(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters())
    with sc.CheckpointManager(tmp_path, every_steps=10**9, max_interval=1e9, eval_every=1) as mgr:
        mgr.register(model=model, optimizer=opt)
        for step in range(1, 41):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mgr.step(step, loss=loss)
    trace = read_trace(tmp_path)
    assert [r.step for r in trace.rows] == list(range(1, 41)) and "newest of 1 run" in trace.source
    assert all(r.grad_var and r.grad_var > 0 for r in trace.rows)
    older = _write(tmp_path / "traces" / "00000000T000000Z-1.csv", _rows(5))  # earlier times
    assert read_trace(tmp_path).rows == trace.rows  # the newest run by time, whatever the name
    both = read_trace(tmp_path, all_runs=True)
    assert len(both.rows) == 45 and [r.step for r in both.rows] == list(range(1, 46))
    assert both.rows[5].time - both.rows[4].time < 60  # the gap between runs is not training
    assert read_trace(older).rows[0].step == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("step,time,loss\n1,2,3\n", "no column curvature, grad_var"),
        (",".join(COLUMNS) + "\n1,10.0,abc,,,,\n", "line 2, loss: not a number: 'abc'"),
        (",".join(COLUMNS) + "\n2,10.0,1,,,,\n1,11.0,1,,,,\n", "line 3: steps must increase"),
        (",".join(COLUMNS) + "\n1,10.0,1,,,,\n", "has 1 rows"),
    ],
)
def test_bad_trace_files_are_one_line_config_errors(tmp_path, text, message):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        read_trace(path)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- the command


def test_cli_simulate_json_and_table(tmp_path):
    path = _write(tmp_path / "t.csv", _rows(200, spike_at=150))
    args = ["simulate", str(path), "--mtbf", "3600", "--min-interval", "2", "--max-interval", "60"]
    res = CliRunner().invoke(cli_app.app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [o["step"] for o in out["onsets"]] == [152]
    assert len({p["checkpoints"] for p in out["policies"].values()}) == 1
    res = CliRunner().invoke(cli_app.app, [*args, "--checkpoints", "7"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "onsets at steps 152" in res.output and "every policy calibrated to 7" in res.output
    for name in ("fixed", "seed", "adaptive"):
        assert name in res.output
    bad = CliRunner().invoke(cli_app.app, ["simulate", str(path), "--onsets", "1,x"])
    assert isinstance(bad.exception, ConfigError)


def _cli(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "simulate", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )


def test_cli_process(tmp_path, child_env):
    good = _write(tmp_path / "t.csv", _rows(200))
    proc = _cli(str(good), "--json", "--max-interval", "30", "--min-interval", "1", env=child_env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["rows"] == 200
    bad = tmp_path / "bad.csv"
    bad.write_text("hello,world\n1,2\n")
    proc = _cli(str(bad), env=child_env)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert (
        proc.stderr
        == f"smartckpt: error: {bad} is not a smartckpt trace: no column step, time, loss, curvature, grad_var (expected step,time,loss,curvature,grad_var,update,memory,score,decision)\n"
    )


@pytest.mark.parametrize("name", ["missing.csv", "empty_dir", "bad.csv"])
def test_cli_main_bad_input_is_one_line_and_exit_2(tmp_path, name, monkeypatch, capsys):
    target = tmp_path / name
    if name == "empty_dir":
        target.mkdir()
    elif name == "bad.csv":
        target.write_text(",".join(COLUMNS) + "\n1,10,1,,,,\n2,9,1,,,,\n")
    monkeypatch.setattr(sys, "argv", ["smartckpt", "simulate", str(target)])
    with pytest.raises(SystemExit) as exit_:
        cli_app.main()
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("smartckpt: error: ") and str(target) in lines[0], err


def test_a_torn_last_line_is_dropped_but_a_bad_complete_line_is_an_error(tmp_path):
    head = ",".join(COLUMNS) + "\n1,10.0,1.0,,,,\n2,11.0,0.9,,,,\n"
    path = tmp_path / "t.csv"
    path.write_text(head + "3,12.0,0.")  # the writer was killed mid-line
    assert [r.step for r in read_trace(path).rows] == [1, 2]
    path.write_text(head + "3,12.0,0.x,,,,\n")
    with pytest.raises(ConfigError, match="line 4, loss: not a number"):
        read_trace(path)
