"""The heartbeat this process writes for ``smartckpt run``: step, loss, state and committed step in
a 64-byte record of ``<run_dir>/heartbeat.<pid>`` (the format is ``hooks/_smartckpt_protocol.py``'s,
which the supervisor reads). A leaf: the engine beats from ``step()`` and around blocking saves and
restores, the agent (zero-code mode) from its optimizer hooks; neither needs the other for it.

Outside ``smartckpt run`` (no ``SMARTCKPT_RUN_DIR``) every call here does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "beat",
    "beat_step",
    "heartbeat_on",
    "heartbeat_state",
    "hooks_state",
    "last_step",
    "protocol",
    "register_exit",
    "run_dir",
    "set_done_at_exit",
    "total_steps",
    "trouble",
]

logger = logging.getLogger(__name__)

# Whether the exit hook says DONE: zero-code mode says it itself, after its final checkpoint.
_done_at_exit = True


def set_done_at_exit(flag: bool) -> None:
    """``False`` while someone else (zero-code mode) will write the DONE beat at exit."""
    global _done_at_exit
    _done_at_exit = flag


_proto: Any = None


def protocol() -> Any:
    global _proto
    if _proto is None:  # imported once: this is on every step's path
        from smartckpt_cli.hooks import _smartckpt_protocol

        _proto = _smartckpt_protocol
    return _proto


def run_dir() -> str | None:
    return os.environ.get("SMARTCKPT_RUN_DIR") or None


def hooks_state() -> dict[str, Any]:
    """What sitecustomize shares with us (it sets ``uncaught`` when an exception ends the run)."""
    state = getattr(sys, "_smartckpt_hooks", None)
    return state if isinstance(state, dict) else {}


def register_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit *before* concurrent.futures stops accepting work (its own
    exit hook is registered the same way, earlier, and these run last-registered first)."""
    reg = getattr(threading, "_register_atexit", None)
    try:
        if reg is not None:
            reg(fn)
            return
    except RuntimeError:
        return
    import atexit

    atexit.register(fn)


_beat_writer: Any = None
_beat_pid = -1
# This process's id, kept up to date across fork: os.getpid() is a system call, and a system call
# on every step's path cost more than the rest of a step's Python here (a VM's syscall entry
# flushes what the next lines would find in cache).
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def _heart() -> Any:
    global _beat_writer, _beat_pid
    if _beat_pid == _pid:
        return _beat_writer
    _beat_pid, _beat_writer = os.getpid(), None
    where = run_dir()
    if where is None:
        return None
    try:
        _beat_writer = protocol().HeartbeatWriter(where, rank=int(os.environ.get("RANK", "-1")))
    except (OSError, ValueError, ImportError) as err:
        logger.warning("no heartbeat: %s", err)
        return None
    pid = os.getpid()

    def done() -> None:
        # Zero-code mode says DONE itself, after its final checkpoint.
        if os.getpid() == pid and _done_at_exit and not hooks_state().get("uncaught"):
            _beat_writer.beat(state=protocol().DONE)

    register_exit(done)
    return _beat_writer


def heartbeat_on() -> bool:
    """Whether this process beats (it runs under ``smartckpt run``)."""
    return _heart() is not None


def beat(
    step: int | None = None,
    loss: float | None = None,
    committed_step: int | None = None,
    state: str | None = "TRAINING",
) -> None:
    """One heartbeat (a 64-byte record in a shared mapping) when running under ``smartckpt run``;
    else nothing. ``loss`` only when it is already on the host: a heartbeat never synchronises
    the device. ``state``: a state name of the protocol (``None`` keeps the current one)."""
    w = _heart()
    if w is not None:
        code = getattr(protocol(), state) if state is not None else None
        w.beat(step=step, loss=loss, state=code, committed_step=committed_step)


def beat_step(step: int) -> None:
    """The heartbeat of a step that changes nothing else: the least the step path can do (the
    supervisor counts steps, lost work and hangs from it, so every step beats)."""
    w = _beat_writer
    if w is not None and _beat_pid == _pid:
        w.beat(step=step)


def last_step(step: int) -> None:
    """The newest step this process reached, for its last beats (kept, not written: the next beat
    writes it). Never lowers the step: in zero-code mode the manager counts one step behind."""
    w = _heart()
    if w is not None and step > w.step:
        w.step = step


def total_steps(total: int | None) -> None:
    """The steps this training takes in all (a Trainer's ``max_steps``, ``start_step(total=)``),
    for the live view's progress and ETA; None or below 1: not known. Nothing outside
    ``smartckpt run``."""
    w = _heart()
    if w is not None:
        n = int(total) if total is not None and total > 0 else -1
        if n != w.total:
            w.beat(total=n)


def trouble(name: str, on: bool) -> None:
    """Set (or clear) a trouble flag of the protocol (``SAVE_FAILING``, ``IO_FAILING``,
    ``CHECKPOINTING_OFF``) in this process's heartbeat, at once; nothing outside ``smartckpt run``."""
    w = _heart()
    if w is not None:
        flag = getattr(protocol(), name)
        if bool(w.trouble & flag) != on:
            w.beat(trouble=(flag, on))


@contextlib.contextmanager
def heartbeat_state(name: str, step: int | None = None) -> Iterator[None]:
    """``SAVING`` or ``RESTORING`` while a blocking save or restore runs (the supervisor pauses hang
    detection); the previous state afterwards."""
    w = _heart()
    if w is None:
        yield
        return
    previous = w.state
    w.beat(step=step, state=getattr(protocol(), name))
    try:
        yield
    finally:
        w.beat(state=previous)
