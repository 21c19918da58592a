"""Replaying a trace under one policy: the saves it takes and the exact expected lost work."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from smartckpt_cli.errors import ConfigError
from smartckpt_cli.simulate.trace import TraceRow
from smartckpt_cli.trigger.context import TriggerContext
from smartckpt_cli.trigger.policies import Policy
from smartckpt_cli.trigger.reading import SignalReading


@dataclass(frozen=True)
class SimConfig:
    mtbf: float = 21600.0  # seconds between failures
    save_cost: float = 0.5  # seconds the loop loses per save
    save_total: float = 5.0  # seconds from a save's start to its commit
    min_interval: float = 10.0
    max_interval: float = 180.0
    keep_last: int = 3
    checkpoints: int | None = None  # calibrate every policy to this many saves
    spike_k: float = 6.0
    spike_window: int = 3
    spike_baseline: int = 20
    spike_noise: int = 200
    onsets: tuple[int, ...] | None = None  # steps; overrides the onset column and detection
    rollback: str = "end"  # when the rollback is decided: at the event's "end" or its "onset"

    def check(self) -> None:
        if self.mtbf <= 0:
            raise ConfigError("mtbf must be positive")
        if self.save_cost < 0 or self.save_total < 0:
            raise ConfigError("save costs cannot be negative")
        if self.max_interval <= 0 or not 0 <= self.min_interval <= self.max_interval:
            raise ConfigError("need 0 <= min_interval <= max_interval and max_interval > 0")
        if self.keep_last < 1:
            raise ConfigError("keep_last must be at least 1")
        if self.rollback not in ("end", "onset"):
            raise ConfigError(f"rollback must be 'end' or 'onset', not {self.rollback!r}")
        if self.checkpoints is not None and self.checkpoints < 1:
            raise ConfigError("checkpoints must be at least 1")
        if self.spike_k <= 0 or self.spike_window < 1 or self.spike_baseline < 5 or self.spike_noise < 5:
            raise ConfigError(
                "spike_k must be positive, spike_window >= 1, spike_baseline and spike_noise >= 5"
            )


@dataclass(frozen=True)
class Save:
    step: int
    time: float  # the snapshot: the state of this step
    commit: float  # when it became committed
    calm: bool
    healthy: bool
    reason: str


def _reading(r: TraceRow) -> SignalReading:
    return SignalReading(
        r.step, r.loss, r.curvature, r.grad_var, raw_loss=r.loss, update=r.update, memory=r.memory
    )


def replay(
    rows: Sequence[TraceRow], policy: Policy, cfg: SimConfig, *, mtbf: float | None = None
) -> tuple[list[Save], float]:
    """The saves ``policy`` takes on ``rows``, and the seconds the loop would wait for a save
    in flight.

    As in the manager, a row's reading is first shown to the policy's ``before_update`` (if it
    has one): a save there holds the state of the step *before* the row's step (the update the
    row's signals were measured for has not run), its time interpolated between the rows. Then
    ``should_save`` decides at the row's step boundary."""
    start = rows[0].time
    last_step: int | None = None
    last_time = start
    busy_until = -math.inf
    stall = 0.0
    saves: list[Save] = []
    before = getattr(policy, "before_update", None)

    def ctx(r: TraceRow, reading: SignalReading) -> TriggerContext:
        return TriggerContext(
            r.step,
            r.time,
            last_step,
            last_time,
            loss=r.loss,
            reading=reading,
            save_cost=cfg.save_cost,
            save_total=cfg.save_total,
            mtbf=mtbf if mtbf is not None else cfg.mtbf,
        )

    def take(r: TraceRow, step: int, state_time: float, calm: bool, reason: str) -> None:
        nonlocal busy_until, stall, last_step, last_time
        begin = max(r.time, busy_until)
        stall += begin - r.time
        busy_until = begin + cfg.save_total
        healthy = r.loss is None or math.isfinite(r.loss)
        saves.append(Save(step, state_time, busy_until, calm and healthy, healthy, reason))
        if healthy:
            last_step, last_time = step, r.time

    prev: TraceRow | None = None
    for r in rows:
        reading = _reading(r)
        if before is not None and prev is not None:
            d = before(ctx(r, reading))
            if d.save:
                step = r.step - 1  # the state before this row's update
                at = prev.time + (r.time - prev.time) * (step - prev.step) / (r.step - prev.step)
                take(r, step, at, d.calm, d.reason)
        d = policy.should_save(ctx(r, reading))
        if d.save:
            take(r, r.step, r.time, d.calm, d.reason)
        prev = r
    return saves, stall


def mean_lost_work(saves: Sequence[Save], start: float, end: float) -> float:
    """Time average over [start, end] of the work a failure loses (see module docstring)."""
    if end <= start:
        return 0.0
    total, t, base = 0.0, start, start
    for s in sorted((s for s in saves if s.healthy and s.commit <= end), key=lambda s: s.commit):
        c = max(s.commit, start)
        total += ((c - base) ** 2 - (t - base) ** 2) / 2.0
        t, base = c, max(base, s.time)
    total += ((end - base) ** 2 - (t - base) ** 2) / 2.0
    return total / (end - start)
