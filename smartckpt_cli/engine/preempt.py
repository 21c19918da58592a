"""Preemption: SIGTERM (SLURM's warning before SIGKILL), SIGINT (Ctrl-C in a terminal) and
SIGUSR1/SIGUSR2 make the next step boundary take a blocking save; then the process exits, or, for
USR signals with ``usr_continue``, goes on training.

The handler only records the signal: a save cannot run inside a signal handler (the training
thread may be in the middle of an optimizer step). After the save, the signal is handed to
whatever handler was installed before smartckpt's (the user's, Lightning's, or the default one,
which terminates the process with that signal), so smartckpt never swallows it. Python's own
SIGINT handler raises ``KeyboardInterrupt``: that is raised from the step that saved, so a
framework's ``except KeyboardInterrupt`` still runs, and when nothing catches it the process
ends by SIGINT (exit 130) with the one line that said the checkpoint, not a traceback: the checkpoint is taken, there
is nothing to debug. A second TERM or INT before the save is handed on at once (a user who
presses Ctrl-C twice does not want to wait for the next step).

No signal is lost between the handler and :meth:`PreemptionWatch.take`: the handler runs between
any two bytecodes of the main thread (``take`` included), and the loop that takes may be another
thread, so the two never write the same field. The handler only appends to the list of arrivals and
counts them (``arrivals``); ``take`` only moves its own count of those taken (``taken``);
``pending`` reads both, and ``arrivals == taken`` is the step's fast path's test for "no signal".
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import TracebackType
from typing import Any

__all__ = ["PreemptionWatch", "checkpointed_interrupt"]

logger = logging.getLogger(__name__)

_STOP = (signal.SIGTERM, signal.SIGINT)


class PreemptionWatch:
    def __init__(self, names: list[str], *, usr_continue: bool = False) -> None:
        self.signals = [getattr(signal, f"SIG{n}") for n in names]
        self.usr_continue = usr_continue
        self._arrived: list[int] = []  # every signal recorded, in order: the handler only appends
        self.arrivals = 0  # how many: the handler alone writes it, after the append
        self.taken = 0  # how many of them take() has consumed: take() alone writes it
        self._received: int | None = None  # the first signal since install: a second one is urgent
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
        self._received = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self._received == signum and signum in _STOP:
            # The same stop signal again before the save: hand it on now, as if smartckpt were
            # not there (Python's SIGINT handler raises KeyboardInterrupt here).
            prev = self._previous.get(signum, signal.SIG_DFL)
            self.uninstall()
            if callable(prev):
                prev(signum, frame)
            elif prev != signal.SIG_IGN:
                os.kill(os.getpid(), signum)
            return
        if self._received is None:
            self._received = signum
        self._arrived.append(signum)  # the handler's only writes that take() reads (module docstring)
        self.arrivals += 1

    @property
    def pending(self) -> int | None:
        """The next signal received and not taken yet (None: none); the next step saves for it."""
        taken = self.taken
        return self._arrived[taken] if self.arrivals > taken else None

    def take(self) -> int | None:
        """The next signal received and not taken yet (None: none), with the same signal received
        again right after it (one save answers them). A signal that arrives while this runs is
        either taken with it or left for the next call, never dropped."""
        arrived, taken = self._arrived, self.taken
        if self.arrivals <= taken:
            return None
        sig, end = arrived[taken], taken + 1
        while self.arrivals > end and arrived[end] == sig:
            end += 1
        self.taken = end
        return sig

    def finish(self, signum: int, step: int | None = None) -> None:
        """After the save (of ``step``; None: none was taken): continue (USR with usr_continue)
        or hand the signal on."""
        name = signal.Signals(signum).name
        if signum in (signal.SIGUSR1, signal.SIGUSR2) and self.usr_continue:
            self._received = None
            logger.warning("smartckpt: %s: checkpoint taken, training continues", name)
            return
        prev = self._previous.get(signum, signal.SIG_DFL)
        self.uninstall()
        if prev is signal.default_int_handler:
            # What Python's handler would do, raised here rather than at whatever bytecode the
            # re-sent signal lands on; said in one line when nothing catches it.
            if step is not None:
                logger.warning("smartckpt: %s: checkpoint of step %d committed, stopping", name, step)
            raise checkpointed_interrupt(step)
        logger.warning("smartckpt: %s: checkpoint committed, handing the signal on", name)
        if prev is signal.SIG_IGN:
            return
        os.kill(os.getpid(), signum)  # the previous handler, or the default action: terminate


def checkpointed_interrupt(step: int | None) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` a SIGINT becomes after its checkpoint (or with none, ``step``
    None). A plain ``KeyboardInterrupt``, so frameworks catch it as one and an uncaught one still
    ends the process by SIGINT; marked, so the interpreter prints one line for it, no traceback."""
    what = f"the checkpoint of step {step} is committed" if step is not None else "no checkpoint was taken"
    err = KeyboardInterrupt(f"stopped by SIGINT; {what}")
    err._smartckpt_step = step  # type: ignore[attr-defined]
    if sys.excepthook is not _quiet_interrupt:
        global _next_hook
        _next_hook = sys.excepthook
        sys.excepthook = _quiet_interrupt
    return err


_next_hook = sys.excepthook


def _quiet_interrupt(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if isinstance(value, KeyboardInterrupt) and hasattr(value, "_smartckpt_step"):
        if value._smartckpt_step is None:  # the commit was logged; a missing one was not
            sys.stderr.write(f"smartckpt: {value}\n")
        return
    _next_hook(kind, value, tb)
