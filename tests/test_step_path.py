"""The per-step path: what a step that neither evaluates nor saves still does, and that doing
less changes no decision (cadence.py, signals.py's readback, trigger.py's ``quiet_until``,
the manager's ``may_save``/``can_save``, staging prepared off the critical path).

No timing here: equivalence and counting, with a fake clock where time matters.
"""

from __future__ import annotations

import math
import os
import random
import signal

import pytest
import torch

import smartckpt_cli as sc
from smartckpt_cli.config import Settings
from smartckpt_cli.engine.cadence import DECIDE_LATENCY, StepClock, decide_gap
from smartckpt_cli.engine.hostmem import host_buffer, pin_region, unpin_region
from smartckpt_cli.trigger.adaptive import AdaptivePolicy
from smartckpt_cli.trigger.bounded import Bounded
from smartckpt_cli.trigger.context import TriggerContext
from smartckpt_cli.trigger.planned import PlannedUpdate, _planned_per_tensor
from smartckpt_cli.trigger.policies import make_policy
from smartckpt_cli.trigger.reading import SignalReading
from smartckpt_cli.trigger.signals import BASE_EVERY, Signals
from smartckpt_cli.trigger.simple import FixedPolicy, SeedPolicy

# ------------------------------------------------------------------ quiet_until changes nothing


def _policies() -> dict[str, tuple[Bounded, Bounded]]:
    def two(make):
        return make(), make()

    return {
        "adaptive": two(lambda: make_policy(Settings(max_interval=40.0, min_interval=3.0, mtbf=900.0))),
        "adaptive+steps": two(lambda: make_policy(Settings(max_interval=40.0, max_interval_steps=70))),
        "fixed steps": two(lambda: make_policy(Settings(every_steps=23))),
        "fixed seconds": two(lambda: make_policy(Settings(every_seconds=7.5))),
        "seed": two(lambda: make_policy(Settings(policy="seed", threshold=0.6))),
        "bare adaptive": two(lambda: Bounded(AdaptivePolicy(mtbf=600.0, max_interval=30.0), 2.0, 30.0)),
        "floored": two(lambda: Bounded(FixedPolicy(every_seconds=1.0), min_interval=4.0, max_interval=50.0)),
        "fixed, no quiet_until": two(lambda: Bounded(_NoQuiet(FixedPolicy(every_steps=9)), 1.0, 50.0)),
    }


class _NoQuiet:
    """A user policy without ``quiet_until``: asked at every step."""

    def __init__(self, inner: FixedPolicy) -> None:
        self.inner = inner

    def should_save(self, ctx: TriggerContext) -> object:
        return self.inner.should_save(ctx)


@pytest.mark.parametrize("name", list(_policies()))
def test_asking_the_policy_only_when_it_may_save_takes_the_same_saves(name):
    """One copy of the policy is asked at every step, the other only as the manager does: at a
    reading, after a save, or from the step/time ``quiet_until`` named. Same saves, same steps."""
    every, sparse = _policies()[name]
    rnd = random.Random(7)
    now, step = 1000.0, 0
    saved_every: list[tuple[int, str]] = []
    saved_sparse: list[tuple[int, str]] = []
    state = {"every": (None, now), "sparse": (None, now)}
    quiet = (-math.inf, -math.inf)
    asked = 0
    for _ in range(3000):
        step += 1
        now += rnd.choice([0.05, 0.1, 0.2, 1.5])  # uneven steps, a slow one now and then
        reading = None
        if step % 10 == 0:  # an evaluation; a surge of the gradient variance now and then
            var = 1e-4 * (50.0 if rnd.random() < 0.03 else 1.0) * rnd.uniform(0.8, 1.2)
            reading = SignalReading(step, 1.0, rnd.gauss(0, 0.01), var, update=rnd.uniform(0.9, 1.1))
        for key, pol, out in (("every", every, saved_every), ("sparse", sparse, saved_sparse)):
            last_step, last_time = state[key]
            ctx = TriggerContext(
                step, now, last_step, last_time, reading=reading, save_cost=0.2, save_total=1.0
            )
            if key == "sparse" and not (reading is not None or step >= quiet[0] or now >= quiet[1]):
                continue
            if key == "sparse":
                asked += 1
            d = pol.should_save(ctx)
            if key == "sparse":
                ask = getattr(pol, "quiet_until", None)
                quiet = ask(ctx) if ask else (step, now)
            if d.save:
                out.append((step, d.reason))
                state[key] = (step, now)
                if key == "sparse":
                    quiet = (-math.inf, -math.inf)  # the manager asks again after a save
    assert saved_every == saved_sparse
    assert len(saved_every) >= 5, saved_every
    if name != "fixed, no quiet_until":
        assert asked < 3000 * 0.5, f"asked {asked} times in 3000 steps"


