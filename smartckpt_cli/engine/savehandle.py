"""A save as the caller holds it (:class:`SaveHandle`), and how a failure is told apart: another rank gone (:func:`peer_gone`) or
the same cause again (:func:`failure_cause`)."""

from __future__ import annotations

import re
from concurrent.futures import Future
from typing import Any

from smartckpt_cli.engine.writer import CommitInfo

__all__ = ["SaveHandle", "failure_cause", "peer_gone"]


class SaveHandle:
    """A save in progress. ``wait()`` returns its :class:`CommitInfo` (None when it failed or
    was skipped); ``error`` holds the failure."""

    def __init__(self, step: int, future: Future[CommitInfo] | None, snapshot: Any = None) -> None:
        self.step = step
        self._future = future
        self._snapshot = snapshot
        self.blocking_seconds = 0.0  # time save() itself blocked the caller (the eager copies)
        self.lazy = bool(snapshot is not None and snapshot.guards)

    @property
    def copied(self) -> tuple[str, ...]:
        """The state entries this save copied; the others it referenced, unchanged since the
        last committed checkpoint (engine/unchanged.py)."""
        snap = self._snapshot
        return tuple(i.plan.key for i in snap.staged) if snap is not None else ()

    @property
    def bytes_copied(self) -> int:
        """Bytes of state this save copied (and hashed); the rest it referenced."""
        snap = self._snapshot
        return sum(i.nbytes for i in snap.staged) if snap is not None else 0

    @property
    def bytes_referenced(self) -> int:
        snap = self._snapshot
        return sum(i.nbytes for i in snap.items if i.ref is not None) if snap is not None else 0

    @property
    def loop_wait_seconds(self) -> float:
        """What the training loop waited for this checkpoint: the eager part of the snapshot plus
        what the optimizer pre-hook waited for the lazy copies."""
        guard = self._snapshot.guard_seconds if self._snapshot is not None else 0.0
        return self.blocking_seconds + guard

    def done(self) -> bool:
        return self._future is None or self._future.done()

    @classmethod
    def failed(cls, step: int, err: BaseException) -> SaveHandle:
        """A save that failed before it reached the save thread (the snapshot itself)."""
        future: Future[CommitInfo] = Future()
        future.set_exception(err)
        return cls(step, future)

    def wait(self, timeout: float | None = None) -> CommitInfo | None:
        """The commit, or None when the save failed: whatever the failure (an I/O error, a
        ``state_dict()`` that raises, a codec error), it is recorded where it happened
        (``SavePath._save_failed``) and never raised here, in the training loop."""
        if self._future is None:
            return None
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise
        except Exception:
            return None

    @property
    def error(self) -> BaseException | None:
        if self._future is None or not self._future.done():
            return None
        return self._future.exception()


# A collective of a multi-rank commit that failed because a peer went away (killed, crashed): the
# commit was interrupted with the job, it is not a save that failed. gloo's and NCCL's words.
_PEER_GONE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|remote process exited|DistNetworkError|"
    r"peer (closed|disconnected)|Socket Timeout|NCCL communicator was aborted",
    re.IGNORECASE,
)


def peer_gone(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) says a peer rank went away."""
    seen: BaseException | None = err
    for _ in range(4):
        if seen is None:
            return False
        if _PEER_GONE.search(f"{type(seen).__name__}: {seen}"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def failure_cause(err: BaseException) -> str:
    """What makes two failures the same (logged once): the exception's type and message with
    numbers (steps, sizes, pids) and hex ids blanked."""
    return re.sub(r"[0-9a-f]{8,}|\d+", "#", f"{type(err).__name__}: {err}")[:200]
