"""The signal trace of a run: one CSV line per evaluation, in ``<meta_dir>/traces/``.

Columns: step, time (UTC seconds), loss (median-filtered), curvature, grad_var, update (the norm
of the optimizer update planned at that step, planned.py), memory (the fraction in use of the
tightest memory ceiling, memory.py; empty where none is known), score, decision (empty, or the
reason of the save it triggered; a save "precursor: ..." holds the state of the step before),
raw_loss (the newest loss of the evaluation's window, unfiltered: what ``smartckpt plot`` draws
thin under the filtered one; last, so that readers by position keep working).
``smartckpt simulate`` replays these files (older ones, without ``update``, ``memory`` or
``raw_loss``, too).
Lines are buffered and appended at each save and at close: a crash loses at most the lines since
the last save, never the file's earlier content.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from smartckpt_cli.trigger.reading import SignalReading

__all__ = ["COLUMNS", "TraceWriter"]

COLUMNS = (
    "step",
    "time",
    "loss",
    "curvature",
    "grad_var",
    "update",
    "memory",
    "score",
    "decision",
    "raw_loss",
)


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.6g}"


class TraceWriter:
    def __init__(self, meta_root: Path) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.path = meta_root / "traces" / f"{stamp}-{os.getpid()}.csv"
        self._lines: list[str] = []

    def add(self, reading: SignalReading, score: float | None, decision: str) -> None:
        self._lines.append(
            ",".join(
                [
                    str(reading.step),
                    f"{time.time():.3f}",
                    _num(reading.loss),
                    _num(reading.curvature),
                    _num(reading.grad_var),
                    _num(reading.update),
                    _num(reading.memory),
                    _num(score),
                    decision.replace(",", ";"),
                    _num(reading.raw_loss),
                ]
            )
        )

    def flush(self) -> None:
        if not self._lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        with open(self.path, "a") as f:
            if new:
                f.write(",".join(COLUMNS) + "\n")
            f.write("\n".join(self._lines) + "\n")
        self._lines.clear()
