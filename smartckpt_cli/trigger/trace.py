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
the last save, never the file's earlier content. A write that fails (a full disk, a read-only
mount) never raises into the training loop: the lines stay buffered (the newest
:data:`MAX_BUFFERED`), the failure is reported once through ``on_error`` and the recovery once
through ``on_recovered``, and the next flush writes what was kept.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from smartckpt_cli.trigger.reading import SignalReading

__all__ = ["COLUMNS", "MAX_BUFFERED", "TraceWriter"]

logger = logging.getLogger(__name__)

MAX_BUFFERED = 100_000  # lines kept while the trace cannot be written (a few MB)

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
    def __init__(
        self,
        meta_root: Path,
        *,
        on_error: Callable[[OSError], None] | None = None,
        on_recovered: Callable[[], None] | None = None,
    ) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.path = meta_root / "traces" / f"{stamp}-{os.getpid()}.csv"
        self._lines: list[str] = []
        self._on_error, self._on_recovered = on_error, on_recovered
        self.failing: OSError | None = None  # the error of the last flush, while it lasts
        self.dropped = 0  # lines dropped because the buffer was full while failing

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
        """Append the buffered lines; never raises (module docstring)."""
        if not self._lines:
            return
        try:
            self._write()
        except OSError as err:
            if len(self._lines) > MAX_BUFFERED:
                self.dropped += len(self._lines) - MAX_BUFFERED
                del self._lines[:-MAX_BUFFERED]
            if self.failing is None:
                self.failing = err
                logger.warning("trace %s not written (%s); training goes on, kept in memory", self.path, err)
                if self._on_error is not None:
                    self._on_error(err)
            return
        self._lines.clear()
        if self.failing is not None:
            self.failing = None
            logger.warning("trace %s written again", self.path)
            if self._on_recovered is not None:
                self._on_recovered()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.fstat(fd).st_size
            head = ",".join(COLUMNS) + "\n" if start == 0 else ""
            view = memoryview((head + "\n".join(self._lines) + "\n").encode())
            try:
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:
                # A partial append (the disk filled mid-write) is cut off: the next flush writes
                # these lines again, and the file never holds half a line.
                os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)
