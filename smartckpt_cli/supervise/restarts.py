"""Between two attempts: what the restart throws away (:func:`record_lost`), the journal rollback
a crash loop asks for (:func:`roll_back`), the diagnosis when the supervisor gives up on one
(:func:`crash_loop_diagnosis`), and the wait before the next start (:func:`wait_to_restart`).
Whether to restart, roll back or stop is decided in ``policy``; this module carries it out.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from smartckpt_cli.supervise.monitor import GpuMonitor
from smartckpt_cli.supervise.records import AttemptRecord, StoreView
from smartckpt_cli.supervise.runstate import Emit

__all__ = ["crash_loop_diagnosis", "record_lost", "roll_back", "wait_to_restart"]


def record_lost(att: AttemptRecord, step_seen: dict[int, float]) -> None:
    """Steps and wall time the restart throws away: from the step the next attempt begins at
    (``att.restart_from``: the checkpoint it restores, or 0 when it begins again) to the attempt's
    death; every step it trains again counts. The seconds are the attempt's own from the moment
    it passed that step (all of it when it began past it). ``step_seen``: when a heartbeat first
    showed each step."""
    frm = att.restart_from if att.restart_from is not None else att.began
    if att.max_step is not None:
        att.steps_lost = max(0, att.max_step - frm)
    # The first time a heartbeat showed the restored step or later (polls skip fast steps).
    seen = [t for step, t in step_seen.items() if step >= frm]
    reached = min(seen) if seen and frm >= att.began else None
    att.seconds_lost = att.ended - (reached if reached is not None else att.started)


def roll_back(store: StoreView, att: AttemptRecord, crash_loop: int, emit: Emit) -> None:
    """Roll the journal back past the checkpoint the crash loop restarts from: the next attempt
    restores the one before it (that checkpoint is kept, marked)."""
    steps = store.live_steps()
    bad = att.began
    prev = next((s for s in steps if s < bad), 0)
    why = f"crash loop: {crash_loop} attempts died without getting past the checkpoint of step {bad}"
    store.rollback(prev, why)
    att.rollback_to = prev
    emit("warning", f"{why}; rolled back to step {prev} (the checkpoint of step {bad} is kept, marked)")


def crash_loop_diagnosis(
    att: AttemptRecord, attempts: list[AttemptRecord], crash_loop: int, mark: int | None
) -> str:
    """The message (and the run record's diagnosis) when a crash loop stops the run: where the
    attempts die, what killed them, and where to look. ``mark``: ``CrashLoop.mark``."""
    stuck = [a for a in attempts if a.began == att.began or a.rollback_to is not None]
    causes = sorted({a.cause for a in attempts[-crash_loop - 1 :] if a.cause})
    where = f"step {att.max_step}" if att.max_step is not None else "an unknown step"
    rb = next((a.rollback_to for a in reversed(attempts) if a.rollback_to is not None), None)
    text = (
        f"crash loop: attempts keep dying at {where} without getting past the checkpoint of step "
        f"{mark if mark is not None else att.began}"
    )
    if rb is not None:
        text += f"; rolling back to step {rb} did not help"
    text += f" ({len(stuck)} attempts; cause: {'; '.join(causes)}). "
    text += "The failure is deterministic at that point of training: look at the data at that step"
    if att.stacks:
        text += f" and the stack dump {att.stacks}"
    elif att.error:
        text += f" and the error: {att.error.get('type')}: {att.error.get('message')}"
    return text + ". Not restarting."


def wait_to_restart(
    gpu: GpuMonitor, last_pids: set[int], delay: float, take_stop: Callable[[], bool], emit: Emit
) -> bool:
    """Wait for the GPU memory of the dead attempt and the backoff ``delay``; False when stopped
    (``take_stop``: whether a TERM/INT arrived)."""
    freed, waited = gpu.wait_freed(last_pids, timeout=120.0)
    if waited > 0.5:
        emit("info", f"waited {waited:.1f} s for the dead attempt's GPU memory to be freed")
    if not freed:
        emit("warning", "GPU memory of the dead attempt is still held after 120 s; restarting anyway")
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline:
        if take_stop():
            return False
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    return not take_stop()
