"""engine/preempt.py with real signals sent to this process: a first TERM/INT waits for the step's
save, a second one is handed on at once, and SIGINT after its save is Python's KeyboardInterrupt,
marked so the interpreter prints one line for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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
