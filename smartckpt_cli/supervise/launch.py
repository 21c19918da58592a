"""How each attempt's process starts: in the warm spare when one is ready for it, else as a new
interpreter (:meth:`Launcher.spawn`); and the next attempt's spare, started once this one trains
(:meth:`Launcher.tend`).

``warm.py`` is one spare (its process and socket) and the pure ``warm_plan``; this module is the
state the supervisor keeps across attempts (the plan, the spare, whether its readiness was
said), so that its loop only asks it for a process and ticks it.

Order of calls (the supervisor, main thread): :meth:`Launcher.plan_warm` before the first attempt
when warm restarts are on; :meth:`Launcher.spawn` at each attempt's start; :meth:`Launcher.tend`
at every poll of an attempt; :meth:`Launcher.drop` when the run ends.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from smartckpt_cli.supervise.runstate import Emit
from smartckpt_cli.supervise.warm import Spare, WarmPlan, warm_plan

__all__ = ["SPARE_WAIT", "Launcher"]

SPARE_WAIT = 120.0  # seconds a restart waits for a spare still importing before starting cold


class Launcher:
    """Starts the command for each attempt; keeps the next attempt's interpreter, if any."""

    def __init__(self, command: list[str], emit: Emit, *, piped: bool) -> None:
        self.command = command
        self.emit = emit
        self.piped = piped  # the child's output goes to a pipe (RunOptions.output), not ours
        self.plan: WarmPlan | None = None  # how a spare runs the command; None: restarts start cold
        self.spare: Spare | None = None  # the next attempt's interpreter, importing or ready
        self._said = False

    def plan_warm(self) -> None:
        """Whether a spare can run the command (``warm.warm_plan``); said when it cannot."""
        plan = warm_plan(self.command)
        if isinstance(plan, str):
            self.emit("info", f"warm restart off: {plan}; a restart starts a new interpreter")
        else:
            self.plan = plan

    def spawn(self, attempt: int, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], bool]:
        """The attempt's process: the spare, when one is ready for it, else a new interpreter;
        and whether it is the spare."""
        proc = self._take(attempt, env)
        if proc is not None:
            return proc, True
        pipe = subprocess.PIPE if self.piped else None
        proc = subprocess.Popen(
            self.command,
            env=env,
            start_new_session=True,
            stdout=pipe,
            stderr=subprocess.STDOUT if pipe else None,
        )
        return proc, False

    def _take(self, attempt: int, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        spare, self.spare = self.spare, None
        if spare is None:
            return None
        proc = spare.launch(env) if spare.wait_ready(SPARE_WAIT) else None
        if proc is not None:
            return proc
        self.emit(
            "warning",
            f"attempt {attempt}: no warm restart ({spare.failure}); starting a new interpreter, "
            "and so will later restarts",
        )
        spare.close()
        self.plan = None  # what failed would fail again
        return None

    def tend(self, wanted: bool, env: Callable[[], dict[str, str]]) -> None:
        """Start a spare once ``wanted`` (the attempt trains and a restart may follow), with the
        next attempt's ``env``; then say once that it is ready, or why it failed."""
        if self.plan is None:
            return
        if self.spare is None:
            if wanted:
                self._start(self.plan, env())
            return
        if self.spare.poll():
            info = self.spare.info or {}
            if not self._said:
                self._said = True
                self.emit(
                    "info",
                    f"warm restart: a spare interpreter (pid {info.get('ready')}) waits for the next "
                    f"restart; torch and smartckpt imported in {float(info.get('imported', 0)):.1f} s, "
                    f"{int(info.get('rss', 0)) / 2**20:.0f} MiB resident",
                )
        elif self.spare.failure is not None:
            self.emit(
                "warning", f"warm restart off: {self.spare.failure}; a restart starts a new interpreter"
            )
            self.drop()
            self.plan = None

    def _start(self, plan: WarmPlan, env: dict[str, str]) -> None:
        started = Spare.start(plan, env, piped=self.piped)
        if isinstance(started, str):
            self.emit("warning", f"warm restart off: no spare interpreter ({started})")
            self.plan = None
        else:
            self.spare = started

    def drop(self) -> None:
        """Close the spare, if any (the run ends, or it failed)."""
        if self.spare is not None:
            self.spare.close()
            self.spare = None