def test_policies_say_until_when_they_cannot_save():
    ctx = TriggerContext(50, 100.0, 40, 90.0)
    assert FixedPolicy(every_steps=25).quiet_until(ctx) == (65, math.inf)
    assert FixedPolicy(every_seconds=30.0).quiet_until(ctx) == (math.inf, 120.0)
    assert SeedPolicy().quiet_until(ctx) == (math.inf, math.inf)
    b = Bounded(FixedPolicy(every_steps=25), min_interval=5.0, max_interval=60.0, max_interval_steps=12)
    assert b.quiet_until(ctx) == (52, 150.0)  # the budget, in steps and in seconds
    assert Bounded(_NoQuiet(FixedPolicy(every_steps=3))).quiet_until(ctx) == (50, 100.0)  # every step
    floored = Bounded(FixedPolicy(every_seconds=2.0), min_interval=5.0, max_interval=60.0)
    assert floored.quiet_until(ctx) == (math.inf, 95.0)  # due at 92 s, refused until the floor


# ------------------------------------------------------------------ several ranks: the decision gap


def test_decision_steps_are_spaced_by_cost_capped_in_time_and_land_on_step_schedules():
    assert decide_gap(10, 0.003, 0.0, math.inf) == 1  # cost unknown yet: next step
    assert decide_gap(10, 0.003, 150e-6, math.inf) == 20  # 150 µs ≤ 0.25 % of 20 steps of 3 ms
    assert decide_gap(10, 0.003, 5e-3, math.inf) == int(
        DECIDE_LATENCY / 0.003
    )  # at most DECIDE_LATENCY apart
    assert decide_gap(10, 0.003, 150e-6, 15) == 5  # lands on the step a schedule saves at
    assert decide_gap(10, 0.5, 150e-6, math.inf) == 1  # long steps: every step
    assert decide_gap(10, 0.6, 5e-3, math.inf) == 1  # at most DECIDE_LATENCY apart, at least 1
    assert decide_gap(10, 0.0, 1.0, math.inf) == 1


def test_the_step_clock_averages_over_the_steps_it_did_not_see_and_skips_saves():
    clock = StepClock()
    for step in range(0, 100, 10):  # shown every 10th step only (the fast path skips the rest)
        clock.tick(step * 0.01, step)
    assert clock.seconds == pytest.approx(0.01)
    clock.skip()  # a save (or a restore) ran in the next interval
    clock.tick(5.0, 100)
    clock.tick(5.05, 105)
    assert clock.seconds == pytest.approx(0.01)


# ------------------------------------------------------------------ signals: cadence and readback


def test_an_explicit_eval_every_is_exact_and_the_default_stretches_with_cost():
    fixed = Signals(eval_every=7)
    assert [s for s in range(1, 30) if fixed.due(s)] == [7, 14, 21, 28]
    auto = Signals()
    assert auto.due(BASE_EVERY) and not auto.due(BASE_EVERY - 1)
    auto.launch(BASE_EVERY)
    assert auto.poll() is not None and not auto.due(BASE_EVERY)
    # an evaluation of 1 ms against 2 ms steps: at most 0.25 % of the time -> every 200 steps
    auto.step_time, auto.cost = 2e-3, 1e-3
    auto.launch(20)
    auto.poll()
    assert auto.every == 200 and not auto.due(219) and auto.due(220)
    auto.step_time, auto.cost = 1.0, 1e-3  # long steps: back to the base spacing
    auto.launch(220)
    assert auto.every == BASE_EVERY and auto.due(230)


