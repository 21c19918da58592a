"""``smartckpt run``: parse the command line, start the supervisor, render what it reports.

A live rich panel when stdout is a terminal; plain ``smartckpt:`` lines (events at once, a status
line every ``log_every`` seconds) otherwise, as SLURM logs want. The supervisor runs in the main
thread (it owns the signal handlers); the panel refreshes from rich's own thread.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from smartckpt_cli.config import load_settings, parse_every
from smartckpt_cli.errors import ConfigError
from smartckpt_cli.supervise.child import python_command
from smartckpt_cli.supervise.runstate import RunOptions, RunState
from smartckpt_cli.supervise.supervisor import Supervisor

__all__ = ["run_command"]


def _remote_cell(meta_root: Path | None) -> str | None:
    """The upload lag, from the uploader's status file (written by the training process)."""
    if meta_root is None:
        return None
    from smartckpt_cli.remote.check import read_status

    v = read_status(meta_root)
    if v is None:
        return "no upload yet"
    text = f"{v.get('pending', 0)} checkpoint(s) not yet remote"
    if v.get("ranks"):  # several ranks: the slowest rank's lag
        slow = next((x for x in v["ranks"] if x.get("rank") == v.get("slowest_rank")), None) or {}
        text += (
            f", slowest rank {v.get('slowest_rank')} "
            f"({slow.get('pending') if slow.get('pending') is not None else '?'} behind, "
            f"lag {float(v.get('lag_seconds') or 0):.0f}s)"
        )
    if v.get("last_error"):
        text += f" (retrying: {str(v['last_error'])[:80]})"
    return text


def _status(st: RunState, meta_root: Path | None = None) -> str:
    parts = [f"attempt {st.attempt}", f"restarts {st.restarts}"]
    if st.step is not None:
        parts.append(f"step {st.step}")
    if st.loss is not None:
        parts.append(f"loss {st.loss:.4g}")
    if st.checkpoint_step:
        age = time.time() - (st.checkpoint_seen or time.time())
        parts.append(f"checkpoint {st.checkpoint_step} ({age:.0f}s ago)")
    remote = _remote_cell(meta_root)
    if remote:
        parts.append(f"remote: {remote}")
    parts.append(st.usage.line())
    return ", ".join(parts)


def _panel(st: RunState, meta_root: Path | None = None) -> Table:
    t = Table(title=f"smartckpt run {st.run_id}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("command", st.command)
    t.add_row("attempt", f"{st.attempt} (pid {st.pid}, {st.phase}); restarts {st.restarts}")
    if st.heartbeat:
        loss = f"{st.loss:.5g}" if st.loss is not None else "-"
        t.add_row("step", f"{st.step}  loss {loss}  ({st.child_state})")
    else:
        t.add_row("step", "no heartbeat yet" + ("" if st.hooks_live else " (hooks not live)"))
    if st.checkpoint_step:
        age = time.time() - (st.checkpoint_seen or time.time())
        t.add_row(
            "checkpoint", f"step {st.checkpoint_step}, {age:.0f} s ago; {st.checkpoints_taken} this run"
        )
    else:
        t.add_row("checkpoint", "none yet")
    remote = _remote_cell(meta_root)
    if remote:
        t.add_row("remote", remote)
    t.add_row("hang timeout", f"{st.hang_timeout:.0f} s" if st.hang_timeout else "off")
    t.add_row("resources", st.usage.line())
    t.add_row("wall", f"{time.time() - st.started:.0f} s")
    return t


def run_command(args: list[str], overrides: dict[str, Any], config: Path | None, every: str | None) -> int:
    if not args:
        raise ConfigError("no command: give a script (smartckpt run train.py) or -- CMD ...")
    if every is not None:
        try:
            overrides["every_steps"], overrides["every_seconds"] = parse_every(every)
        except ValueError as err:
            raise ConfigError(f"--every: {err}") from None
    settings, sources = load_settings(config, overrides)
    command = python_command(args)
    if args[0].endswith(".py") and not Path(args[0]).is_file():
        raise ConfigError(f"script {args[0]} does not exist")
    if shutil.which(command[0]) is None:
        raise ConfigError(f"command {command[0]!r} not found")
    tty = sys.stdout.isatty()
    console = Console(stderr=False, highlight=False, soft_wrap=True)
    err_console = Console(stderr=True, highlight=False, soft_wrap=True)

    def say(level: str, msg: str) -> None:
        style = {"warning": "yellow", "error": "bold red"}.get(level, "")
        if tty:
            console.print(f"smartckpt: {msg}", style=style, markup=False)
        else:
            (err_console if level in ("warning", "error") else console).print(
                f"smartckpt: {msg}", markup=False
            )

    # On a terminal the child's output comes through us, printed above the live panel.
    output = (lambda line: console.print(line, markup=False, highlight=False)) if tty else None
    sup = Supervisor(RunOptions(command, settings, sources, output=output), say)
    meta_root = Path(settings.meta_dir or settings.dir) if settings.remote else None
    stop = threading.Event()
    if tty:
        live = Live(
            _panel(sup.state, meta_root),
            console=console,
            refresh_per_second=2,
            get_renderable=lambda: _panel(sup.state, meta_root),
        )
        with live:
            code = sup.run()
    else:
        ticker = threading.Thread(
            target=_ticker, args=(sup.state, settings.log_every, stop, console, meta_root), daemon=True
        )
        ticker.start()
        try:
            code = sup.run()
        finally:
            stop.set()
    _summary(sup, console)
    return code


def _ticker(
    st: RunState, every: float, stop: threading.Event, console: Console, meta_root: Path | None
) -> None:
    while not stop.wait(every):
        if st.phase == "running":
            console.print(f"smartckpt: {_status(st, meta_root)}", markup=False)


def _summary(sup: Supervisor, console: Console) -> None:
    rec = sup.record
    data = rec.to_json()
    console.print(
        f"smartckpt: run {rec.run_id} {rec.outcome} (exit {rec.exit_code}): {rec.restarts} restart(s), "
        f"{rec.checkpoints_taken} checkpoint(s) taken, {data['wall_seconds']:.1f} s wall, "
        f"{data['steps_lost']} step(s) and {data['seconds_lost']:.1f} s lost",
        markup=False,
    )
    for a in rec.attempts[:-1] if rec.outcome != "failed" else rec.attempts:
        lost = f"{a.steps_lost} steps" if a.steps_lost is not None else "? steps"
        console.print(
            f"smartckpt:   attempt {a.attempt}: {a.cause}; reached step {a.max_step}, restarted from "
            f"{a.restart_from}; lost {lost}, {a.seconds_lost or 0:.1f} s",
            markup=False,
        )
    console.print(f"smartckpt: run record: {rec.path()}", markup=False)
