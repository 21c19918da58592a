"""The trace a simulation replays: CSV rows of step, time and signals, one run per file."""

from __future__ import annotations

import csv
import io
import itertools
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from smartckpt_cli.errors import ConfigError

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
    update: float | None = None  # planned update norm (newer traces; None in older ones)
    memory: float | None = None  # fraction of the memory ceiling in use (newer traces still)


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
            f"(expected {','.join(REQUIRED)},update,memory,score,decision)"
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
                get("update"),
                get("memory"),
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
