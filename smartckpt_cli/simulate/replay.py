"""Replaying a trace under one policy: the saves it takes and the exact expected lost work."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from smartckpt_cli.errors import ConfigError
from smartckpt_cli.signals import SignalReading
from smartckpt_cli.simulate.trace import TraceRow
from smartckpt_cli.trigger import (
    Policy,
    TriggerContext,
)


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
    return SignalReading(r.step, r.loss, r.curvature, r.grad_var, raw_loss=r.loss)


def replay(
    rows: Sequence[TraceRow], policy: Policy, cfg: SimConfig, *, mtbf: float | None = None
) -> tuple[list[Save], float]:
    """The saves ``policy`` takes on ``rows``, and the seconds the loop would wait for a save
    in flight."""
    start = rows[0].time
    last_step: int | None = None
    last_time = start
    busy_until = -math.inf
    stall = 0.0
    saves: list[Save] = []
    for r in rows:
        ctx = TriggerContext(
            r.step,
            r.time,
            last_step,
            last_time,
            loss=r.loss,
            reading=_reading(r),
            save_cost=cfg.save_cost,
            save_total=cfg.save_total,
            mtbf=mtbf if mtbf is not None else cfg.mtbf,
        )
        d = policy.should_save(ctx)
        if not d.save:
            continue
        begin = max(r.time, busy_until)
        stall += begin - r.time
        busy_until = begin + cfg.save_total
        healthy = r.loss is None or math.isfinite(r.loss)
        saves.append(Save(r.step, r.time, busy_until, d.calm and healthy, healthy, d.reason))
        if healthy:
            last_step, last_time = r.step, r.time
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
