"""Saves before the optimizer update: the planned-update signal, the policy's ``before_update``,
the manager's checkpoint of the previous step taken from the step pre-hook, and its replay."""

from __future__ import annotations

import math
import random
import shutil

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import smartckpt_cli as sc
from smartckpt_cli.simulate import SimConfig, TraceRow, replay
from smartckpt_cli.store.directory import open_store
from smartckpt_cli.trigger.adaptive import AdaptivePolicy
from smartckpt_cli.trigger.bounded import Bounded
from smartckpt_cli.trigger.context import TriggerContext
from smartckpt_cli.trigger.signals import SignalReading, Signals

JOLT = 30  # the step whose learning rate is multiplied by 400


def _planned_and_actual(opt_name: str, lr_factor: float = 1.0) -> tuple[float, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = (
        torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.0)
        if opt_name == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    sig = Signals(eval_every=1)
    for i in range(12):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        if i == 11:
            for g in opt.param_groups:
                g["lr"] *= lr_factor
            sig.collect_grads(opt)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    actual = math.sqrt(
        sum(float((p.detach() - b).pow(2).sum()) for p, b in zip(model.parameters(), before, strict=True))
    )
    planned = sig.evaluate(12).update
    assert planned is not None
    return planned, actual


def test_planned_update_is_sgds_step_exactly_and_follows_adams():
    planned, actual = _planned_and_actual("sgd")
    assert math.isclose(planned, actual, rel_tol=1e-4)
    planned, actual = _planned_and_actual("adamw")
    # Adam: g in place of the momentum, RMS per tensor: proportional, not equal
    assert 0.5 < planned / actual < 3.0
    jolted, _ = _planned_and_actual("adamw", lr_factor=400.0)
    assert math.isclose(jolted / planned, 400.0, rel_tol=1e-3)  # seen before the update runs


def _ctx(step, reading, last_time=0.0):
    return TriggerContext(step, float(step), None, last_time, reading=reading)


def test_adaptive_saves_before_the_update_once_per_surge_and_never_for_a_shrink():
    rng = random.Random(0)

    def reading(step, update):
        return SignalReading(step, 1.0, 0.001 * rng.gauss(0, 1), 1e-4 * 2 ** rng.gauss(0, 0.1), update=update)

    pol = Bounded(AdaptivePolicy(mtbf=3600), min_interval=0.0, max_interval=1e9)
    for s in range(1, 40):
        r = reading(s, 1e-3 * 2 ** rng.gauss(0, 0.1))
        assert not pol.before_update(_ctx(s, r)).save
        assert not pol.should_save(_ctx(s, r)).save
    small = reading(40, 1e-3 / 400)
    assert not pol.before_update(_ctx(40, small)).save  # a shrinking update is harmless
    pol.should_save(_ctx(40, small))
    surge = reading(41, 0.4)
    d = pol.before_update(_ctx(41, surge))
    assert d.save and d.reason == "precursor: planned update" and d.calm
    # the manager saved (last_save_time moved): the same reading is not judged twice, no second save
    assert not pol.should_save(_ctx(41, surge, last_time=41.0)).save
    again = reading(42, 0.4)  # still high: the alarm re-arms only once the surge is over
    assert not pol.before_update(_ctx(42, again, last_time=41.0)).save


def _setup(batchnorm: bool = False):
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(32))
    model = nn.Sequential(*layers, nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    loader = DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))
    return model, opt, loader


def _train(model, opt, loader, first: int, last: int, mgr=None) -> dict[int, float]:
    """Steps first..last; the update of step JOLT runs at 400x the learning rate. Epochs of 12
    batches wrap."""
    losses, it = {}, iter(loader)
    for step in range(first, last + 1):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        lrs = [group["lr"] for group in opt.param_groups]
        if step == JOLT:  # changed for this one update, then put back: the boundary has lr 1e-3
            for group in opt.param_groups:
                group["lr"] *= 400.0
        opt.step()
        for group, lr in zip(opt.param_groups, lrs, strict=True):
            group["lr"] = lr
        opt.zero_grad()
        losses[step] = loss.item()
        if mgr is not None:
            mgr.step(step, loss=loss.detach())
    return losses


def _manager(path):
    # eval_every=1 so the jolt's step is evaluated; no interval saves, no floor
    return sc.CheckpointManager(path, eval_every=1, max_interval=1e9, min_interval=0.0, keep_last=5)


def _records(path):
    return open_store(path).journal.read().live()


