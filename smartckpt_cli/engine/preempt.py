"""Preemption: SIGTERM (SLURM's warning before SIGKILL) and SIGUSR1/SIGUSR2 make the next step
boundary take a blocking save; then the process exits, or, for USR signals with
``usr_continue``, goes on training.

The handler only records the signal: a save cannot run inside a signal handler (the training
thread may be in the middle of an optimizer step). After the save, the signal is handed to
whatever handler was installed before smartckpt's (the user's, Lightning's, or the default one,
which terminates the process with that signal), so smartckpt never swallows it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

__all__ = ["PreemptionWatch"]

logger = logging.getLogger(__name__)


class PreemptionWatch:
    def __init__(self, names: list[str], *, usr_continue: bool = False) -> None:
        self.signals = [getattr(signal, f"SIG{n}") for n in names]
        self.usr_continue = usr_continue
        self.pending: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> bool:
        """Install the handlers (only the main thread may); False when not possible."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return bool(self._previous)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        return True

    def reinstall(self) -> bool:
        """Put smartckpt's handlers back on top of what was installed since (a framework that sets
        its own at start, Lightning's SLURM requeue): what replaced ours becomes the handler the
        signal is handed on to after the save. False when not possible (not the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            current = signal.getsignal(sig)
            if current != self._handler:
                self._previous[sig] = signal.signal(sig, self._handler)
        return True

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handler(self, signum: int, _frame: Any) -> None:
        if self.pending is None:
            self.pending = signum

    def take(self) -> int | None:
        sig, self.pending = self.pending, None
        return sig

    def finish(self, signum: int) -> None:
        """After the save: continue (USR with usr_continue) or hand the signal on."""
        if signum in (signal.SIGUSR1, signal.SIGUSR2) and self.usr_continue:
            logger.warning("%s: checkpoint taken, training continues", signal.Signals(signum).name)
            return
        prev = self._previous.get(signum, signal.SIG_DFL)
        logger.warning("%s: checkpoint committed, handing the signal on", signal.Signals(signum).name)
        self.uninstall()
        if prev is signal.SIG_IGN:
            return
        os.kill(os.getpid(), signum)  # the previous handler, or the default action: terminate
