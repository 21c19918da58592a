"""A taken snapshot to the save thread, for :class:`~smartckpt_cli.engine.manager.CheckpointManager`:
a checkpoint (the trigger's schedule moves to it, the resume check expects the step after) or a
RAM snapshot alone (its own cadence, nothing written to disk); the :class:`.SaveHandle` the loop
holds, and what the call blocked.

Apart from :mod:`.saving` because it is the seam between the two threads: everything before it
runs on the training thread, everything it submits on the save thread. A mixin, as
:mod:`.saving` is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from smartckpt_cli.engine.cadence import StepClock
from smartckpt_cli.engine.ramtier import RamTier
from smartckpt_cli.engine.resumecheck import NextStepSlot, ResumeCheck, Values
from smartckpt_cli.engine.savehandle import SaveHandle
from smartckpt_cli.engine.schedule import SaveSchedule
from smartckpt_cli.trigger.policies import Decision
from smartckpt_cli.trigger.trace import TraceWriter

__all__ = ["HandOverPath"]


class HandOverPath:
    """The manager's hand-over of a snapshot (module docstring)."""

    _trace: TraceWriter
    _schedule: SaveSchedule
    _lazy_snapshot: Any
    _quiet: tuple[float, float]
    _wish: Decision | None
    _clock: StepClock
    _check: ResumeCheck
    _saver: ThreadPoolExecutor
    _ram: RamTier | None
    _ram_due: float
    _inflight: SaveHandle | None
    _uncalm: Callable[[], None]  # calm.py
    _persist: Callable[..., Any]  # saving.py
    _persist_ram: Callable[..., Any]  # ramsave.py

    def _hand_over_checkpoint(
        self, snap: Any, step: int, t0: float, healthy: bool, next_step: Values | None
    ) -> SaveHandle:
        """A checkpoint to the save thread; the trigger's schedule moves to it."""
        slot: NextStepSlot | None = None
        if next_step is None:  # taken at step(step + 1): into the manifest if still in time, else the journal
            slot = NextStepSlot()
            snap.before_manifest = slot.close
        snap_time = time.monotonic()
        self._trace.flush()
        if healthy:
            self._schedule.taken(step, snap_time)
        if snap.guards:
            self._lazy_snapshot = snap
        # The schedule moved: ask the policy at the next step; that step's time is not a step's.
        self._quiet, self._wish = (-math.inf, -math.inf), None
        self._clock.skip()
        self._uncalm()
        handle = self._hand_over(snap, t0, snap_time=snap_time, next_step=next_step)
        if next_step is None:
            self._check.expect(step + 1, handle, slot)
        return handle

    def _hand_over(
        self,
        snap: Any,
        t0: float,
        *,
        snap_time: float = 0.0,
        ram_only: bool = False,
        next_step: Values | None = None,
    ) -> SaveHandle:
        """The snapshot to the save thread: a RAM snapshot alone (``ram_only``: hashed and
        recorded, nothing written to disk; the disk's schedule does not move) or a checkpoint."""
        future: Future[Any]
        if ram_only:
            if snap.guards:
                self._lazy_snapshot = snap
            self._clock.skip()
            self._uncalm()
            future = self._saver.submit(self._persist_ram, snap, next_step)
        else:
            future = self._saver.submit(self._persist, snap, snap_time, next_step)
        if self._ram is not None:
            self._ram_due = time.monotonic() + self._ram.interval()
        handle = SaveHandle(snap.step, future, snap)
        if snap.pager is not None:
            # In pieces (engine/pager.py): what no optimizer step guards may change at once, so
            # the call waits until the writer copied it (all of it on the eager path).
            (snap.early if snap.guards else snap.copied).wait()
        handle.blocking_seconds = snap.blocking_seconds = time.perf_counter() - t0
        self._inflight = handle
        return handle