def test_a_precursor_save_holds_the_previous_step_and_resumes_bit_exactly(tmp_path):
    model, opt, loader = _setup()
    reference = _train(model, opt, loader, 1, 40)
    final = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt, loader = _setup()
    with _manager(tmp_path) as mgr:
        mgr.register(model=model, optimizer=opt, data=loader)
        _train(model, opt, loader, 1, JOLT, mgr)
    (rec,) = _records(tmp_path)  # the jolt's own step boundary saved nothing more
    assert (rec.step, rec.reason, rec.calm, rec.health) == (JOLT - 1, "precursor: planned update", True, "ok")

    # A fresh process's view: new objects, restore the step before the jolt, train on. Model,
    # moments, dropout's RNG and the loader's position must be those of step JOLT - 1's boundary.
    model, opt, loader = _setup()
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(model=model, optimizer=opt, data=loader)
        assert mgr.restore() == JOLT - 1
    resumed = _train(model, opt, loader, JOLT, 40)
    assert resumed == {s: reference[s] for s in range(JOLT, 41)}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in final.items())


def _trace_steps(path) -> list[int]:
    (trace,) = (path / "traces").glob("*.csv")
    return [int(line.split(",", 1)[0]) for line in trace.read_text().splitlines()[1:]]


def test_after_a_restore_the_evaluations_name_the_steps_that_follow_it(tmp_path):
    """The optimizer pre-hook evaluates step N + 1 before its update; after a restore of step N
    it must be N + 1, not the count of steps this process ran (a trace row "1" was written)."""
    model, opt, loader = _setup()
    with _manager(tmp_path) as mgr:
        mgr.register(model=model, optimizer=opt, data=loader)
        _train(model, opt, loader, 1, 12, mgr)
        mgr.save(12, blocking=True)
    assert _trace_steps(tmp_path) == list(range(1, 13))
    shutil.rmtree(tmp_path / "traces")

    model, opt, loader = _setup()
    with _manager(tmp_path) as mgr:
        mgr.register(model=model, optimizer=opt, data=loader)
        assert mgr.restore() == 12
        _train(model, opt, loader, 13, 20, mgr)
    assert _trace_steps(tmp_path) == list(range(13, 21))


def test_a_buffer_forward_changed_moves_the_save_to_the_step_boundary(tmp_path):
    model, opt, loader = _setup(batchnorm=True)  # BatchNorm's running statistics move in forward
    with _manager(tmp_path) as mgr:
        mgr.register(model=model, optimizer=opt, data=loader)
        _train(model, opt, loader, 1, JOLT, mgr)
    (rec,) = _records(tmp_path)
    # not the previous step with this step's statistics: the boundary after the update, not calm
    assert (rec.step, rec.reason, rec.calm) == (JOLT, "risk alarm", False)


def test_replay_puts_a_precursor_save_at_the_step_before_the_row():
    rng = random.Random(1)
    rows = []
    for i in range(60):
        update = 1e-3 * 2 ** rng.gauss(0, 0.1) * (400.0 if i == 40 else 1.0)
        rows.append(TraceRow(i + 1, 100.0 + 2.0 * i, 1.0, 0.0, 1e-4 * 2 ** rng.gauss(0, 0.1), update=update))
    policy = Bounded(AdaptivePolicy(mtbf=1e9), min_interval=0.0, max_interval=1e9)
    saves, _ = replay(rows, policy, SimConfig(save_total=1.0, max_interval=1e9))
    (save,) = saves
    assert (save.step, save.time, save.reason, save.calm) == (
        40,
        rows[39].time,
        "precursor: planned update",
        True,
    )
    assert save.commit == rows[40].time + 1.0  # taken during row 41's step, committed after


def test_a_precursor_is_floored_only_by_another_and_never_saves_a_later_state():
    rng = random.Random(2)

    def reading(step, update):
        return SignalReading(step, 1.0, 0.0, 1e-4 * 2 ** rng.gauss(0, 0.1), update=update)

    def calm(step):
        return reading(step, 1e-3 * 2 ** rng.gauss(0, 0.1))

    pol = Bounded(AdaptivePolicy(mtbf=3600), min_interval=10.0, max_interval=1e9)
    for s in range(1, 30):
        pol.should_save(_ctx(s, calm(s)))
    # a scheduled save 2 s ago: the precursor still saves the state before the update
    surge = reading(30, 0.4)
    assert pol.before_update(_ctx(30, surge, last_time=28.0)).save
    pol.should_save(_ctx(30, surge, last_time=30.0))
    pol.before_update(_ctx(31, calm(31), last_time=30.0))  # calm again: re-armed
    pol.should_save(_ctx(31, calm(31), last_time=30.0))
    # a second surge 2 s after the first precursor: floored; the alarm it raised is not taken
    # before the next update (that state already holds the surging one), only at a boundary
    second = reading(32, 0.4)
    assert not pol.before_update(_ctx(32, second, last_time=30.0)).save
    assert not pol.should_save(_ctx(32, second, last_time=30.0)).save  # min_interval too
    later = reading(41, 1e-3)
    assert not pol.before_update(_ctx(41, later, last_time=30.0)).save
    d = pol.should_save(_ctx(41, later, last_time=30.0))
    assert d.save and d.reason == "risk alarm" and not d.calm
