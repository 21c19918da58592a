"""A shared bandwidth cap for writes to a backend (``remote_bandwidth_mb``)."""

from __future__ import annotations

import threading
import time

__all__ = ["NO_LIMIT", "Limiter"]


class Limiter:
    """A shared bandwidth cap (bytes per second; 0 = unlimited) for every writing thread."""

    def __init__(self, bytes_per_second: float) -> None:
        self.rate = bytes_per_second
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        if self.rate <= 0 or n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
            delay = self._next - now
        if delay > 0:
            time.sleep(delay)


NO_LIMIT = Limiter(0)
