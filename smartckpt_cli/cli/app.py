"""``smartckpt``: the typer app. Commands are thin; domain errors become one line and an exit code.

Exit codes: 0 success, 1 the operation failed (a corrupt or missing checkpoint), 2 bad input
(a missing directory, not a checkpoint store, a bad option or setting).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from smartckpt_cli.cli import completions, config_cmd, export, inspect_cmd, prune, rollback, verify
from smartckpt_cli.errors import EXIT_USAGE, SmartckptError

app = typer.Typer(
    name="smartckpt",
    help="Adaptive, tiered, verified checkpointing for PyTorch training.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

DirArg = Annotated[Path, typer.Argument(help="Checkpoint store directory.")]


@app.command()
def demo(
    workdir: Annotated[
        Path | None, typer.Option(help="Where to put the demo store (default: a temp dir).")
    ] = None,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 60,
    kill_at: Annotated[int, typer.Option(help="Step at which the run is killed with SIGKILL.")] = 37,
) -> None:
    """Train a small model, SIGKILL it mid-run, resume it, and compare with an uninterrupted run.

    Example: smartckpt demo --kill-at 23
    """
    from smartckpt_cli.cli.demo import run_demo

    ok = run_demo(
        workdir, steps=steps, kill_at=kill_at, say=lambda m: console.print(m, soft_wrap=True, highlight=False)
    )
    raise typer.Exit(0 if ok else 1)


# The journal commands: one module each (rendering in cli/, deciding in smartckpt_cli/).
app.command("inspect")(inspect_cmd.inspect)
app.command("ls", hidden=True)(inspect_cmd.inspect)
app.command("verify")(verify.verify)
app.command("prune")(prune.prune)
app.command("rollback")(rollback.rollback)
app.command("export")(export.export)
app.add_typer(config_cmd.config_app, name="config")
app.command("completions")(completions.completions)


@app.command()
def bench(
    params: Annotated[float, typer.Option(help="Model size in parameters (e.g. 1e8, 2.5e7).")] = 1e8,
    reps: Annotated[int, typer.Option(min=1, help="Repetitions; each figure is their median.")] = 3,
    precision: Annotated[str, typer.Option(help="exact, bf16 or fp16 for smartckpt's moments.")] = "exact",
    level: Annotated[int, typer.Option(help="zstd level for smartckpt (-1: raw).")] = 1,
    workers: Annotated[int, typer.Option(help="Encoder threads (0: min(8, 2 x CPUs)).")] = 0,
    workdir: Annotated[Path | None, typer.Option(help="Where to write (default: the temp dir).")] = None,
    as_json: Annotated[
        Path | None, typer.Option("--json", help="Also write the results to this file.")
    ] = None,
) -> None:
    """Measure smartckpt against torch.save, torch.distributed.checkpoint and the machine's bounds.

    Example: smartckpt bench --params 2.5e7 --reps 3 --json bench.json
    """
    from smartckpt_cli.bench import run_bench
    from smartckpt_cli.cli.bench_view import render

    with console.status("benchmarking") as status:
        result = run_bench(
            int(params),
            reps=reps,
            workdir=workdir,
            precision=precision,
            compression_level=level,
            workers=workers,
            progress=lambda m: status.update(m),
        )
    render(result, console)
    if as_json is not None:
        as_json.write_text(json.dumps(result.to_json(), indent=2))
        console.print(f"results written to {as_json}")


@app.command()
def simulate(
    trace: Annotated[Path, typer.Argument(help="A trace CSV, or a store directory (its traces/ folder).")],
    mtbf: Annotated[float, typer.Option(help="Mean time between failures, seconds.")] = 21600.0,
    save_cost: Annotated[float, typer.Option(help="Seconds the training loop loses per save.")] = 0.5,
    save_total: Annotated[float, typer.Option(help="Seconds from a save's start to its commit.")] = 5.0,
    checkpoints: Annotated[
        int | None,
        typer.Option(help="Calibrate every policy to this many saves (default: adaptive's count)."),
    ] = None,
    min_interval: Annotated[float, typer.Option(help="Floor between a policy's own saves, s.")] = 10.0,
    max_interval: Annotated[float, typer.Option(help="Lost-work budget: longest gap, s.")] = 180.0,
    keep_last: Annotated[int, typer.Option(help="Retention: checkpoints kept.")] = 3,
    spike_k: Annotated[float, typer.Option(help="Spike onset: filtered loss > baseline + k·MAD.")] = 6.0,
    onsets: Annotated[
        str | None, typer.Option(help="Comma-separated onset steps instead of detecting them.")
    ] = None,
    rollback_at: Annotated[
        str, typer.Option(help="When a rollback is decided: at a spike's 'end' or its 'onset'.")
    ] = "end",
    all_runs: Annotated[
        bool, typer.Option("--all-runs", help="Concatenate every run of a store, not just the newest.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Replay a signal trace under the fixed, seed and adaptive policies at the same number of
    checkpoints: overhead, expected lost work, distance from loss spikes to a retained checkpoint.

    Example: smartckpt simulate ./checkpoints --mtbf 3600 --save-cost 2 --save-total 20
    """
    from smartckpt_cli.errors import ConfigError
    from smartckpt_cli.simulate import SimConfig, read_trace
    from smartckpt_cli.simulate import simulate as run_simulation

    steps = None
    if onsets is not None:
        try:
            steps = tuple(int(s) for s in onsets.split(",") if s.strip())
        except ValueError:
            raise ConfigError(f"--onsets must be comma-separated steps, not {onsets!r}") from None
    cfg = SimConfig(
        mtbf=mtbf,
        save_cost=save_cost,
        save_total=save_total,
        min_interval=min_interval,
        max_interval=max_interval,
        keep_last=keep_last,
        checkpoints=checkpoints,
        spike_k=spike_k,
        onsets=steps,
        rollback=rollback_at,
    )
    cfg.check()
    result = run_simulation(read_trace(trace, all_runs=all_runs), cfg)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
        return
    console.print(
        f"trace: {escape(result.source)}\n{result.rows} rows, {result.duration:,.1f} s; "
        f"calibration: {result.method}",
        soft_wrap=True,
        highlight=False,
    )
    if result.onsets:
        console.print(
            "divergence onsets at steps " + ", ".join(str(o.step) for o in result.onsets), highlight=False
        )
    else:
        console.print("no divergence onsets found", highlight=False)
    table = Table(title=f"policies at MTBF {mtbf:g}s, save cost {save_cost:g}s, commit after {save_total:g}s")
    for col in ("policy", "setting", "checkpoints", "overhead", "lost/failure", "expected lost"):
        table.add_column(col, justify="left" if col in ("policy", "setting") else "right")
    for col in ("onset dist mean", "onset dist max", "rollback lost", "missed"):
        table.add_column(col, justify="right")

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:,.1f}s"

    for p in result.policies:
        count = str(p.checkpoints) + ("" if p.exact_count else f" (target {result.target})")
        table.add_row(
            p.name,
            p.knob,
            count,
            f"{p.overhead:.2%}",
            sec(p.mean_lost),
            sec(p.expected_lost),
            sec(p.mean_distance),
            sec(p.max_distance),
            sec(p.mean_rollback_lost),
            str(p.missed) if result.onsets else "-",
        )
    console.print(table)


