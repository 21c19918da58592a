"""Replay a signal trace under each trigger policy: what each would have saved, and what it costs.

Pure, except :func:`read_trace`. ``smartckpt simulate`` is a thin wrapper around
:func:`read_trace` and :func:`simulate`.

**Trace.** The CSV files :mod:`smartckpt_cli.tracefile` writes (step, time, loss, curvature,
grad_var, score, decision; an optional ``onset`` column marks divergence onsets by hand), one per
run. The run is the span of the trace, from its first row to its last.

**Replay.** Each policy (fixed interval, the seed's score, smartckpt's adaptive policy), wrapped
in :class:`~smartckpt_cli.trigger.Bounded` with the same ``min_interval``/``max_interval``, sees
every row as a :class:`~smartckpt_cli.trigger.TriggerContext` built as the manager builds it:
``now`` = the row's time, the newest save taken (or the start), the row's signals as the
reading, ``save_cost``/``save_total``/``mtbf`` from the options. Policies are consulted on trace
rows only (the manager consults them every step; with a trace of ``eval_every`` > 1, a fixed or
budget save lands on the next row). A save taken at time t commits at t + ``save_total``; one
save is in flight at a time, so a save due while another is in flight starts when that one
commits (the manager's ``inflight="wait"``) and the wait is counted as overhead. The timeline
itself is not stretched. A save at a row whose loss is not finite is unhealthy, as in the
manager: it is taken (and costs) but restores nothing and does not reset the schedule.

**Calibration** (the same number of checkpoints for every policy). Each policy has one knob
that makes it save more or less often: the fixed interval in seconds, the seed's threshold, and
for the adaptive policy a scale on its interval (MTBF × scale², since Young/Daly's interval grows
with √MTBF; before any save cost is known, its interval is ``max_interval`` / 2, also scaled).
Without ``checkpoints``, the adaptive policy runs as configured and the others are calibrated to
its count; with ``checkpoints`` = N, all three are. A knob's values that give exactly N saves
form a range; a baseline (fixed, seed) gets the value in that range with the *least* expected
lost work, its best case, so an advantage of the adaptive policy is never an unlucky phase of
the baseline's schedule; a calibrated adaptive policy gets the middle of its range. When no value
gives exactly N, the nearest count is used and the result says so.

**Expected lost work.** A failure at time t loses t − s, with s the snapshot time of the newest
healthy checkpoint committed by t (the start of the run before the first). Poisson failures
fall uniformly in time, so the mean loss per failure is the time average of t − s over the run,
integrated exactly over the piecewise-linear timeline; over the whole run, T / MTBF failures are
expected, each losing that mean.

**Divergence events.** Onsets are the ``onset`` column, or steps given explicitly, or detected:
the trace's loss is median-filtered again over ``spike_window`` rows (f); the first row where
f exceeds a robust baseline by ``spike_k`` × MAD starts an event. The baseline is the median of
the last ``spike_baseline`` non-event rows; the MAD (median absolute deviation, unscaled) is
that of the last ``spike_noise`` residuals of non-event rows against the baseline before them,
so a falling loss moves the baseline without inflating the MAD, and a calm stretch of a few
rows cannot shrink it (both failure modes showed on real traces: a MAD of the levels
themselves missed real spikes after a trend and fired on noise after a calm stretch). The event
ends at the first row where f is back at or below that threshold (or at the trace's end).

The rollback is decided at the event's end (``rollback="end"``: someone noticed the spike once it
was over, the most retention can have evicted by then) or at the onset itself (``"onset"``: an
automatic monitor acted at once). Retention is replayed on every commit up to that moment
(``select_prunable`` with ``keep_last`` and the calm flag, so the newest calm checkpoint is
never evicted), and the newest retained healthy checkpoint taken strictly before the onset (by
step) is where the run goes back to. Per onset: its distance to the onset (seconds), and the
work lost by rolling back to it (from its snapshot to the decision). Without any retained
checkpoint before the onset, the run restarts from the beginning (counted as ``missed``,
distances measured from the start).
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from smartckpt_cli.errors import ConfigError
from smartckpt_cli.journal import CheckpointRecord
from smartckpt_cli.retention import select_prunable
from smartckpt_cli.signals import SignalReading
from smartckpt_cli.trigger import (
    AdaptivePolicy,
    Bounded,
    FixedPolicy,
    Policy,
    SeedPolicy,
    TriggerContext,
)

__all__ = [
    "POLICIES",
    "Onset",
    "OnsetResult",
    "PolicyResult",
    "Save",
    "SimConfig",
    "SimResult",
    "Trace",
    "TraceRow",
    "detect_onsets",
    "mean_lost_work",
    "parse_trace",
    "read_trace",
    "replay",
    "retained_before",
    "simulate",
]

REQUIRED = ("step", "time", "loss", "curvature", "grad_var")
POLICIES = ("fixed", "seed", "adaptive")


# ---------------------------------------------------------------- the trace


@dataclass(frozen=True)
class TraceRow:
    step: int
    time: float
    loss: float | None
    curvature: float | None
    grad_var: float | None
    score: float | None = None
    decision: str = ""
    onset: bool = False


@dataclass(frozen=True)
class Trace:
    rows: tuple[TraceRow, ...]
    source: str  # what was read, for the report

    @property
    def start(self) -> float:
        return self.rows[0].time

    @property
    def end(self) -> float:
        return self.rows[-1].time

    @property
    def duration(self) -> float:
        return self.end - self.start


def _float(value: str, what: str) -> float | None:
    value = value.strip()
    if value == "":
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{what}: not a number: {value!r}") from None


def parse_trace(text: str, name: str = "trace") -> list[TraceRow]:
    """Rows of one trace CSV; raises ConfigError naming the file and line of the first problem.
    A last line without its newline is a write torn by a crash (the writer ends every line with
    one) and is dropped."""
    if text and not text.endswith("\n") and "\n" in text:
        text = text[: text.rindex("\n") + 1]
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None:
        raise ConfigError(f"{name} is empty, not a smartckpt trace")
    cols = [h.strip() for h in header]
    missing = [c for c in REQUIRED if c not in cols]
    if missing:
        raise ConfigError(
            f"{name} is not a smartckpt trace: no column {', '.join(missing)} "
            f"(expected {','.join(REQUIRED)},score,decision)"
        )
    at = {c: cols.index(c) for c in cols}
    rows: list[TraceRow] = []
    for lineno, raw in enumerate(reader, start=2):
        if not raw or all(not c.strip() for c in raw):
            continue
        if len(raw) < len(REQUIRED) or len(raw) > len(cols):
            raise ConfigError(f"{name} line {lineno}: {len(raw)} fields, the header has {len(cols)}")
        raw = raw + [""] * (len(cols) - len(raw))
        where = f"{name} line {lineno}"

        def get(col: str, raw: list[str] = raw, where: str = where) -> float | None:
            return _float(raw[at[col]], f"{where}, {col}") if col in at else None

        step, t = get("step"), get("time")
        if step is None or t is None or not math.isfinite(t) or step != int(step):
            raise ConfigError(f"{where}: step and time must be given (an integer and a finite number)")
        if rows and (t < rows[-1].time or int(step) <= rows[-1].step):
            raise ConfigError(f"{where}: steps must increase and times must not go back")
        onset = raw[at["onset"]].strip().lower() in ("1", "true", "yes", "onset") if "onset" in at else False
        rows.append(
            TraceRow(
                int(step),
                t,
                get("loss"),
                get("curvature"),
                get("grad_var"),
                get("score"),
                raw[at["decision"]].strip() if "decision" in at else "",
                onset,
            )
        )
    return rows


def _read_csv(path: Path) -> list[TraceRow]:
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file, not a smartckpt trace") from None
    return parse_trace(text, str(path))


def read_trace(path: str | Path, *, all_runs: bool = False) -> Trace:
    """A trace CSV, or a store directory: the CSVs in ``<dir>/traces/`` (or the directory
    itself when it holds them). By default the newest run (latest first row); with ``all_runs``
    every run, in time order, each shifted to start one median row gap after the previous one
    ends (the time between runs was not training)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist")
    if path.is_file():
        rows = _read_csv(path)
        if len(rows) < 2:
            raise ConfigError(f"{path} has {len(rows)} rows; a trace needs at least 2")
        return Trace(tuple(rows), str(path))
    folder = path / "traces" if (path / "traces").is_dir() else path
    files = sorted(folder.glob("*.csv"))
    if not files:
        raise ConfigError(f"no trace files (*.csv) in {folder}")
    runs = [(rows, f) for f in files if (rows := _read_csv(f))]
    if not runs:
        raise ConfigError(f"the trace files in {folder} have no rows")
    runs.sort(key=lambda r: r[0][0].time)
    if not all_runs:
        rows, f = runs[-1]
        if len(rows) < 2:
            raise ConfigError(f"{f} has {len(rows)} rows; a trace needs at least 2")
        return Trace(tuple(rows), f"{f} (newest of {len(runs)} run(s) in {folder})")
    out: list[TraceRow] = []
    gaps = [b.time - a.time for rows, _ in runs for a, b in itertools.pairwise(rows)]
    gap = statistics.median(gaps) if gaps else 1.0
    for rows, _ in runs:
        shift = 0.0 if not out else out[-1].time + gap - rows[0].time
        # A resumed run replays the steps since its checkpoint: new work, so steps keep rising.
        step0 = 0 if not out or rows[0].step > out[-1].step else out[-1].step - rows[0].step + 1
        for r in rows:
            out.append(replace(r, time=r.time + shift, step=r.step + step0))
    if len(out) < 2:
        raise ConfigError(f"the trace files in {folder} have {len(out)} rows; a trace needs at least 2")
    return Trace(tuple(out), f"{len(runs)} run(s) in {folder}, concatenated in time order")


