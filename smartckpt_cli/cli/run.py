"""``smartckpt run``: parse the command line, start the supervisor, render what it reports.

A live rich panel when stdout is a terminal; plain ``smartckpt:`` lines (events at once, a status
line every ``log_every`` seconds) otherwise, as SLURM logs want. The supervisor runs in the main
thread (it owns the signal handlers); the panel refreshes from rich's own thread.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from smartckpt_cli.config import Settings, load_settings, parse_every
from smartckpt_cli.errors import ConfigError
from smartckpt_cli.supervise.child import python_command
from smartckpt_cli.supervise.pace import eta_text
from smartckpt_cli.supervise.runstate import RunOptions, RunState, trouble_text
from smartckpt_cli.supervise.summary import summary_lines
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


def _progress(st: RunState) -> str:
    """``step 420 of 1000 (42%), 3.1 steps/s, ETA 3m07s``: as much as is known."""
    text = f"step {st.step}"
    if st.total and st.step is not None:
        text += f" of {st.total} ({100 * min(st.step, st.total) / st.total:.0f}%)"
    if st.rate is not None:
        text += f", {st.rate:.3g} steps/s"
        eta = eta_text(st.step or 0, st.total, st.rate)
        if eta:
            text += f", {eta}"
    return text


def _status(st: RunState, meta_root: Path | None = None) -> str:
    parts = [f"attempt {st.attempt}", f"restarts {st.restarts}"]
    if st.step is not None:
        parts.append(_progress(st))
    if st.loss is not None:
        parts.append(f"loss {st.loss:.4g}")
    if st.child_state not in ("", "training", "done"):  # waiting for the remote, saving, restoring
        parts.append(st.child_state)
    if st.checkpoint_step:
        age = time.time() - (st.checkpoint_seen or time.time())
        parts.append(f"checkpoint {st.checkpoint_step} ({age:.0f}s ago)")
    remote = _remote_cell(meta_root)
    if remote:
        parts.append(f"remote: {remote}")
    trouble = trouble_text(st)
    if trouble:
        parts.append(f"PROBLEM: {trouble}")
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
        t.add_row("step", f"{_progress(st).removeprefix('step ')}; loss {loss} ({st.child_state})")
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
    trouble = trouble_text(st)
    if trouble:
        t.add_row("problem", trouble, style="bold red")
    t.add_row("hang timeout", f"{st.hang_timeout:.0f} s" if st.hang_timeout else "off")
    t.add_row("resources", st.usage.line())
    t.add_row("wall", f"{time.time() - st.started:.0f} s")
    return t


def run_command(
    args: list[str],
    overrides: dict[str, Any],
    config: Path | None,
    every: str | None,
    *,
    resume_finished: bool = False,
) -> int:
    settings, sources, command = _checked(args, overrides, config, every)
    tty = sys.stdout.isatty()
    console = Console(stderr=False, highlight=False, soft_wrap=True)
    err_console = Console(stderr=True, highlight=False, soft_wrap=True)

    def say(level: str, msg: str) -> None:
        style = {"warning": "yellow", "error": "bold red"}.get(level, "")
        if tty:
            console.print(f"smartckpt: {msg}", style=style, markup=False)
        else:
            out = err_console if level in ("warning", "error") else console
            out.print(f"{_fresh_line(out.file)}smartckpt: {msg}", markup=False)

    # On a terminal the child's output comes through us, printed above the live panel.
    output = (lambda line: console.print(line, markup=False, highlight=False)) if tty else None
    sup = Supervisor(
        RunOptions(command, settings, sources, output=output, resume_finished=resume_finished), say
    )
    meta_root = Path(settings.meta_dir or settings.dir) if settings.remote else None
    code = _supervise(sup, console, settings.log_every, meta_root, live=tty)
    _summary(sup, console)  # nothing when no attempt ran (the training had finished already)
    return code


def _checked(
    args: list[str], overrides: dict[str, Any], config: Path | None, every: str | None
) -> tuple[Settings, dict[str, str], list[str]]:
    """(settings, their sources, the command to run), or a ConfigError for what can be told
    wrong before anything starts."""
    if not args:
        raise ConfigError("no command: give a script (smartckpt run train.py) or -- CMD ...")
    if args[0].startswith("-"):  # no program is named like an option: an option run does not know
        raise ConfigError(f"no such option: {args[0]} (smartckpt run -h; options go before the script)")
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
    for name, where in (("--dir", settings.dir), ("meta_dir", settings.meta_dir)):
        if where is not None and Path(where).exists() and not Path(where).is_dir():
            raise ConfigError(f"{name} {where} is not a directory")
    return settings, sources, command


def _supervise(
    sup: Supervisor, console: Console, log_every: float, meta_root: Path | None, *, live: bool
) -> int:
    """The supervisor's run, shown as a live panel on a terminal (``live``), else as a status
    line every ``log_every`` seconds; its exit code."""
    if live:
        with Live(
            _panel(sup.state, meta_root),
            console=console,
            refresh_per_second=2,
            get_renderable=lambda: _panel(sup.state, meta_root),
        ):
            return sup.run()
    stop = threading.Event()
    ticker = threading.Thread(
        target=_ticker, args=(sup.state, log_every, stop, console, meta_root), daemon=True
    )
    ticker.start()
    try:
        return sup.run()
    finally:
        stop.set()


def _ticker(
    st: RunState, every: float, stop: threading.Event, console: Console, meta_root: Path | None
) -> None:
    while not stop.wait(every):
        if st.phase == "running":
            console.print(f"{_fresh_line(console.file)}smartckpt: {_status(st, meta_root)}", markup=False)


def _fresh_line(stream: Any) -> str:
    """A newline when the file this line goes to does not end with one: the child writes to the
    same file (a SLURM log), and a progress bar (tqdm) leaves its line open, ending in a carriage
    return's bar; a status line must not be appended to it. Only a regular file can be looked at
    (its last byte); a pipe or a terminal gets nothing."""
    try:
        stream.flush()
        fd = stream.fileno()
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return ""
        with open(f"/proc/self/fd/{fd}", "rb") as f:  # the same file, opened for reading
            f.seek(st.st_size - 1)
            return "" if f.read(1) == b"\n" else "\n"
    except (OSError, ValueError, AttributeError):
        return ""


def _summary(sup: Supervisor, console: Console) -> None:
    """The run's exit summary (supervise/summary.py words it from the run record)."""
    for line in summary_lines(sup.record):
        console.print(f"smartckpt: {line}", markup=False)
