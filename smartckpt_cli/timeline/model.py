"""What a run's timeline holds: plain dataclasses, and their JSON form (``smartckpt plot --json``).

Times are seconds since ``t0`` (a UTC epoch time, given once), so the JSON stays readable and
precise; every point of a series carries both its step and its time, whichever axis the figure
used. A ``null`` in a series separates two trace files (processes): a line is not drawn across
a restart. The schema is versioned (``format``/``version``) like the journal and the manifests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointMark",
    "FailedSave",
    "Mark",
    "RestartMark",
    "Segment",
    "Series",
    "Timeline",
]

FORMAT = "smartckpt-timeline"
VERSION = 1


@dataclass(frozen=True)
class Segment:
    """One trace file drawn: one process (an attempt) of the run."""

    path: str
    first_step: int
    last_step: int
    start: float  # seconds since t0
    end: float
    rows: int
    ranks: int = 1  # trace files written over the same time (other ranks); this one is drawn


@dataclass
class Series:
    """One signal, decimated for drawing: parallel arrays, NaN between segments."""

    name: str
    label: str
    step: np.ndarray
    time: np.ndarray  # seconds since t0
    value: np.ndarray
    rows: int  # trace rows behind it before decimation
    log: bool = False  # drawn on a log scale

    def x(self, axis: str) -> np.ndarray:
        return self.time if axis == "time" else self.step


@dataclass(frozen=True)
class Mark:
    """A point event placed on both axes (a non-finite loss)."""

    step: int
    time: float


@dataclass(frozen=True)
class CheckpointMark:
    step: int
    id: str
    position: int  # journal position: the order of commits
    time: float | None  # when it was taken, seconds since t0 (None: no trace or manifest tells)
    time_source: str  # trace | manifest | order (between its neighbours in the journal) | none
    reason: str  # as the trigger wrote it
    category: str  # scheduled | budget | precursor | signal | preemption | final | manual
    health: str  # ok, or why it is unhealthy
    calm: bool
    state: str  # live | pruned | rolled back
    score: float | None
    remote: str | None = None  # uploaded | pending | None (unknown, or no remote)

    @property
    def healthy(self) -> bool:
        return self.health == "ok"


@dataclass(frozen=True)
class FailedSave:
    step: int
    time: float | None
    error: str


@dataclass(frozen=True)
class RestartMark:
    """An attempt of ``smartckpt run`` that ended in a failure (or a preemption)."""

    run_id: str
    attempt: int
    category: str  # the run record's: signal, oom, hang, gpu, failed, preempted, ...
    cause: str  # the run record's sentence
    label: str  # short: SIGKILL, OOM, hang, preemption, ...
    time: float | None  # when the attempt ended, seconds since t0
    step: int | None  # the highest step it reached
    restart_from: int | None
    steps_lost: int | None
    seconds_lost: float | None
    lost_time: tuple[float, float] | None  # the work it lost, on the time axis
    lost_steps: tuple[int, int] | None  # ... and on the step axis
    restarted: bool  # another attempt followed


@dataclass
class Timeline:
    store: str
    t0: float  # UTC epoch seconds of time 0
    axis: str  # time | step: what the figure's x axis is
    segments: list[Segment]
    series: dict[str, Series]
    checkpoints: list[CheckpointMark]
    restarts: list[RestartMark]
    failed_saves: list[FailedSave] = field(default_factory=list)
    nonfinite: list[Mark] = field(default_factory=list)  # rows whose loss was written nan/inf
    max_interval: float = 180.0
    policy: str = "adaptive"  # the policy whose score lines are drawn: the checkpoints', else the settings'
    # How the title names it: "fixed: every 10 steps" as the checkpoints' reasons show it, or
    # "adaptive (the settings; no checkpoint shows a policy)".
    policy_text: str = ""
    thresholds: dict[str, float] = field(default_factory=dict)  # score lines: name -> value
    run: dict[str, Any] | None = None  # the run record shown (--run), summarised
    steps: tuple[int | None, int | None] | None = None  # --steps
    remote: dict[str, Any] | None = None  # the uploader's last status, when there is a remote
    bins: int = 0  # pixel columns the series were decimated to (0: every row)
    trace_rows: int = 0  # rows read from the trace files drawn
    skipped_rows: int = 0  # damaged trace lines left out

    def x_range(self) -> tuple[float, float]:
        """The span of everything drawn on the figure's axis."""
        xs: list[float] = []
        for s in self.series.values():
            v = s.x(self.axis)
            v = v[np.isfinite(v)]
            if len(v):
                xs += [float(v.min()), float(v.max())]
        for c in self.checkpoints:
            x = c.time if self.axis == "time" else c.step
            if x is not None:
                xs.append(float(x))
        for r in self.restarts:
            span = r.lost_time if self.axis == "time" else r.lost_steps
            xs += [float(v) for v in span or ()]
            x = r.time if self.axis == "time" else r.step
            if x is not None:
                xs.append(float(x))
        return (min(xs), max(xs)) if xs else (0.0, 1.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "store": self.store,
            "t0": self.t0,
            "axis": self.axis,
            "run": self.run,
            "steps": list(self.steps) if self.steps else None,
            "policy": self.policy,
            "policy_text": self.policy_text or self.policy,
            "thresholds": self.thresholds,
            "max_interval": self.max_interval,
            "bins": self.bins,
            "trace_rows": self.trace_rows,
            "skipped_rows": self.skipped_rows,
            "segments": [{**vars(s), "start": _t(s.start), "end": _t(s.end)} for s in self.segments],
            "series": {
                name: {
                    "label": s.label,
                    "log": s.log,
                    "rows": s.rows,
                    "step": _floats(s.step, "int"),
                    "time": _floats(s.time, "time"),
                    "value": _floats(s.value, "value"),
                }
                for name, s in self.series.items()
            },
            "checkpoints": [{**vars(c), "time": _t(c.time)} for c in self.checkpoints],
            "restarts": [
                {
                    **vars(r),
                    "time": _t(r.time),
                    "lost_time": [_t(v) for v in r.lost_time] if r.lost_time else None,
                    "lost_steps": list(r.lost_steps) if r.lost_steps else None,
                }
                for r in self.restarts
            ],
            "failed_saves": [{**vars(f), "time": _t(f.time)} for f in self.failed_saves],
            "nonfinite_loss": [{**vars(m), "time": _t(m.time)} for m in self.nonfinite],
            "remote": self.remote,
        }


def _t(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def _floats(a: np.ndarray, kind: str) -> list[float | int | None]:
    # JSON has no NaN: null is the break between segments (and a missing value). Times to the
    # microsecond; values as they are (a gradient variance of 1e-12 must not round to 0).
    if kind == "int":
        return [int(v) if math.isfinite(v) else None for v in a.tolist()]
    if kind == "time":
        return [round(v, 6) if math.isfinite(v) else None for v in a.tolist()]
    return [v if math.isfinite(v) else None for v in a.tolist()]