# ---------------------------------------------------------------- replay


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


# ---------------------------------------------------------------- divergence events


@dataclass(frozen=True)
class Onset:
    index: int  # row of the onset
    step: int
    time: float
    end_index: int  # row where the event ends (the rollback is decided there)
    end_step: int
    end_time: float


def _filtered(rows: Sequence[TraceRow], window: int) -> list[float | None]:
    out: list[float | None] = []
    recent: deque[float] = deque(maxlen=window)
    for r in rows:
        if r.loss is None:
            out.append(None)
            continue
        recent.append(r.loss if math.isfinite(r.loss) else math.inf)  # nan/inf: a divergence
        out.append(statistics.median(recent))
    return out


class _Baseline:
    """The robust baseline of the non-event rows: the level is the median of the last ``level``
    of them; the noise is the MAD of the last ``noise`` residuals (each row minus the level just
    before it), so a trend (a falling loss) moves the level instead of inflating the MAD."""

    def __init__(self, level: int, noise: int) -> None:
        self.recent: deque[float] = deque(maxlen=level)
        self.resid: deque[float] = deque(maxlen=noise)

    def threshold(self, k: float, min_resid: int) -> float:
        if len(self.recent) < 5 or len(self.resid) < min_resid:
            return math.inf
        level = statistics.median(self.recent)
        center = statistics.median(self.resid)
        mad = statistics.median(abs(r - center) for r in self.resid)
        return level + k * max(mad, 1e-9 * max(abs(level), 1e-12))

    def add(self, f: float) -> None:
        if len(self.recent) >= 5:
            self.resid.append(f - statistics.median(self.recent))
        self.recent.append(f)


