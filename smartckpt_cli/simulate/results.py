"""What a simulation reports, per onset and per policy, and its JSON form."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from smartckpt_cli.simulate.onsets import Onset
from smartckpt_cli.simulate.replay import Save, SimConfig


@dataclass(frozen=True)
class OnsetResult:
    step: int
    checkpoint_step: int | None  # None: nothing retained before the onset (restart)
    distance: float  # seconds from the checkpoint (or the start) to the onset
    rollback_lost: float  # seconds of work lost by rolling back at the event's end


@dataclass(frozen=True)
class PolicyResult:
    name: str
    knob: str  # the setting used, after calibration
    calibrated: bool
    exact_count: bool  # False: calibration could not hit the target count
    checkpoints: int
    overhead: float  # (saves × save_cost + waits for a save in flight) / run time
    mean_lost: float  # seconds lost by one failure at a uniformly random time
    expected_lost: float  # seconds lost over the run: duration / MTBF failures
    onsets: tuple[OnsetResult, ...]
    saves: tuple[Save, ...] = field(repr=False)

    @property
    def missed(self) -> int:
        return sum(o.checkpoint_step is None for o in self.onsets)

    @property
    def mean_distance(self) -> float | None:
        return statistics.fmean(o.distance for o in self.onsets) if self.onsets else None

    @property
    def max_distance(self) -> float | None:
        return max(o.distance for o in self.onsets) if self.onsets else None

    @property
    def mean_rollback_lost(self) -> float | None:
        return statistics.fmean(o.rollback_lost for o in self.onsets) if self.onsets else None


@dataclass(frozen=True)
class SimResult:
    source: str
    rows: int
    duration: float
    config: SimConfig
    target: int  # the number of checkpoints every policy was calibrated to
    method: str
    onsets: tuple[Onset, ...]
    policies: tuple[PolicyResult, ...]

    def policy(self, name: str) -> PolicyResult:
        return next(p for p in self.policies if p.name == name)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "source": self.source,
            "rows": self.rows,
            "duration_s": self.duration,
            "config": asdict(self.config),
            "target_checkpoints": self.target,
            "calibration": self.method,
            "onsets": [{"step": o.step, "end_step": o.end_step} for o in self.onsets],
            "policies": {},
        }
        for p in self.policies:
            out["policies"][p.name] = {
                "knob": p.knob,
                "calibrated": p.calibrated,
                "exact_count": p.exact_count,
                "checkpoints": p.checkpoints,
                "overhead": p.overhead,
                "mean_lost_per_failure_s": p.mean_lost,
                "expected_lost_s": p.expected_lost,
                "onset_mean_distance_s": p.mean_distance,
                "onset_max_distance_s": p.max_distance,
                "onset_mean_rollback_lost_s": p.mean_rollback_lost,
                "onsets_missed": p.missed,
                "onsets": [asdict(o) for o in p.onsets],
                "save_steps": [s.step for s in p.saves],
            }
        return out
