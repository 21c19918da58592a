"""engine/preempt.py with real signals sent to this process: a first TERM/INT waits for the step's
save, a second one is handed on at once, and SIGINT after its save is Python's KeyboardInterrupt,
marked so the interpreter prints one line for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from types import FrameType

import pytest

from smartckpt_cli.engine.preempt import PreemptionWatch


@pytest.fixture
def restored():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    hook = sys.excepthook
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        sys.excepthook = hook


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs at the next bytecode boundary of the main thread


def test_first_sigint_waits_for_the_save_a_second_raises_at_once(restored):
    watch = PreemptionWatch(["INT"])
    assert watch.install()
    _deliver(signal.SIGINT)
    assert watch.pending == signal.SIGINT  # recorded: the next step saves
    with pytest.raises(KeyboardInterrupt):
        _deliver(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handed back


def test_sigint_after_its_save_is_a_keyboard_interrupt_that_frameworks_can_catch(restored):
    watch = PreemptionWatch(["INT"])
    watch.install()
    _deliver(signal.SIGINT)
    assert watch.take() == signal.SIGINT
    with pytest.raises(KeyboardInterrupt) as info:
        watch.finish(signal.SIGINT, step=42)
    assert "step 42 is committed" in str(info.value)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_usr_continue_keeps_the_handler_and_a_later_signal_waits_again(restored):
    watch = PreemptionWatch(["USR1"], usr_continue=True)
    watch.install()
    _deliver(signal.SIGUSR1)
    assert watch.take() == signal.SIGUSR1
    watch.finish(signal.SIGUSR1, step=3)
    _deliver(signal.SIGUSR1)
    assert watch.pending == signal.SIGUSR1  # recorded again, not handed on
    watch.uninstall()


def test_an_uncaught_checkpointed_interrupt_ends_by_sigint_with_no_traceback():
    code = (
        "import signal, os, time\n"
        "from smartckpt_cli.engine.preempt import PreemptionWatch\n"
        "w = PreemptionWatch(['INT']); w.install()\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.05)\n"
        "w.take(); w.finish(signal.SIGINT, step=7)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGINT, proc.stderr
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    assert "checkpoint of step 7 committed" in proc.stderr, proc.stderr


def _take_with_a_signal_at(watch: PreemptionWatch, k: int, sig: int) -> tuple[int | None, bool]:
    """``watch.take()`` with ``sig`` sent to this process (a real signal) just before its ``k``-th
    bytecode runs: an opcode tracer sends it, and the handler runs at the tracer's next bytecode
    boundary, between two bytecodes of ``take``. Returns what ``take`` returned, and whether it
    had a ``k``-th bytecode."""
    sent = False

    def opcodes(frame: FrameType, event: str, arg: object) -> Callable[..., object]:
        nonlocal sent, k
        if event == "opcode":
            if k == 0 and not sent:
                sent = True
                os.kill(os.getpid(), sig)
                time.sleep(0)  # a call: the handler has run when the tracer returns
            k -= 1
        return opcodes

    def calls(frame: FrameType, event: str, arg: object) -> Callable[..., object] | None:
        if frame.f_code is PreemptionWatch.take.__code__:
            frame.f_trace_opcodes = True
            return opcodes
        return None

    before = sys.gettrace()
    sys.settrace(calls)
    try:
        got = watch.take()
    finally:
        sys.settrace(before)
    return got, sent


def test_a_signal_between_any_two_bytecodes_of_take_is_never_lost(restored):
    """Whichever bytecode of ``take()`` a signal interrupts, it is taken then or by the next
    ``take()``: the handler and ``take`` never write the same field (preempt.py). The old
    ``sig, self.pending = self.pending, None`` lost a signal that landed between its read and
    its reset."""
    watch = PreemptionWatch(["USR1", "USR2"], usr_continue=True)
    assert watch.install()
    try:
        delivered = 0
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            k = 0
            while True:
                got, sent = _take_with_a_signal_at(watch, k, sig)
                if not sent:
                    break
                delivered += 1
                taken = [got] if got is not None else []
                taken += [s for s in (watch.take(),) if s is not None]
                assert taken == [sig], f"signal sent before bytecode {k} of take(): taken {taken}"
                assert watch.pending is None and watch.take() is None
                k += 1
            # nothing pending at the start above; now one already pending, a second one mid-take
            k = 0
            while True:
                os.kill(os.getpid(), sig)
                time.sleep(0.01)
                assert watch.pending == sig
                got, sent = _take_with_a_signal_at(watch, k, sig)
                if not sent:
                    assert got == sig and watch.take() is None
                    break
                delivered += 1
                assert got == sig  # the one pending; the second one with it or next
                assert watch.take() in (sig, None) and watch.take() is None
                k += 1
        assert delivered > 10  # every bytecode of take() was tried, both ways
    finally:
        watch.uninstall()


def test_signals_in_bursts_while_take_runs_in_a_loop_are_all_taken(restored):
    """Many real signals while the main thread takes in a tight loop: each one sent is seen by
    ``pending`` and taken (USR1 and USR2 alternate, so none merges into the one before it and
    every one the kernel delivers is counted)."""
    watch = PreemptionWatch(["USR1", "USR2"], usr_continue=True)
    assert watch.install()
    try:
        taken: list[int] = []
        for i in range(300):
            sig = signal.SIGUSR1 if i % 2 == 0 else signal.SIGUSR2
            os.kill(os.getpid(), sig)  # handled at the next bytecode boundary, inside the loop below
            for _ in range(3):
                got = watch.take()
                if got is not None:
                    taken.append(got)
        while (got := watch.take()) is not None:
            taken.append(got)
        assert taken == [signal.SIGUSR1 if i % 2 == 0 else signal.SIGUSR2 for i in range(300)]
        assert watch.arrivals == watch.taken == 300
    finally:
        watch.uninstall()
