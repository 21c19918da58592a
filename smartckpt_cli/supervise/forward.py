"""Signals sent to ``smartckpt run`` go to the training, and a child is killed with its whole tree.

TERM and INT ask the child to save and exit: they are passed to its process group, and the child
is killed after ``grace_period`` seconds (a second TERM/INT kills it at once). USR1 and USR2
(SLURM's warning of a preemption) are passed on as they are. :func:`killpg` with SIGKILL reaches
every descendant, ranks that torchrun started in sessions of their own included.

Order of calls (the supervisor, main thread): :meth:`Forwarder.install` before the first attempt;
:meth:`Forwarder.forward` at every poll of an attempt (the handler only queues the signal: nothing
is done inside a signal handler); :meth:`Forwarder.take_stop` while waiting between attempts;
:meth:`Forwarder.uninstall` when the run ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from smartckpt_cli.supervise.runstate import Emit, RunState

__all__ = ["FORWARDED", "STOP_SIGNALS", "Forwarder", "killpg"]

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Forwarder:
    """The signals received and not yet handled, and what they asked for."""

    def __init__(self, state: RunState, grace_period: float, emit: Emit) -> None:
        self.state = state
        self.grace_period = grace_period
        self.emit = emit
        self.pending: list[int] = []
        self.stop: int | None = None  # TERM/INT received
        self.preempt: int | None = None  # USR1/USR2 received during this attempt
        self.stopping_since: float | None = None  # when TERM/INT was passed to the child
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in FORWARDED:
            self._previous[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handler(self, signum: int, _frame: Any) -> None:
        self.pending.append(signum)

    def forward(self, pid: int) -> None:
        """Pass the queued signals to the child's process group ``pid``."""
        while self.pending:
            sig = self.pending.pop(0)
            name = signal.Signals(sig).name
            if sig in STOP_SIGNALS:
                if self.stopping_since is not None:  # a second one: no more waiting
                    self.emit("warning", f"second {name}: killing the child now")
                    killpg(pid, signal.SIGKILL)
                    continue
                self.stop, self.stopping_since = sig, time.monotonic()
                self.state.phase = "stopping"
                self.emit(
                    "warning",
                    f"{name} received: passed to the child, which saves and exits "
                    f"(killed after {self.grace_period:g} s)",
                )
            else:
                self.preempt = sig
                self.emit("info", f"{name} received: passed to the child")
            killpg(pid, sig)

    def take_stop(self) -> bool:
        """Between attempts (no child): whether a TERM/INT arrived; USR1/USR2 are dropped."""
        while self.pending:
            sig = self.pending.pop(0)
            if sig in STOP_SIGNALS:
                self.stop = sig
                return True
        return False


def killpg(pgid: int, sig: int) -> None:
    # A SIGKILL must reach every descendant: torchrun starts each rank in a session of its own, so
    # the child's process group alone would leave ranks running (holding ports, GPUs, the store).
    # They are listed before the kill, while they are still the child's descendants.
    tree = _descendants(pgid) if sig == signal.SIGKILL else []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []
