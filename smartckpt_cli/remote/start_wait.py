"""A start with nothing to resume locally while the remote tier is unreachable.

The remote may hold the whole run (a node that came back with a wiped disk, a replaced node). If
this start minted a new store while the remote could not be asked, training would start over at
step 0, the uploader would then find the remote holding "another store" and stop, and every later
start would do the same: the run's checkpoints orphaned on the remote, with only WARNING lines to
show for it. So :func:`wait_for_remote` asks the remote again with backoff (1 s doubling to 30 s)
for ``remote_start_wait`` seconds, saying so in the log and through the heartbeat (``smartckpt
run``'s status line shows "waiting for the remote"); then it refuses the start with one line
naming the remote and how to start fresh deliberately (``remote_start_fresh``), which
``smartckpt run`` turns into its exit code 5. ``remote_start_fresh`` starts a new store at once.

The decision of what to do at each moment is :func:`next_move` (pure); this module's one loop
carries it out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from smartckpt_cli.errors import RemoteStartRefused

__all__ = ["next_move", "wait_for_remote"]

logger = logging.getLogger(__name__)

FIRST_PAUSE = 1.0
MAX_PAUSE = 30.0
SAY_EVERY = 30.0  # seconds between the log lines of a long wait


def next_move(waited: float, limit: float, failures: int, fresh: bool) -> tuple[str, float]:
    """Pure: after ``failures`` failed tries over ``waited`` seconds, ("retry", pause), ("fresh",
    0) or ("refuse", 0)."""
    if fresh:
        return "fresh", 0.0
    if waited >= limit:
        return "refuse", 0.0
    pause = min(MAX_PAUSE, FIRST_PAUSE * 2 ** max(0, failures - 1))
    return "retry", min(pause, max(0.0, limit - waited))


def wait_for_remote(
    read: Callable[[], Any], url: str, settings: Any, pause: Callable[[float], None] = time.sleep
) -> str | None:
    """The remote's store id (None: the remote is reachable and empty, or a deliberate fresh
    start), once ``read()`` (the remote journal's) answers; raises RemoteStartRefused when it
    has not for ``settings.remote_start_wait`` seconds. ``pause(seconds)``: how to wait (the
    manager's beats the heartbeat as WAITING meanwhile)."""
    start = time.monotonic()
    failures, said = 0, -SAY_EVERY
    while True:
        try:
            store_id = read().store_id
        except Exception as err:  # down, refusing, timing out: asked again below
            failures += 1
            last = type(err).__name__
        else:
            if failures:
                logger.warning(
                    "remote %s answers again after %.0f s; resuming from it", url, time.monotonic() - start
                )
            return store_id if isinstance(store_id, str) else None
        waited = time.monotonic() - start
        move, delay = next_move(waited, settings.remote_start_wait, failures, settings.remote_start_fresh)
        if move == "fresh":
            logger.warning(
                "remote %s unreachable (%s) and nothing to resume locally: starting a new store at "
                "step 0 as asked (remote_start_fresh); the remote's checkpoints, if any, are not used",
                url,
                last,
            )
            return None
        if move == "refuse":
            raise RemoteStartRefused(
                f"remote {url} unreachable for {waited:.0f} s ({last}) and nothing to resume locally: "
                "not starting over at step 0; run again once it answers, or start a new store "
                "deliberately with --remote-start-fresh (remote_start_fresh: true)"
            )
        if waited - said >= SAY_EVERY or failures == 1:
            said = waited
            logger.warning(
                "remote %s unreachable (%s) and nothing to resume locally: waiting for it "
                "(%.0f s of remote_start_wait %.0f s)",
                url,
                last,
                waited,
                settings.remote_start_wait,
            )
        pause(delay)
