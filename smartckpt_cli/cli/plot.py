"""``smartckpt plot``: a run's timeline as a picture (PNG, SVG, HTML), or as JSON."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from smartckpt_cli.cli._shared import DirArg, MetaDirOpt, open_checkpoints, say

if TYPE_CHECKING:
    from smartckpt_cli.timeline import PlotOptions, Timeline

__all__ = ["Axis", "plot"]


class Axis(str, Enum):
    time = "time"
    step = "step"


_Output = Annotated[
    Path | None,
    typer.Option(
        "-o", "--output", help="Figure file: .png, .svg or .html (default run.png; with --json: none)."
    ),
]
_Run = Annotated[
    str | None, typer.Option("--run", help="Only this run of smartckpt run (RUN_ID from <dir>/runs/).")
]
_Steps = Annotated[
    str | None,
    typer.Option("--steps", metavar="A:B", help="Only steps A to B, inclusive (A: or :B for an open end)."),
]
_X = Annotated[Axis, typer.Option("--x", help="The x axis.")]
_Points = Annotated[
    int, typer.Option("--points", min=0, help="Pixel columns series are decimated to (0: every row).")
]
_Dpi = Annotated[
    int,
    typer.Option("--dpi", min=30, max=600, help="PNG resolution: pixels per inch of a 12-inch-wide figure."),
]
_AsJson = Annotated[
    bool,
    typer.Option("--json", help="Print the series, markers and spans as JSON (no matplotlib needed)."),
]
_Config = Annotated[
    Path | None,
    typer.Option(
        "--config",
        envvar="SMARTCKPT_CONFIG",
        help="Settings file the run used, for max_interval, policy, threshold (default: those its run record kept, else ./smartckpt.yaml).",
    ),
]
_MaxInterval = Annotated[
    float | None,
    typer.Option("--max-interval", help="The lost-work budget line, s (default: the settings')."),
]


def plot(
    directory: DirArg,
    output: _Output = None,
    run: _Run = None,
    steps: _Steps = None,
    x: _X = Axis.time,
    points: _Points = 2000,
    dpi: _Dpi = 100,
    as_json: _AsJson = False,
    meta_dir: MetaDirOpt = None,
    config: _Config = None,
    max_interval: _MaxInterval = None,
) -> None:
    """Draw a run's timeline: loss and signals, every checkpoint by reason and health,
    restarts with their cause and the work each lost.

    Panels share the x axis (time, or step with --x step): the loss with every checkpoint on
    it; a strip with one row per checkpoint reason (scheduled, budget, precursor, signal,
    preemption, final, manual); curvature, gradient variance, planned update; the trigger's
    score with its threshold; the work not yet in a checkpoint against the max_interval budget;
    memory when the trace records it. Marker colour is the reason, shape the health (circle
    calm, triangle not calm, cross unhealthy); faded markers were pruned or rolled back; a ring
    has not reached the remote tier yet. Restarts are dashed lines labelled with their cause
    (SIGKILL, OOM, hang, preemption...), the work each lost a shaded span.

    Long runs draw in seconds: each series keeps, per pixel column, its smallest and largest
    value (every spike survives); checkpoint and restart markers are never dropped.

    \b
    Examples:
      smartckpt plot ./checkpoints                       (writes run.png)
      smartckpt plot ./checkpoints -o run.svg --x step --steps 1000:2000
      smartckpt plot ./checkpoints --run 20261204-101500-a1b2c3 -o run.html
      smartckpt plot ./checkpoints --json \\
        | jq '.checkpoints[] | select(.category == "precursor")'

    Drawing needs matplotlib: pip install 'smartckpt\\[plot]'.

    \b
    Exit codes:
      0  written (or printed)
      1  DIR holds run records of smartckpt run but no checkpoint
      2  bad input: not a store, no such run, steps outside the trace, a bad
         -o name, matplotlib missing
    """
    from smartckpt_cli.timeline import build_timeline, load_store, parse_steps

    target = _figure_target(output, as_json)
    span = parse_steps(steps) if steps is not None else None
    started = time.monotonic()
    open_checkpoints(directory, meta_dir)  # run records but no store: say so (exit 1)
    facts = load_store(directory, meta_dir)
    opts = _plot_options(facts.runs, config, x, span, run, points, max_interval)
    timeline = build_timeline(facts, opts)
    if as_json:
        typer.echo(json.dumps(timeline.to_json()))
    if target is not None:
        _draw(timeline, target, dpi, started, as_json=as_json)


def _figure_target(output: Path | None, as_json: bool) -> Path | None:
    """The figure's file (None: --json alone), checked now: a bad name or a missing matplotlib
    fails in one line, not after reading a week of traces."""
    if output is None and as_json:
        return None
    target = output if output is not None else Path("run.png")
    from smartckpt_cli.figures.base import check_output, matplotlib

    check_output(target)
    matplotlib()
    return target


def _plot_options(
    runs: Sequence[dict[str, Any]],
    config: Path | None,
    x: Axis,
    span: tuple[int | None, int | None] | None,
    run: str | None,
    points: int,
    max_interval: float | None,
) -> PlotOptions:
    """The PlotOptions, with the run's settings for the budget line and the score's threshold:
    those its run record kept, unless --config names a file; else the settings here (file,
    environment). --max-interval is only the line drawn, so it is not validated against the
    other settings."""
    from smartckpt_cli.config import load_settings
    from smartckpt_cli.timeline import PlotOptions, recorded_settings

    settings, _ = load_settings(config)
    ran = (recorded_settings(runs, run) if config is None else None) or {}

    def setting(key: str) -> Any:
        return ran[key] if key in ran else getattr(settings, key)

    every = setting("every_steps") or setting("every_seconds")
    return PlotOptions(
        axis=x.value,
        steps=span,
        run_id=run,
        bins=points,
        max_interval=float(setting("max_interval") if max_interval is None else max_interval),
        policy="fixed" if every else str(setting("policy")),
        threshold=float(setting("threshold")),
    )


def _draw(timeline: Timeline, target: Path, dpi: int, started: float, *, as_json: bool) -> None:
    from smartckpt_cli.figures.base import save
    from smartckpt_cli.figures.timeline import draw_timeline, timeline_html, timeline_title

    fig = draw_timeline(timeline, dpi=dpi)
    save(fig, target, title=timeline_title(timeline), html_body=timeline_html(timeline))
    restarts = sum(r.restarted for r in timeline.restarts)
    say(
        f"wrote {target}: {timeline.trace_rows:,} trace row(s) from {len(timeline.segments)} file(s), "
        f"{len(timeline.checkpoints):,} checkpoint(s), {restarts} restart(s), "
        f"in {time.monotonic() - started:.1f} s",
        error=as_json,  # stdout is the JSON's
    )
