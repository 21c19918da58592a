"""The trigger: the seed's score, the lost-work budget, the adaptive policy, signals, health."""

from __future__ import annotations

import math

import pytest
import torch

import smartckpt_cli as sc
from smartckpt_cli.config import Settings
from smartckpt_cli.store.journal import CheckpointRecord
from smartckpt_cli.store.retention import select_prunable
from smartckpt_cli.trigger.adaptive import AdaptivePolicy
from smartckpt_cli.trigger.bounded import Bounded
from smartckpt_cli.trigger.context import Decision, TriggerContext
from smartckpt_cli.trigger.policies import make_policy
from smartckpt_cli.trigger.scores import seed_score, young_daly
from smartckpt_cli.trigger.signals import SignalReading, Signals, curvature
from smartckpt_cli.trigger.simple import SeedPolicy


def _sig(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize(
    ("curv", "var", "expected"),
    [
        (0.0, 0.0, 0.7 * 0.5 + 0.3 * 0.5),  # 0.5
        (0.03, 0.0, 0.7 * _sig(1) + 0.15),
        (-0.03, 1e-5, 0.7 * _sig(1) + 0.3 * (1 - _sig(1))),
        (0.3, 1e-3, 0.7 * _sig(10) + 0.3 * (1 - _sig(100))),
    ],
)
def test_seed_score_at_known_points(curv, var, expected):
    assert seed_score(curv, var) == pytest.approx(expected, rel=1e-12)


def test_seed_score_threshold_and_its_inverted_variance():
    assert seed_score(0.0, 0.0) == pytest.approx(0.5)
    assert seed_score(0.03, 0.0) >= 0.65 > seed_score(0.01, 0.0)
    # As written, low gradient variance raises the seed's score:
    assert seed_score(0.02, 0.0) > seed_score(0.02, 1e-3)
    pol = SeedPolicy(0.65)
    fire = pol.should_save(_ctx(10, 0.0, reading=SignalReading(10, 1.0, 0.05, 0.0)))
    assert fire.save and fire.score == pytest.approx(seed_score(0.05, 0.0))


def _ctx(step, now, last_step=None, last_time=0.0, **kw):
    return TriggerContext(step, now, last_step, last_time, **kw)


class _Never:
    def should_save(self, ctx):
        return Decision(False, score=0.1)


class _Always:
    def should_save(self, ctx):
        return Decision(True, "always", 0.9, calm=False)


def test_budget_commits_at_most_max_interval_apart_with_a_fake_clock():
    budget = Bounded(_Never(), min_interval=10, max_interval=180)
    clock, last, saves = 0.0, 0.0, []
    for step in range(1, 2001):
        clock += 0.73  # seconds per step
        d = budget.should_save(_ctx(step, clock, saves[-1][0] if saves else None, last))
        if d.save:
            assert d.reason == "lost-work budget"
            saves.append((step, clock))
            last = clock
    gaps = [b[1] - a[1] for a, b in zip([(0, 0.0), *saves], saves, strict=False)]
    assert len(saves) == int(2000 * 0.73 // 180)
    assert max(gaps) <= 180 + 0.73


def test_budget_in_steps_and_min_interval_floor():
    budget = Bounded(_Always(), min_interval=10, max_interval=1e9, max_interval_steps=50)
    assert not budget.should_save(_ctx(5, 9.9)).save  # a policy's own save is floored
    assert budget.should_save(_ctx(6, 10.0)).save
    assert budget.should_save(_ctx(50, 1.0, last_step=0)).reason == "lost-work budget"


def test_young_daly_and_cost_feedback():
    assert young_daly(2.0, 3600) == pytest.approx(math.sqrt(2 * 2 * 3600))
    pol = AdaptivePolicy(mtbf=3600, background_share=0.0)
    cheap = pol.interval(_ctx(1, 0, save_cost=0.5))
    dear = pol.interval(_ctx(1, 0, save_cost=8.0))
    assert dear == pytest.approx(4 * cheap)  # a 16x costlier save is taken 4x less often


def test_adaptive_risk_rises_with_gradient_variance_and_alarms():
    pol = AdaptivePolicy(mtbf=3600)
    for i in range(10):
        d = pol.should_save(_ctx(10 * i, 1.0, last_time=0.0, reading=SignalReading(10 * i, 1.0, 0.001, 1e-4)))
        assert not d.save
    calm_risk = pol._risk
    d = pol.should_save(_ctx(110, 1.0, last_time=0.0, reading=SignalReading(110, 1.0, 0.001, 1e-2)))
    assert pol._risk > 0.9 > 0.5 >= calm_risk
    assert d.save and d.reason == "risk alarm" and not d.calm


def _feed(pol, n, var=1e-4, curv=0.001, t0=0.0, dt=1.0, step0=0, noise=0.0, seed=0):
    """n evaluations of calm, slightly noisy signals; returns the decisions."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        v = var * 2 ** rng.gauss(0, noise) if noise else var * (1 + 0.01 * (i % 3))
        c = curv * rng.gauss(0, 1) if noise else curv * (1 + 0.1 * (i % 2))
        s = step0 + i
        out.append(pol.should_save(_ctx(s, t0 + dt * i, reading=SignalReading(s, 1.0, c, v))))
    return out


def test_adaptive_variance_is_two_sided_and_curvature_never_alarms():
    collapse = AdaptivePolicy(mtbf=3600)
    _feed(collapse, 30)
    d = collapse.should_save(_ctx(30, 30.0, reading=SignalReading(30, 1.0, 0.001, 1e-7)))
    assert d.save and d.reason == "risk alarm" and not d.calm  # gradients collapsed 1000x
    bend = AdaptivePolicy(mtbf=3600)
    _feed(bend, 30)
    d = bend.should_save(_ctx(30, 30.0, reading=SignalReading(30, 1.0, 5.0, 1e-4)))
    assert bend._risk > 0.99 and not d.save and not d.calm  # risky, but no alarm from curvature


def test_adaptive_alarm_fires_once_per_anomaly_and_rearms():
    pol = Bounded(AdaptivePolicy(mtbf=3600), min_interval=0.0, max_interval=1e9)
    _feed(pol.inner, 30)
    last, reasons = 0.0, []
    for i, var in enumerate([1e-2] * 5 + [1e-4] * 5 + [1e-2]):
        step = 30 + i
        d = pol.should_save(
            _ctx(step, float(step), last_time=last, reading=SignalReading(step, 1.0, 0.001, var))
        )
        if d.save:
            reasons.append((step, d.reason))
            last = float(step)
    assert reasons == [(30, "risk alarm"), (40, "risk alarm")]  # not one per anomalous reading


def test_adaptive_clock_runs_faster_with_risk_and_keeps_saves_evenly_spaced():
    pol = AdaptivePolicy(mtbf=3600, max_interval=100)  # no cost measured yet: T = 50 s
    assert pol.interval(_ctx(1, 0.0)) == 50.0
    pol._risk = 1.0
    assert pol.rate() == pytest.approx(2.0)  # full risk halves the interval (hazard 4)
    # Noisy but calm signals: saves every T, evenly, however the risk fluctuates per reading.
    pol = Bounded(AdaptivePolicy(mtbf=3600, max_interval=100), min_interval=0.0, max_interval=1e9)
    last, saves = 0.0, []
    for i in range(1, 1001):
        t = float(i)
        r = SignalReading(i, 1.0, 0.01 * math.sin(i * 1.7), 1e-4 * 2 ** (0.5 * math.cos(i * 2.3)))
        d = pol.should_save(_ctx(i, t, last_time=last, reading=r))
        if d.save:
            saves.append(t)
            last = t
    gaps = [b - a for a, b in zip([0.0, *saves], saves, strict=False)]
    assert len(saves) >= 15
    assert max(gaps) - min(gaps) <= 0.25 * 50, gaps


def test_adaptive_saves_during_a_loss_surge_are_not_calm():
    pol = AdaptivePolicy(mtbf=3600)
    decisions = [
        pol.should_save(_ctx(i, float(i), reading=SignalReading(i, loss, 0.001, 1e-4)))
        for i, loss in enumerate([1.0 + 0.01 * (i % 3) for i in range(30)] + [3.0, 3.1, 1.01, 1.0])
    ]
    assert all(d.calm for d in decisions[:30])
    assert not decisions[30].calm and not decisions[31].calm and pol._risk < 0.5  # the loss alone
    assert not any(d.save for d in decisions)  # the loss level never forces a save
    assert decisions[32].calm and decisions[33].calm and not pol.in_surge  # back near its level


def test_make_policy_by_name():
    assert isinstance(make_policy(Settings()).inner, AdaptivePolicy)
    assert isinstance(make_policy(Settings(policy="seed")).inner, SeedPolicy)
    assert make_policy(Settings(every_steps=5)).bound_inner is False


def test_signals_median_filter_curvature_and_global_variance():
    sig = Signals(window=5, eval_every=10)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    sig.collect_grads(opt)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    for loss in (1.0, 9.0, 1.1, 1.2, 1.3):  # one outlier batch: the median ignores it
        sig.add_loss(torch.tensor(loss))
    r = sig.evaluate(10)
    assert r.loss == pytest.approx(1.2) and r.curvature is None
    assert r.grad_var == pytest.approx(grads.var(unbiased=False).item(), rel=1e-5)
    assert curvature([1.0, 0.8, 0.7]) == pytest.approx(0.1)


def _variance_reading(tmp_path, name: str, *, clip: float | None, scale: float | None) -> float:
    """One real training run of 10 steps under a manager; the reading at step 10."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000) if scale else None
    with sc.CheckpointManager(tmp_path / name, every_steps=10**6, eval_every=10) as mgr:
        mgr.register(model=model, optimizer=opt, **({"scaler": scaler} if scaler else {}))
        for step in range(1, 11):
            x = torch.randn(64, 16)
            loss = (model(x) - x[:, :1]).pow(2).mean()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            else:
                loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            mgr.step(step, loss)
        reading = mgr._last_reading
    assert reading is not None and reading.grad_var is not None
    return reading.grad_var


def test_gradient_variance_is_read_before_clipping_and_loss_scaling(tmp_path):
    # Clipping changes the updates, so a clipped run's step-10 gradients differ a little from a
    # plain run's; but their variance stays of the same order, while the clipped gradients' own
    # variance is pinned near max_norm²/n (a tiny max_norm clips every step).
    plain = _variance_reading(tmp_path, "plain", clip=None, scale=None)
    huge_clip = _variance_reading(tmp_path, "noop-clip", clip=1e9, scale=None)
    assert huge_clip == pytest.approx(plain, rel=1e-5)  # a clip that never clips changes nothing
    scaled = _variance_reading(tmp_path, "scaled", clip=None, scale=2.0**12)
    assert scaled == pytest.approx(plain, rel=1e-4)  # the loss scale is undone
    clipped = _variance_reading(tmp_path, "clipped", clip=1e-3, scale=None)
    n = sum(
        p.numel() for p in torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)).parameters()
    )
    pinned = (1e-3) ** 2 / n  # what the clipped gradients' own variance would be at most
    assert clipped > 100 * pinned, "the reading is the clipped gradients' variance"
    assert 0.01 * plain < clipped < 100 * plain


