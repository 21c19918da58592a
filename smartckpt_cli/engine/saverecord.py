"""What the background saves did, and the journal events that wait for a disk: the two things
the save thread and the training thread both touch, each an object that locks itself (the
manager holds no bare field another thread writes; ARCHITECTURE.md, "Which thread owns what")."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from smartckpt_cli.engine.writer import CommitInfo

__all__ = ["EventBacklog", "SaveRecord"]

logger = logging.getLogger(__name__)


class SaveRecord:
    """Commits, failures (with how often each cause came), skipped steps and the newest commit.
    Written by the save thread (commits, failures) and the training thread (skipped steps), read
    by either through methods that copy under the one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: list[str] = []
        self._skipped: list[int] = []
        self._causes: dict[str, int] = {}
        self._commits = 0
        self._last: CommitInfo | None = None

    def committed(self, info: CommitInfo) -> None:
        with self._lock:
            self._commits += 1
            self._last = info

    def newest(self, info: CommitInfo) -> None:
        """``info`` is the newest commit (before the rest of its bookkeeping is done)."""
        with self._lock:
            self._last = info

    def failed(self, msg: str, cause: str) -> tuple[int, int]:
        """Record a failure; returns (how often this cause came before, failures in all)."""
        with self._lock:
            self._failures.append(msg)
            seen = self._causes.get(cause, 0)
            self._causes[cause] = seen + 1
            return seen, len(self._failures)

    def skip(self, step: int) -> None:
        with self._lock:
            self._skipped.append(step)

    @property
    def last_commit(self) -> CommitInfo | None:
        with self._lock:
            return self._last

    @property
    def commits(self) -> int:
        with self._lock:
            return self._commits

    def failures(self) -> list[str]:
        with self._lock:
            return list(self._failures)

    def skipped(self) -> list[int]:
        with self._lock:
            return list(self._skipped)

    def failure_count(self) -> tuple[int, str | None]:
        """(failures so far, the newest one's message)."""
        with self._lock:
            return len(self._failures), self._failures[-1] if self._failures else None


class _Journal(Protocol):
    def append(self, event: dict[str, Any]) -> Any: ...


class EventBacklog:
    """Journal events (a failure, an I/O problem) that wait for the journal, which may be on the
    very disk that is full: kept (the newest 100) until it takes them, never raising. The loop
    and the save thread may both add and flush; one flushes at a time, and whoever flushes
    writes what is pending (the other's event included, or the next call does), so no line is
    written twice."""

    KEEP = 100

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the list
        self._flush = threading.Lock()  # one writer at a time
        self._events: list[dict[str, Any]] = []

    def add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append({**event, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            del self._events[: -self.KEEP]

    def flush(self, journal: _Journal) -> None:
        """Append what waits, in order, until the journal refuses one (the rest wait)."""
        if not self._flush.acquire(blocking=False):
            return  # the other thread is writing: it (or the next call) writes ours too
        try:
            with self._lock:
                todo = list(self._events)
            done = 0
            try:
                for ev in todo:
                    journal.append(ev)
                    done += 1
            except Exception as err:  # logged where the failure itself was reported
                logger.debug("%d event(s) wait for the journal: %s", len(todo) - done, err)
            with self._lock:
                written = {id(ev) for ev in todo[:done]}
                self._events = [ev for ev in self._events if id(ev) not in written]
        finally:
            self._flush.release()

    def pending(self) -> int:
        with self._lock:
            return len(self._events)
