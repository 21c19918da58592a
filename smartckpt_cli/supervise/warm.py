"""Warm restarts: a spare interpreter, started before it is needed, that becomes the next attempt.

A restart pays for a new interpreter, ``import torch`` (2 s here, 10-30 s on a shared file
system) and smartckpt's own imports before the script runs a line. While an attempt trains, the
supervisor starts the next one's interpreter (``python -m smartckpt_cli.agent.warm``, the same
interpreter and flags as the command) with the attempt's environment; it imports torch and
smartckpt, says ``ready`` on its control socket and waits. At the restart the supervisor sends it
the attempt's environment; it takes it, activates the hooks and runs the script as ``python
script.py`` would. It is a whole process of the supervisor's own (not a fork of a server), so it
is waited for, signalled and killed like a cold child, and no CUDA context or OpenMP team can be
copied into it: the spare never touches a GPU or runs a torch operation.

Order of calls (the supervisor's)::

    plan = warm_plan(command)               # pure: a Python command, or why not (one line)
    spare = Spare.start(plan, env, piped)   # the attempt is training: the next one's interpreter
    proc = spare.launch(env)                # the restart: that process is the attempt (or None)
    spare.close()                           # nothing restarts: killed

Anything that goes wrong with a spare (it died, its import failed, the environment it imported
torch under differs from the attempt's) gives one line and a cold start: a warm restart is an
optimisation, never a condition.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smartckpt_cli.hooks import _smartckpt_protocol as proto

__all__ = ["ENV_FD", "Spare", "WarmPlan", "env_differs", "warm_plan"]

ENV_FD = "SMARTCKPT_WARM_FD"  # the spare's end of the control socket (a descriptor number)
MODULE = "smartckpt_cli.agent.warm"
# Options of the interpreter that take a value (python -W error, -X importtime).
_WITH_VALUE = ("W", "X")
# Options the spare cannot honour: -i (interactive after the script), -I/-E/-S (no hooks at all).
_REFUSED = set("iIES")
# Modules that start their own worker processes: a spare would only hold their launcher.
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")
# Variables each attempt sets for itself; any other difference means torch was imported under
# another environment than the attempt's.
_PER_ATTEMPT = ("SMARTCKPT_",)


@dataclass(frozen=True)
class WarmPlan:
    """How the command runs in a spare: ``interpreter flags... -m smartckpt_cli.agent.warm``,
    then the target (a script's path or a module's name) with ``args``."""

    interpreter: list[str]  # the interpreter and its options
    target: str
    module: bool
    args: list[str]

    def spare_command(self) -> list[str]:
        return [*self.interpreter, "-m", MODULE]

    def request(self) -> dict[str, Any]:
        command = [*self.interpreter, *(["-m"] if self.module else []), self.target, *self.args]
        return {
            "target": self.target,
            "module": self.module,
            "args": self.args,
            "cwd": os.getcwd(),
            "orig_argv": command,  # what sys.orig_argv holds in a cold start
        }


def warm_plan(command: list[str]) -> WarmPlan | str:
    """The command as a spare would run it, or why it cannot (the start of a sentence)."""
    if not command:
        return "no command"
    exe = Path(command[0]).name
    if not exe.startswith("python") or exe.startswith("python-config"):
        return f"`{exe}` is not a Python interpreter"
    if shutil.which(command[0]) is None and not Path(command[0]).is_file():
        return f"`{command[0]}` is not found"
    i = 1
    while i < len(command):
        arg = command[i]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            break
        if arg == "-m":
            break
        if arg == "-c":
            return "`python -c` runs no script"
        if arg.startswith("--"):  # --check-hash-based-pycs mode, --help: rare enough to run cold
            return f"interpreter option {arg} is not handled"
        letters = arg[1:]
        for j, c in enumerate(letters):
            if c in _REFUSED:
                return f"interpreter option -{c} is not handled"
            if c in _WITH_VALUE:
                if j == len(letters) - 1:
                    i += 1  # its value is the next argument
                break
        i += 1
    rest = command[i:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest or rest[0] == "-":
        return "no script to run"
    if rest[0] == "-m":
        if len(rest) < 2:
            return "no module to run"
        if rest[1] in _LAUNCHERS:
            return f"`-m {rest[1]}` starts its own workers cold"
        return WarmPlan(command[:i], rest[1], True, rest[2:])
    return WarmPlan(command[:i], rest[0], False, rest[1:])


def env_differs(spare_env: dict[str, str], attempt_env: dict[str, str]) -> list[str]:
    """The variables (names only: values may be secrets) that differ between the environment the
    spare imported torch under and the attempt's, the per-attempt handshake aside."""

    def keep(k: str) -> bool:
        return not k.startswith(_PER_ATTEMPT)

    keys = {k for k in (*spare_env, *attempt_env) if keep(k)}
    return sorted(k for k in keys if spare_env.get(k) != attempt_env.get(k))