def test_retention_keeps_the_newest_calm_checkpoint():
    recs = [CheckpointRecord(s, f"c{s}", "m", "h", position=s, calm=s <= 2) for s in range(1, 7)]
    doomed = {r.step for r in select_prunable(recs, keep_last=3)}
    assert doomed == {1, 3}  # 4-6 kept by keep_last; 2 is the newest calm one: kept too
    recs.append(CheckpointRecord(7, "c7", "m", "h", position=7, health="nonfinite-loss"))
    assert {r.step for r in select_prunable(recs, keep_last=3)} == {1, 3}  # unhealthy evicts nothing


def test_nonfinite_loss_and_weights_never_replace_a_healthy_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    with sc.CheckpointManager(tmp_path, every_steps=1, keep_last=1) as mgr:
        mgr.register(model=model)
        assert mgr.step(1, loss=torch.tensor(0.5)).handle.wait().health == "ok"
        good = {k: v.clone() for k, v in model.state_dict().items()}
        assert mgr.step(2, loss=torch.tensor(float("nan"))).handle.wait() is not None
        with torch.no_grad():
            model.weight[0, 0] = float("inf")
        assert mgr.step(3, loss=torch.tensor(0.4)).handle.wait().health == "nonfinite-weights"
    journal = (tmp_path / "journal.jsonl").read_text()
    assert '"health":"nonfinite-loss"' in journal and '"health":"nonfinite-weights"' in journal
    fresh = torch.nn.Linear(8, 8)
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(model=fresh)
        assert mgr.restore() == 1  # unhealthy ones skipped; keep_last=1 did not evict step 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in good.items())


def test_trace_and_manifest_record_the_signals(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters())
    with sc.CheckpointManager(tmp_path, every_steps=20, eval_every=5) as mgr:
        mgr.register(model=model, optimizer=opt)
        for step in range(1, 41):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mgr.step(step, loss=loss)
    (trace,) = (tmp_path / "traces").iterdir()
    lines = trace.read_text().splitlines()
    assert lines[0] == "step,time,loss,curvature,grad_var,update,memory,score,decision,raw_loss"
    rows = [ln.split(",") for ln in lines[1:]]
    assert [int(r[0]) for r in rows] == list(range(5, 41, 5))
    assert all(float(r[4]) > 0 for r in rows)  # gradient variance measured
    assert all(float(r[5]) > 0 for r in rows)  # and the planned update
    assert all(float(r[9]) > 0 for r in rows)  # and the raw loss (a square: positive)
    assert rows[3][8] == "every 20 steps" and rows[7][8] == "every 20 steps"
    manifest = sorted((tmp_path / "manifests").iterdir())[-1].read_text()
    assert '"signals":{"curvature"' in manifest and '"step":40' in manifest