def detect_onsets(
    rows: Sequence[TraceRow],
    *,
    k: float = 6.0,
    window: int = 3,
    baseline: int = 20,
    noise: int = 200,
    given: Sequence[int] | None = None,
) -> list[Onset]:
    """Divergence events: detected (see module docstring) or, with ``given`` steps or an
    ``onset`` column, those onsets with their ends found the same way."""
    f = _filtered(rows, window)
    forced: set[int] | None = None
    if given is not None:
        forced = {next((i for i, r in enumerate(rows) if r.step >= s), -1) for s in given} - {-1}
    elif any(r.onset for r in rows):
        forced = {i for i, r in enumerate(rows) if r.onset}
    base = _Baseline(baseline, noise)
    min_resid = min(noise, 30)
    out: list[Onset] = []
    open_at: int | None = None
    thr = math.inf
    for i, fi in enumerate(f):
        is_forced = forced is not None and i in forced
        if open_at is not None:
            if is_forced or (fi is not None and fi <= thr):
                out.append(_onset(rows, open_at, i))
                open_at = None
            if not is_forced:
                continue  # rows of an event never enter the baseline
        thr_i = base.threshold(k, min_resid)
        if is_forced or (forced is None and fi is not None and fi > thr_i):
            if fi is None or fi <= thr_i:  # a given onset the loss does not show: ends at once
                out.append(_onset(rows, i, i))
            else:
                open_at, thr = i, thr_i
            continue
        if fi is not None and math.isfinite(fi):
            base.add(fi)
    if open_at is not None:
        out.append(_onset(rows, open_at, len(rows) - 1))
    return out