@app.command(
    "run",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def run_cmd(
    command: Annotated[list[str] | None, typer.Argument(help="train.py [ARGS], or -- CMD [ARGS].")] = None,
    dir: Annotated[
        str | None, typer.Option("--dir", help="Checkpoint store (default ./checkpoints).")
    ] = None,
    every: Annotated[
        str | None,
        typer.Option(help="Fixed schedule instead of the trigger: steps (50) or a duration (30s)."),
    ] = None,
    max_restarts: Annotated[int | None, typer.Option(help="Restarts before giving up (default 5).")] = None,
    hang_timeout: Annotated[
        float | None, typer.Option(help="Seconds without a step that count as a hang (default: learned).")
    ] = None,
    requeue: Annotated[
        bool | None, typer.Option("--requeue/--no-requeue", help="Requeue the SLURM job after USR1/USR2.")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(envvar="SMARTCKPT_CONFIG", help="YAML settings file (default ./smartckpt.yaml)."),
    ] = None,
    remote: Annotated[
        str | None,
        typer.Option(
            help="Replicate committed checkpoints here (s3://bucket/prefix, file:///path) and restore from it."
        ),
    ] = None,
) -> None:
    """Run a training script under smartckpt: checkpoints without code changes, restarts after
    crashes from the newest verified checkpoint.

    \b
      smartckpt run train.py --lr 3e-4            (python train.py with this interpreter)
      smartckpt run --every 30s -- torchrun --nproc_per_node 2 train.py

    Options go before the script; everything from the script (or after --) is the command.
    Each option can also be set in smartckpt.yaml (--config) or as SMARTCKPT_<NAME>.

    \b
    Exit codes:
      0        training finished (or the job was requeued after a preemption)
      N        the child's own exit code when it is not restarted (SyntaxError,
               ImportError, a failure before the first step, a no_restart_on match)
      128+N    stopped by signal N (SIGTERM: 143) that was passed to the child
      2        bad input (a missing script, a bad option or setting)
      3        gave up: max_restarts reached
      4        crash loop: the same failure after a rollback to the previous checkpoint
    """
    from smartckpt_cli.cli.run import run_command

    overrides = {
        "dir": dir,
        "max_restarts": max_restarts,
        "hang_timeout": hang_timeout,
        "requeue": requeue,
        "remote": remote,
    }
    raise typer.Exit(run_command(list(command or []), overrides, config, every))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="smartckpt: %(message)s")
    try:
        app()
    except SmartckptError as err:
        err_console.print(f"smartckpt: error: {err}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except OSError as err:
        err_console.print(f"smartckpt: error: {err}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(EXIT_USAGE if isinstance(err, FileNotFoundError | PermissionError) else 1)


if __name__ == "__main__":
    main()
