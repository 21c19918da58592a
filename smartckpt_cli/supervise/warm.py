"""Warm restarts: ``smartckpt run`` keeps an interpreter with torch and smartckpt imported waiting
(``agent/zygote.py``, a fork server started before any CUDA context), so that a restart forks it
instead of starting a new interpreter and importing torch again. No torch here.

Order of calls (the supervisor's): :func:`eligible` once (the command must be ``python
script.py ...`` or ``python -m module ...``; anything else, ``torchrun`` among them, starts cold,
said in one line); :meth:`WarmServer.start` once the first attempt trains (its import then costs
no start-up time); :meth:`WarmServer.spawn` for a restart, which returns a :class:`WarmProc` (the
``Popen`` surface the supervisor uses: ``pid``, ``poll``, ``returncode``, ``wait``) or the line
saying why a cold start it is (the server died, refused: CUDA initialised in it); :meth:`close`
at the end of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["WarmProc", "WarmServer", "eligible"]

ENV_FD = "SMARTCKPT_WARM"
READY_TIMEOUT = 120.0  # seconds the server may take to import torch


def eligible(command: list[str]) -> tuple[list[str], list[str], bool] | str:
    """(interpreter and its flags, the script's argv, whether ``-m``) for a command a warm
    interpreter can run, else the reason it cannot (one line)."""
    if not command or not Path(command[0]).name.startswith("python"):
        shown = " ".join(command[:2])
        return f"`{shown}` is not `python script.py` (torchrun, a shell, a binary)"
    flags: list[str] = []
    rest = command[1:]
    while rest and rest[0] in ("-u", "-B"):
        flags.append(rest.pop(0))
    if rest[:1] == ["-m"] and len(rest) > 1:
        return [command[0], *flags], rest[1:], True
    if rest and not rest[0].startswith("-"):
        return [command[0], *flags], rest, False
    return f"`{' '.join(command[:3])}`: interpreter options other than -u and -B"


class WarmProc:
    """A process forked by the warm server: what the supervisor uses of a ``Popen``."""

    stdout = None

    def __init__(self, pid: int, started: float) -> None:
        self.pid, self.started = pid, started
        self.returncode: int | None = None
        self.died: float | None = None  # when the server saw it end
        self.done = threading.Event()

    def _ended(self, status: int, when: float) -> None:
        self.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        self.died = when
        self.done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self.done.wait(timeout)
        return self.returncode


class WarmServer:
    """The fork server's handle (module docstring)."""

    def __init__(self, interpreter: list[str], env: dict[str, str], stdout: Any = None) -> None:
        self.interpreter, self.env, self.stdout = interpreter, env, stdout
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.ready = threading.Event()
        self.failed: str | None = None
        self.imported = 0.0
        self._procs: dict[int, WarmProc] = {}
        self._answers: list[dict[str, Any]] = []
        self._cv = threading.Condition()
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        """Start the server (it imports in the background; :meth:`spawn` waits for it)."""
        mine, theirs = socket.socketpair()
        env = dict(self.env)
        # Its hooks stay off until a forked child takes an attempt's environment: the server
        # itself writes nothing in the run directory.
        env.pop("SMARTCKPT_RUN_DIR", None)
        env[ENV_FD] = str(theirs.fileno())
        try:
            self.proc = subprocess.Popen(
                [*self.interpreter, "-m", "smartckpt_cli.agent.zygote"],
                env=env,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                stdout=self.stdout,
                stderr=subprocess.STDOUT if self.stdout is not None else None,
            )
        except OSError as err:
            self.failed = f"the warm interpreter could not start ({err})"
            self.ready.set()
            return
        finally:
            theirs.close()
        self.sock = mine
        self._reader = threading.Thread(target=self._read, name="smartckpt-warm", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.sock is not None
        buf = b""
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                self._dispatch(msg)
        # The server is gone: its forked processes cannot be waited for any more; a process that
        # is no longer there counts as killed.
        if self.failed is None:
            self.failed = "the warm interpreter exited"
        self.ready.set()
        with self._cv:
            self._cv.notify_all()
        for wp in list(self._procs.values()):
            threading.Thread(target=self._orphan, args=(wp,), daemon=True).start()

    def _orphan(self, wp: WarmProc) -> None:
        while not wp.done.is_set():
            try:
                os.kill(wp.pid, 0)
            except ProcessLookupError:
                wp._ended(signal.SIGKILL, time.time())
                return
            except PermissionError:
                pass
            time.sleep(0.2)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "ready" in msg:
            self.imported = float(msg.get("imported") or 0.0)
            self.ready.set()
        elif "error" in msg:
            self.failed = f"the warm interpreter could not import torch and smartckpt ({msg['error']})"
            self.ready.set()
        elif "exit" in msg:
            wp = self._procs.pop(int(msg["exit"]), None)
            if wp is not None:
                wp._ended(int(msg["status"]), float(msg["time"]))
        else:
            with self._cv:
                self._answers.append(msg)
                self._cv.notify_all()

    def spawn(self, argv: list[str], module: bool, env: dict[str, str], cwd: str) -> WarmProc | str:
        """Fork a process for one attempt, or the line saying why it starts cold instead."""
        if not self.ready.wait(READY_TIMEOUT):
            return "the warm interpreter was not ready in time"
        if self.failed is not None or self.sock is None:
            return self.failed or "the warm interpreter is not running"
        req = {"run": {"argv": argv, "module": module, "env": env, "cwd": cwd}}
        with self._cv:
            self._answers.clear()
            try:
                self.sock.sendall((json.dumps(req) + "\n").encode())
            except OSError as err:
                self.failed = f"the warm interpreter is gone ({err})"
                return self.failed
            deadline = time.monotonic() + 30.0
            while not self._answers and self.failed is None and time.monotonic() < deadline:
                self._cv.wait(0.5)
            answer = self._answers.pop(0) if self._answers else {}
            if "forked" not in answer:
                why = answer.get("refused") or self.failed or "the warm interpreter did not answer"
                self.failed = str(why)
                return self.failed
            wp = WarmProc(int(answer["forked"]), float(answer["time"]))
            self._procs[wp.pid] = wp
        return wp

    def close(self) -> None:
        """Stop the server (its forked processes are the supervisor's to end)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.sendall(b'{"stop": true}\n')
        if self.proc is not None:
            try:
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait()
        if self.sock is not None:
            self.sock.close()