def _onset(rows: Sequence[TraceRow], i: int, end: int) -> Onset:
    return Onset(i, rows[i].step, rows[i].time, end, rows[end].step, rows[end].time)


def retained_before(saves: Sequence[Save], onset: Onset, keep_last: int) -> Save | None:
    """The newest checkpoint taken strictly before ``onset`` (by step) that retention still
    holds when the rollback is decided (at the event's end)."""
    records: list[CheckpointRecord] = []
    by_id: dict[str, Save] = {}
    for n, s in enumerate(sorted((s for s in saves if s.commit <= onset.end_time), key=lambda s: s.commit)):
        rec = CheckpointRecord(
            s.step, str(n), "", "", n, health="ok" if s.healthy else "nonfinite-loss", calm=s.calm
        )
        records.append(rec)
        by_id[rec.id] = s
        for doomed in select_prunable(records, keep_last):  # as the writer does after each commit
            doomed.pruned = True
    held = [by_id[r.id] for r in records if r.live and r.health == "ok" and r.step < onset.step]
    return max(held, key=lambda s: s.step) if held else None


# ---------------------------------------------------------------- per policy


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


# ---------------------------------------------------------------- the simulation


def simulate(trace: Trace, cfg: SimConfig | None = None) -> SimResult:
    """Replay ``trace`` under every policy, calibrated to the same number of checkpoints."""
    cfg = cfg or SimConfig()
    cfg.check()
    rows = trace.rows
    if len(rows) < 2 or trace.duration <= 0:
        raise ConfigError(f"{trace.source}: a trace needs at least 2 rows spanning some time")
    start, end, duration = trace.start, trace.end, trace.duration
    knobs = _knobs(cfg, duration)

    def runner(name: str) -> Callable[[float], _Run]:
        def run(x: float) -> _Run:
            policy, mtbf = knobs[name].build(x)
            saves, stall = replay(rows, policy, cfg, mtbf=mtbf)
            return _Run(x, saves, stall, mean_lost_work(saves, start, end))

        return run

    chosen: dict[str, tuple[_Run, bool, bool]] = {}  # name -> (run, calibrated, exact count)
    if cfg.checkpoints is None:
        ref = runner("adaptive")(knobs["adaptive"].default)
        chosen["adaptive"] = (ref, False, True)
        target = ref.n
        method = (
            f"adaptive as configured took {target} checkpoints; fixed and seed calibrated to "
            "that count (each at its least-lost-work setting giving it)"
        )
    else:
        target = cfg.checkpoints
        method = (
            f"every policy calibrated to {target} checkpoints (fixed and seed at their "
            "least-lost-work setting giving it, adaptive at the middle of its range)"
        )
    for name in POLICIES:
        if name in chosen:
            continue
        run, exact = _calibrate(knobs[name], runner(name), target, best=name != "adaptive")
        chosen[name] = (run, True, exact)

    onsets = detect_onsets(
        rows,
        k=cfg.spike_k,
        window=cfg.spike_window,
        baseline=cfg.spike_baseline,
        noise=cfg.spike_noise,
        given=cfg.onsets,
    )
    results = []
    for name in POLICIES:
        run, calibrated, exact = chosen[name]
        per = []
        for o in onsets:
            if cfg.rollback == "onset":
                o = replace(o, end_index=o.index, end_step=o.step, end_time=o.time)
            ck = retained_before(run.saves, o, cfg.keep_last)
            t = ck.time if ck is not None else start
            per.append(OnsetResult(o.step, ck.step if ck else None, o.time - t, o.end_time - t))
        results.append(
            PolicyResult(
                name,
                knobs[name].label(run.x),
                calibrated,
                exact,
                run.n,
                (run.n * cfg.save_cost + run.stall) / duration,
                run.lost,
                run.lost * duration / cfg.mtbf,
                tuple(per),
                tuple(run.saves),
            )
        )
    return SimResult(trace.source, len(rows), duration, cfg, target, method, tuple(onsets), tuple(results))