class Spare:
    """One spare interpreter (module docstring); ``ready`` once its imports are done."""

    def __init__(
        self, plan: WarmPlan, proc: subprocess.Popen[bytes], sock: socket.socket, env: dict[str, str]
    ):
        self.plan, self.proc, self.sock, self.env = plan, proc, sock, env
        self.info: dict[str, Any] | None = None  # its "ready" message: pid, seconds importing, memory
        self.failure: str | None = None
        self._buf = b""

    @classmethod
    def start(cls, plan: WarmPlan, env: dict[str, str], *, piped: bool) -> Spare | str:
        """The spare started (it imports while the attempt trains), or why not."""
        ours, theirs = socket.socketpair()
        # Without the run directory the hooks load but stay inactive until the launch activates them.
        spare_env = {k: v for k, v in env.items() if k != proto.ENV_RUN_DIR}
        spare_env[ENV_FD] = str(theirs.fileno())
        pipe = subprocess.PIPE if piped else None
        try:
            proc = subprocess.Popen(
                plan.spare_command(),
                env=spare_env,
                start_new_session=True,  # its own group: the dying attempt's group kill spares it
                stdout=pipe,
                stderr=subprocess.STDOUT if pipe else None,
                pass_fds=(theirs.fileno(),),
            )
        except OSError as err:
            ours.close()
            return f"{type(err).__name__}: {err}"
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(plan, proc, ours, spare_env)

    def _read(self) -> list[dict[str, Any]]:
        out = []
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if isinstance(msg, dict):
                    out.append(msg)
        return out

    def poll(self) -> bool:
        """Ready to launch? Reads what the spare said; a dead spare sets ``failure``."""
        if self.failure is not None:
            return False
        for msg in self._read():
            if "ready" in msg:
                self.info = msg
            elif "error" in msg:
                self.failure = str(msg["error"])
        if self.failure is None and self.proc.poll() is not None:
            self.failure = f"the spare interpreter exited ({_status(self.proc.returncode)})"
        return self.failure is None and self.info is not None

    def wait_ready(self, timeout: float) -> bool:
        """Wait for a spare still importing (it started earlier than a cold start would)."""
        end = time.monotonic() + timeout
        while not self.poll() and self.failure is None and time.monotonic() < end:
            time.sleep(0.01)
        if self.failure is None and self.info is None:
            self.failure = f"the spare interpreter was not ready after {timeout:g} s"
        return self.failure is None

    def launch(self, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """Hand the spare the attempt's environment: it becomes the attempt. None (and ``failure``
        set) when it cannot: the caller starts the attempt cold."""
        differs = env_differs(self.env, env)
        if differs:
            self.failure = f"the environment differs from the spare's ({', '.join(differs[:3])})"
            return None
        msg = {"run": {**self.plan.request(), "env": env}}
        try:
            self.sock.setblocking(True)
            self.sock.sendall((json.dumps(msg) + "\n").encode())
            self.sock.settimeout(10.0)
            reply = b""
            while b"\n" not in reply:
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                reply += data
        except OSError as err:
            self.failure = f"the spare interpreter cannot be reached ({type(err).__name__}: {err})"
            return None
        finally:
            self.sock.close()
        try:
            answer = json.loads(reply.split(b"\n", 1)[0] or b"{}")
        except ValueError:
            answer = {}
        if answer.get("running") != self.proc.pid:
            why = answer.get("refused") or (
                f"it exited ({_status(self.proc.poll())})" if self.proc.poll() is not None else "no answer"
            )
            self.failure = f"the spare interpreter did not start the script: {why}"
            return None
        return self.proc

    def close(self) -> None:
        """Nothing restarts (or a cold start replaces it): the spare goes."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5.0)
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
