"""A trace CSV read column by column into numpy arrays, by column name.

``smartckpt simulate`` parses a trace row by row into dataclasses, strictly: a bad value is an
error naming its line, which is right for a replay whose every row matters. A plot reads a week
of traces (millions of rows) and must draw in seconds, and must keep working while the trace
format grows columns (``update``, then ``memory``, more later): so here

- columns are found by name in each file's own header; unknown columns are ignored, missing
  ones are simply absent (the plot leaves their panel out);
- every column but ``decision`` is numeric; numeric columns are parsed in one call to numpy's
  C reader (empty fields become NaN first, by a plain text substitution), about 1 µs a row;
- ``decision`` (the reason of the save a row triggered) is kept only where it is non-empty;
- a last line without its newline is a write torn by a crash and is dropped, as in simulate;
- a file whose numbers the fast reader cannot take (damage in the middle) is read again line by
  line, slowly, with unreadable fields as NaN and lines of the wrong width skipped, and the
  number of lines skipped is reported: a damaged trace still plots.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from smartckpt_cli.errors import ConfigError

__all__ = ["TEXT_COLUMNS", "TraceTable", "parse_table", "read_table"]

logger = logging.getLogger(__name__)

TEXT_COLUMNS = frozenset({"decision"})
REQUIRED = ("step", "time")
# What an empty field is read as, so that it stays apart from a written "nan" (a loss that was
# NaN is a divergence to mark; an empty one is a row without a loss). No trace writes it: the
# writer prints 6 significant digits, and a loss of 1.2345678e308 is not a training.
_EMPTY = 1.2345678e308
_EMPTY_TEXT = "1.2345678e308"


@dataclass
class TraceTable:
    """One trace file (one process, one attempt): numeric columns by name, rows in file order."""

    path: str
    columns: dict[str, np.ndarray]  # float64, NaN where a field was empty or unreadable
    decisions: dict[int, str] = field(default_factory=dict)  # row index -> non-empty decision
    nonfinite: dict[str, np.ndarray] = field(default_factory=dict)  # column -> rows written nan/inf
    skipped: int = 0  # damaged lines left out

    @property
    def rows(self) -> int:
        return len(self.columns["step"])

    def get(self, name: str) -> np.ndarray | None:
        return self.columns.get(name)


def _fast(body: bytes, names: list[str], numeric: list[int]) -> np.ndarray:
    # A marker for empty fields, then numpy's C reader. Each substitution is a pass over the
    # text, so only those needed: an empty field first or last on a line matters only when that
    # column is numeric (the trailing empty ``decision`` of most rows is never converted), and
    # runs of empty fields need two passes (",,,").
    text = body
    empty = _EMPTY_TEXT.encode()
    if numeric[0] == 0 and (text.startswith(b",") or b"\n," in text):
        text = (b"\n" + text).replace(b"\n,", b"\n" + empty + b",")[1:]
    if b",," in text:
        text = text.replace(b",,", b"," + empty + b",").replace(b",,", b"," + empty + b",")
    if numeric[-1] == len(names) - 1 and b",\n" in text:
        text = text.replace(b",\n", b"," + empty + b"\n")
    return np.loadtxt(
        io.BytesIO(text),
        delimiter=",",
        usecols=numeric,
        dtype=np.float64,
        ndmin=2,
        comments=None,
        encoding="latin-1",  # numbers are ASCII; a decision's other bytes are never converted
    )


def _slow(lines: list[str], width: int, numeric: list[int]) -> tuple[np.ndarray, list[int], int]:
    out = np.full((len(lines), len(numeric)), _EMPTY)
    kept: list[int] = []
    skipped = 0
    for i, line in enumerate(lines):
        parts = line.split(",")
        if len(parts) != width:
            skipped += 1
            continue
        for j, c in enumerate(numeric):
            try:
                if parts[c].strip():
                    out[len(kept), j] = float(parts[c])
            except ValueError:
                out[len(kept), j] = math.nan  # unreadable: damage, not a written nan
        kept.append(i)
    return out[: len(kept)], kept, skipped


def _decisions_last(body: bytes) -> dict[int, str]:
    """Non-empty values of a last column, by line: found on the bytes (a line not ending in a
    comma), so that 2 million lines are not split one by one for a few hundred decisions."""
    b = np.frombuffer(body, dtype=np.uint8)
    ends = np.flatnonzero(b == 10)
    if len(ends) == 0:
        return {}
    before = b[np.maximum(ends - 1, 0)]
    out: dict[int, str] = {}
    for i in np.flatnonzero(before != ord(",")).tolist():
        begin = int(ends[i - 1]) + 1 if i > 0 else 0
        line = body[begin : int(ends[i])].decode(errors="replace")
        value = line[line.rfind(",") + 1 :].strip()
        if value:
            out[i] = value
    return out


def _body(
    body: bytes, names: list[str], numeric: list[int], name: str
) -> tuple[np.ndarray, dict[int, str], list[int] | None, int]:
    """(the numeric columns, the non-empty decisions by line, the lines behind the rows when
    some were skipped, how many were): the fast reader, else line by line (module docstring)."""
    skipped = 0
    table = np.empty((0, len(numeric)))
    decisions: dict[int, str] = {}  # by line, until parse_table renumbers them
    at = names.index("decision") if "decision" in names else None
    kept: list[int] | None = None  # lines behind the rows, when some were skipped
    if body.strip():
        try:
            table = _fast(body, names, numeric)
            if table.shape[0] != body.count(b"\n"):
                raise ValueError("blank or short lines")
            if at is not None and at == len(names) - 1:
                decisions = _decisions_last(body)
            elif at is not None:
                for i, line in enumerate(body.decode(errors="replace").split("\n")):
                    if line.strip() and line.split(",")[at].strip():
                        decisions[i] = line.split(",")[at].strip()
        except ValueError:
            lines = body.decode(errors="replace").split("\n")[:-1]
            table, kept, skipped = _slow(lines, len(names), numeric)
            if skipped:
                logger.warning("%s: %d damaged line(s) skipped", name, skipped)
            if at is not None:
                decisions = {i: lines[i].split(",")[at].strip() for i in kept}
                decisions = {i: d for i, d in decisions.items() if d}
    return table, decisions, kept, skipped


def parse_table(data: bytes | str, name: str = "trace") -> TraceTable:
    """A trace CSV as columns. Raises ConfigError when it is not a trace at all (no ``step``
    and ``time`` columns); damage inside a trace is skipped, not fatal."""
    text = data.encode() if isinstance(data, str) else data
    if text and not text.endswith(b"\n") and b"\n" in text:
        text = text[: text.rindex(b"\n") + 1]  # torn last line
    head_b, _, body = text.partition(b"\n")
    try:
        head = head_b.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{name} is not a text file, not a smartckpt trace") from None
    names = [h.strip() for h in head.split(",")]
    missing = [c for c in REQUIRED if c not in names]
    if missing or not head.strip():
        raise ConfigError(f"{name} is not a smartckpt trace: no column {', '.join(missing or REQUIRED)}")
    numeric = [i for i, n in enumerate(names) if n not in TEXT_COLUMNS and n]
    table, decisions, kept, skipped = _body(body, names, numeric, name)
    columns: dict[str, np.ndarray] = {}
    nonfinite: dict[str, np.ndarray] = {}
    for j, c in enumerate(numeric):
        col = table[:, j]
        bad = ~np.isfinite(col)
        if bad.any():
            nonfinite[names[c]] = bad
        columns[names[c]] = np.where(col == _EMPTY, np.nan, col)
    # Rows without a step or a time cannot be placed on either axis.
    ok = np.isfinite(columns["step"]) & np.isfinite(columns["time"])
    row_of_line = {n: k for k, n in enumerate(kept)} if kept is not None else None
    renumber = np.cumsum(ok) - 1
    rows: dict[int, str] = {}
    for n, d in decisions.items():
        k = row_of_line.get(n) if row_of_line is not None else n
        if k is not None and ok[k]:
            rows[int(renumber[k])] = d
    if not ok.all():
        skipped += int((~ok).sum())
        columns = {c: v[ok] for c, v in columns.items()}
        nonfinite = {c: v[ok] for c, v in nonfinite.items()}
    written = {c: np.flatnonzero(v) for c, v in nonfinite.items() if v.any()}
    return TraceTable(name, columns, rows, written, skipped)


def read_table(path: str | Path) -> TraceTable:
    path = Path(path)
    return parse_table(path.read_bytes(), str(path))
