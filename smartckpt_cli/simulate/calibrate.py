"""Bringing every policy to the same number of checkpoints: one knob per policy, searched."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smartckpt_cli.simulate.replay import Save, SimConfig
from smartckpt_cli.trigger.adaptive import AdaptivePolicy
from smartckpt_cli.trigger.bounded import Bounded
from smartckpt_cli.trigger.policies import Policy
from smartckpt_cli.trigger.simple import FixedPolicy, SeedPolicy


@dataclass(frozen=True)
class _Knob:
    lo: float
    hi: float
    geometric: bool
    default: float
    build: Callable[[float], tuple[Policy, float]]  # knob -> (policy, mtbf it sees)
    label: Callable[[float], str]


def _knobs(cfg: SimConfig, duration: float) -> dict[str, _Knob]:
    def bounded(inner: Any, *, floor: bool = True) -> Bounded:
        return Bounded(inner, cfg.min_interval, cfg.max_interval, bound_inner=floor)

    def adaptive(x: float) -> tuple[Policy, float]:
        pol = AdaptivePolicy(mtbf=cfg.mtbf * x * x, max_interval=cfg.max_interval * x)
        return bounded(pol), cfg.mtbf * x * x

    return {
        "fixed": _Knob(
            1e-3,
            max(duration, 1e-3) * 1.01,
            True,
            cfg.max_interval,
            lambda x: (bounded(FixedPolicy(every_seconds=x), floor=False), cfg.mtbf),
            lambda x: f"every {x:.4g}s",
        ),
        "seed": _Knob(
            0.35,
            0.86,
            False,
            0.65,
            lambda x: (bounded(SeedPolicy(threshold=x)), cfg.mtbf),
            lambda x: f"threshold {x:.4f}",
        ),
        "adaptive": _Knob(
            1 / 64,
            64.0,
            True,
            1.0,
            adaptive,
            lambda x: f"interval x{x:.3g} (mtbf {cfg.mtbf * x * x:.4g}s)",
        ),
    }


@dataclass
class _Run:
    x: float
    saves: list[Save]
    stall: float
    lost: float

    @property
    def n(self) -> int:
        return len(self.saves)


def _mid(a: float, b: float, geometric: bool) -> float:
    return math.sqrt(a * b) if geometric else (a + b) / 2


def _space(knob: _Knob, n: int, a: float | None = None, b: float | None = None) -> list[float]:
    lo, hi = knob.lo if a is None else a, knob.hi if b is None else b
    if n == 1:
        return [_mid(lo, hi, knob.geometric)]
    if knob.geometric:
        return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def _calibrate(knob: _Knob, run: Callable[[float], _Run], target: int, *, best: bool) -> tuple[_Run, bool]:
    """A run with exactly ``target`` saves (counts fall as the knob grows): the least lost work
    in the knob's range that gives it (``best``), or the range's middle."""
    grid = [run(x) for x in _space(knob, 49)]
    hit = next((r for r in grid if r.n == target), None)
    if hit is None:
        for a, b in itertools.pairwise(grid):
            if a.n > target > b.n:
                lo, hi = a, b
                for _ in range(40):
                    m = run(_mid(lo.x, hi.x, knob.geometric))
                    if m.n == target:
                        hit = m
                        break
                    lo, hi = (m, hi) if m.n > target else (lo, m)
            if hit is not None:
                break
    if hit is None:
        return min(grid, key=lambda r: (abs(r.n - target), r.lost)), False
    # The range of knob values around the hit that keep the count, then the pick within it.
    below = [r for r in grid if r.x < hit.x and r.n != target]
    above = [r for r in grid if r.x > hit.x and r.n != target]
    edges = []
    for outside in (below[-1] if below else None, above[0] if above else None):
        if outside is None:
            edges.append(hit.x)
            continue
        inside = hit
        for _ in range(30):
            m = run(_mid(inside.x, outside.x, knob.geometric))
            inside, outside = (m, outside) if m.n == target else (inside, m)
        edges.append(inside.x)
    cands = [hit] + [r for r in (run(x) for x in _space(knob, 25, edges[0], edges[1])) if r.n == target]
    if best:
        return min(cands, key=lambda r: r.lost), True
    cands.sort(key=lambda r: r.x)
    return cands[len(cands) // 2], True
