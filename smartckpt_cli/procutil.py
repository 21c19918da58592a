"""Process helpers shared by the save pipeline and the remote tier's uploader."""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["lower_priority"]


def lower_priority(nice: int) -> None:
    """Run the calling (background) thread at a lower CPU priority, so that encoding uses the
    cycles training leaves idle instead of preempting it. On a CPU-only machine this matters
    twice: a preempted thread of torch's OpenMP team stalls the whole team at its next barrier.
    Linux applies setpriority to a thread id; elsewhere this is a no-op."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        pass