def test_only_the_losses_of_the_window_are_kept_and_the_reading_is_theirs():
    sig = Signals(window=3, eval_every=10)
    kept = [s for s in range(1, 21) if sig.keeps_loss(s)]
    assert kept == [7, 8, 9, 10, 17, 18, 19, 20]  # the window, plus one step of slack
    for s in kept[:4]:
        sig.add_loss(torch.tensor(float(s)))
    r = sig.evaluate(10)
    assert r.loss == 9.0 and r.raw_loss == 10.0  # median of the last 3: 8, 9, 10


def test_a_cpu_reading_is_there_at_once_and_a_launch_finishes_the_one_before():
    sig = Signals(eval_every=1)
    assert sig.poll() is None
    sig.add_loss(torch.tensor(2.0))
    sig.launch(1, memory=0.25)
    sig.add_loss(torch.tensor(4.0))
    sig.launch(2)  # the first reading was not polled: dropped, the newest wins
    r = sig.poll()
    assert r is not None and r.step == 2 and r.memory is None and sig.poll() is None


def test_the_planned_update_on_vectors_equals_the_one_tensor_at_a_time_form():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    groups = [
        {"params": list(model[0].parameters()), "lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-6},
        {"params": list(model[1].parameters()), "lr": 3e-3},
        {"params": list(model[2].parameters()), "lr": 1e-3, "weight_decay": 0.1},
    ]
    opt = torch.optim.AdamW(groups)
    for _ in range(3):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
    model(torch.randn(4, 6)).pow(2).mean().backward()
    params = [p for g in opt.param_groups for p in g["params"]]
    sq = torch.stack([p.grad.pow(2).sum() for p in params])
    got = PlannedUpdate().squared(opt, params, sq)
    want, i = torch.zeros(()), 0
    for g in opt.param_groups:
        n = len(g["params"])
        beta2 = g["betas"][1]
        want = want + sum(_planned_per_tensor(opt, g["params"], sq[i : i + n], g["lr"], beta2, g["eps"]))
        i += n
    assert got is not None and got.item() == pytest.approx(want.item(), rel=1e-5)


# ------------------------------------------------------------------ the manager's step path


class _Counting:
    """The real policy, counting how often the manager asks it."""

    def __init__(self, inner: Bounded) -> None:
        self.inner, self.asked = inner, 0

    def should_save(self, ctx):
        self.asked += 1
        return self.inner.should_save(ctx)

    def quiet_until(self, ctx):
        return self.inner.quiet_until(ctx)


def _trained(tmp_path, policy=None, **settings):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = sc.CheckpointManager(tmp_path / "store", policy=policy, **settings)
    mgr.register(model=model, optimizer=opt)
    return model, opt, mgr


def _step(model, opt):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_a_step_schedule_is_kept_exactly_while_the_policy_is_asked_rarely(tmp_path):
    policy = _Counting(make_policy(Settings(every_steps=7)))
    model, opt, mgr = _trained(tmp_path, policy=policy, eval_every=50)
    with mgr:
        saved = [s for s in range(1, 101) if mgr.step(s, loss=_step(model, opt)).saved]
    assert saved == [7, 14, 21, 28, 35, 42, 49, 56, 63, 70, 77, 84, 91, 98]
    # at the due steps, the step after each save, after each commit, and at the 2 readings
    assert policy.asked <= 3 * len(saved) + 2 + 1, policy.asked


def test_a_step_that_cannot_be_saved_hands_the_save_and_the_signal_to_the_next(tmp_path):
    model, opt, mgr = _trained(tmp_path, every_steps=3, usr_continue=True, eval_every=1000)
    with mgr:
        assert not mgr.step(1, loss=_step(model, opt)).saved
        assert not mgr.step(2, loss=_step(model, opt)).saved
        assert mgr.may_save(3)
        res = mgr.step(3, loss=_step(model, opt), can_save=False)
        assert not res.saved and mgr.may_save(4)  # the schedule's save waits...
        res = mgr.step(4, loss=_step(model, opt))
        assert res.saved and res.reason == "every 3 steps" and res.handle.wait().step == 4  # ...one step
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, recorded by the handler
        assert mgr.may_save(5)
        assert not mgr.step(5, loss=_step(model, opt), can_save=False).saved  # not taken here
        res = mgr.step(6, loss=_step(model, opt))
        assert res.saved and res.reason == "preemption (SIGUSR1)"  # taken at the next step that can


def test_may_save_is_false_between_saves_and_evaluations(tmp_path):
    model, opt, mgr = _trained(tmp_path, every_steps=50, eval_every=20)
    with mgr:
        for s in range(1, 13):
            mgr.step(s, loss=_step(model, opt))
        assert not mgr.may_save(13)  # no evaluation at 13/14, the schedule's save at 50
        assert mgr.may_save(19)  # the evaluation of step 20 comes in its pre-hook
        assert mgr.may_save(50)


def test_staging_is_prepared_at_the_first_step_and_the_first_save_reuses_it(tmp_path):
    model, opt, mgr = _trained(tmp_path, every_steps=5)
    with mgr:
        mgr.step(1, loss=_step(model, opt))  # the optimizer's moments exist now: prepared
        mgr._stager.ready()
        before = {k: b.data_ptr() for k, b in mgr._stager._buffers.items()}
        assert {
            "model/weight",
            "model/bias",
            "optimizer/state/0/exp_avg",
            "optimizer/state/1/exp_avg_sq",
        } <= set(before)
        for s in range(2, 6):
            res = mgr.step(s, loss=_step(model, opt))
        assert res.saved and res.handle.wait() is not None
        after = {k: b.data_ptr() for k, b in mgr._stager._buffers.items()}
        assert after == before  # the save staged into the prepared buffers, allocating none


def test_a_region_that_cannot_be_pinned_says_so():
    """The RAM tier pins its slots for a state on a GPU (pin_region); without CUDA it says it
    could not, and the slot stays plain shared memory."""
    if torch.cuda.is_available():
        pytest.skip("this machine can pin memory")
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    assert pin_region(buf.data_ptr(), buf.numel()) is False
    unpin_region(buf.data_ptr())  # harmless on memory never pinned


def test_pinning_that_fails_falls_back_to_pageable_memory():
    buf = host_buffer(torch.Size([3, 5]), torch.float16, pin=True)  # no CUDA here: cannot pin
    if torch.cuda.is_available():
        pytest.skip("this machine can pin memory")
    assert buf.shape == (3, 5) and buf.dtype == torch.float16 and not buf.is_pinned()
    buf.copy_(torch.ones(3, 5))
    assert buf.sum().item() == 15


def test_a_signal_after_the_last_step_is_handed_on_at_close(tmp_path):
    """Never swallowed: a SIGTERM that no step took (it came after the last one) still ends the
    process by SIGTERM once the manager has closed (its save in flight committed)."""
    code = (
        "import os, signal, torch, smartckpt_cli as sc\n"
        f"mgr = sc.CheckpointManager({str(tmp_path / 'store')!r}, every_steps=2)\n"
        "m = torch.nn.Linear(2, 2)\nmgr.register(model=m)\n"
        "for s in range(1, 5):\n    mgr.step(s, loss=torch.tensor(1.0))\n"
        "os.kill(os.getpid(), signal.SIGTERM)\nprint('closing', flush=True)\nmgr.close()\nprint('not reached')\n"
    )
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == -signal.SIGTERM, res.stderr[-2000:]
    assert "closing" in res.stdout and "not reached" not in res.stdout
    assert "arrived after the last step" in res.stderr
    journal = (tmp_path / "store" / "journal.jsonl").read_text()
    assert '"step":4' in journal  # the save in flight was committed first
