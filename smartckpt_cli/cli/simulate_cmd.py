"""``smartckpt simulate``: the command's options, and the replay's report or figure.

A module of its own, as every command of its size is, so that ``app.py`` holds the app, its
error handling and the small commands. Here the options become a ``SimConfig``, the trace is
read and replayed, and the result goes out as JSON or as lines and a table, and as a figure;
``simulate_view.py`` only renders the policies' table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["simulate"]

console = Console()

_Trace = Annotated[Path, typer.Argument(help="A trace CSV, or a store directory (its traces/ folder).")]
_Mtbf = Annotated[float, typer.Option(help="Mean time between failures, seconds.")]
_SaveCost = Annotated[float, typer.Option(help="Seconds the training loop loses per save.")]
_SaveTotal = Annotated[float, typer.Option(help="Seconds from a save's start to its commit.")]
_Checkpoints = Annotated[
    int | None,
    typer.Option(help="Calibrate every policy to this many saves (default: adaptive's count)."),
]
_MinInterval = Annotated[float, typer.Option(help="Floor between a policy's own saves, s.")]
_MaxInterval = Annotated[float, typer.Option(help="Lost-work budget: longest gap, s.")]
_KeepLast = Annotated[int, typer.Option(help="Retention: checkpoints kept.")]
_SpikeK = Annotated[float, typer.Option(help="Spike onset: filtered loss > baseline + k·MAD.")]
_Onsets = Annotated[str | None, typer.Option(help="Comma-separated onset steps instead of detecting them.")]
_RollbackAt = Annotated[
    str, typer.Option(help="When a rollback is decided: at a spike's 'end' or its 'onset'.")
]
_AllRuns = Annotated[
    bool, typer.Option("--all-runs", help="Concatenate every run of a store, not just the newest.")
]
_AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
_Plot = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        help="Also draw the trace with each policy's checkpoints (.png, .svg or .html; needs smartckpt\\[plot]).",
    ),
]


def simulate(
    trace: _Trace,
    mtbf: _Mtbf = 21600.0,
    save_cost: _SaveCost = 0.5,
    save_total: _SaveTotal = 5.0,
    checkpoints: _Checkpoints = None,
    min_interval: _MinInterval = 10.0,
    max_interval: _MaxInterval = 180.0,
    keep_last: _KeepLast = 3,
    spike_k: _SpikeK = 6.0,
    onsets: _Onsets = None,
    rollback_at: _RollbackAt = "end",
    all_runs: _AllRuns = False,
    as_json: _AsJson = False,
    plot: _Plot = None,
) -> None:
    """Replay a signal trace under the fixed, seed and adaptive policies at the same number of
    checkpoints: overhead, expected lost work, distance from loss spikes to a retained checkpoint.

    At 80 columns (or in a log) the table shows the numbers with units in the headers and each
    policy's calibrated setting on a line above; from 120 columns, the full table; --json has
    everything.

    \b
    Examples:
      smartckpt simulate ./checkpoints --mtbf 3600 --save-cost 2 --save-total 20
      smartckpt simulate ./checkpoints --plot policies.png
    """
    from smartckpt_cli.simulate import SimConfig, read_trace
    from smartckpt_cli.simulate import simulate as run_simulation

    cfg = SimConfig(
        mtbf=mtbf,
        save_cost=save_cost,
        save_total=save_total,
        min_interval=min_interval,
        max_interval=max_interval,
        keep_last=keep_last,
        checkpoints=checkpoints,
        spike_k=spike_k,
        onsets=_onset_steps(onsets),
        rollback=rollback_at,
    )
    cfg.check()
    if plot is not None:
        from smartckpt_cli.figures.base import check_output, matplotlib

        check_output(plot)
        matplotlib()  # one line, before the replay, when the extra is missing
    sim_trace = read_trace(trace, all_runs=all_runs)
    result = run_simulation(sim_trace, cfg)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        _simulate_report(result)
    if plot is not None:
        _draw(result, sim_trace, plot, say=not as_json)


def _onset_steps(onsets: str | None) -> tuple[int, ...] | None:
    """--onsets as steps (None: detect them)."""
    from smartckpt_cli.errors import ConfigError

    if onsets is None:
        return None
    try:
        return tuple(int(s) for s in onsets.split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--onsets must be comma-separated steps, not {onsets!r}") from None


def _draw(result: Any, sim_trace: Any, plot: Path, *, say: bool) -> None:
    from smartckpt_cli.figures.base import save
    from smartckpt_cli.figures.simulation import draw_simulation

    save(draw_simulation(result, sim_trace), plot, title=f"smartckpt simulate: {result.source}")
    if say:
        console.print(f"wrote {escape(str(plot))}", highlight=False, soft_wrap=True)


def _simulate_report(result: Any) -> None:
    from smartckpt_cli.cli.simulate_view import render

    # The terminal's width now (a Console reads COLUMNS when it is made, not at each print).
    console = Console()
    console.print(
        f"trace: {escape(result.source)}\n{result.rows} rows, {result.duration:,.1f} s; "
        f"calibration: {result.method}",
        highlight=False,  # wrapped at the terminal's (or the log's 80) columns
    )
    if result.onsets:
        console.print(
            "divergence onsets at steps " + ", ".join(str(o.step) for o in result.onsets), highlight=False
        )
    else:
        console.print("no divergence onsets found", highlight=False)
    render(result, console)
