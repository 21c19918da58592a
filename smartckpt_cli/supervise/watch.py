"""Watching one attempt: the child's heartbeats into the hang clock and the live view
(:func:`observe`), its output relayed line by line (:func:`relay`), and a hung child's stacks
dumped before it is killed (:func:`hang_kill`). The supervisor calls these from its poll loop;
whether the child hangs is decided by ``policy.HangClock``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from smartckpt_cli.hooks import _smartckpt_protocol as proto
from smartckpt_cli.supervise.child import RunDir, alive
from smartckpt_cli.supervise.forward import killpg
from smartckpt_cli.supervise.pace import Pace
from smartckpt_cli.supervise.policy import HangClock
from smartckpt_cli.supervise.records import AttemptRecord
from smartckpt_cli.supervise.runstate import Emit, RunState

__all__ = ["STACK_WAIT", "hang_kill", "observe", "relay"]

STACK_WAIT = 5.0  # seconds to wait for a stack dump after SIGQUIT


def relay(proc: subprocess.Popen[bytes], sink: Callable[[str], None] | None) -> threading.Thread | None:
    """A thread that hands each line of the child's (piped) output to ``sink``; None without one."""
    out = proc.stdout
    if out is None or sink is None:
        return None

    def pump() -> None:
        for raw in iter(out.readline, b""):
            sink(raw.decode(errors="replace").rstrip("\n"))
        out.close()

    t = threading.Thread(target=pump, name="smartckpt-child-output", daemon=True)
    t.start()
    return t


def observe(
    beats: list[proto.Beat],
    clock: HangClock,
    now: float,
    att: AttemptRecord,
    seen: dict[int, float],
    state: RunState,
    pace: Pace,
) -> None:
    """One poll's heartbeats: the slowest rank's step to the hang clock, the leader's to the view."""
    step = min(b.step for b in beats)
    paused = any(b.state in (proto.SAVING, proto.RESTORING, proto.WAITING) for b in beats)
    clock.observe(step, paused, now)
    lead = min(beats, key=lambda b: (b.rank if b.rank >= 0 else 0, b.pid))
    state.heartbeat = True
    state.step, state.child_state = step, lead.state_name
    state.trouble = 0
    for b in beats:
        state.trouble |= b.trouble
    state.loss = lead.loss if lead.loss == lead.loss else None
    pace.note(now, step)
    state.rate = pace.rate(now)
    state.total = max(b.total for b in beats) if any(b.total > 0 for b in beats) else None
    att.max_step = max(att.max_step or 0, step)
    seen.setdefault(step, time.time())


def hang_kill(
    pid: int, clock: HangClock, att: AttemptRecord, hooks: list[int], files: RunDir, emit: Emit
) -> None:
    """Ask every live hooked process for its stacks (``proto.STACK_SIGNAL_NAME``, SIGQUIT),
    wait up to :data:`STACK_WAIT` seconds for them, report them, then kill the child's tree."""
    what = (
        f"no first step within {clock.timeout() or 0:.0f} s (first_step_timeout)"
        if clock.last_step is None
        else f"no progress past step {clock.last_step} for {clock.timeout() or 0:.0f} s (hang timeout)"
    )
    emit("warning", f"the child hangs: {what}; dumping stacks and killing it")
    # Only processes of the child's own process group: the pids come from file names in the run
    # directory, and a file planted there must not make the supervisor signal anyone else.
    live = [p for p in hooks if alive(p) and _in_group(p, pid)]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, getattr(signal, proto.STACK_SIGNAL_NAME))
    dumps: list[str] = []
    deadline = time.monotonic() + STACK_WAIT
    while live and time.monotonic() < deadline and len(dumps) < len(live):
        dumps = [files.stacks(p) for p in live]
        dumps = [d for d in dumps if os.path.exists(d) and os.path.getsize(d) > 0]
        time.sleep(0.2)
    time.sleep(0.3)  # let faulthandler finish writing
    if dumps:
        att.stacks = dumps[0]
        head = Path(dumps[0]).read_text(errors="replace").splitlines()[:25]
        emit("warning", f"stacks of the hung child in {', '.join(dumps)}:\n" + "\n".join(head))
    else:
        emit("warning", "no stack dump: the hooks are not live in the hung process")
    killpg(pid, signal.SIGKILL)


def _in_group(pid: int, group: int) -> bool:
    try:
        return os.getpgid(pid) == group
    except OSError:
        return False
