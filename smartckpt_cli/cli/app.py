"""``smartckpt``: the typer app. Commands are thin; domain errors become one line and an exit code.

Exit codes: 0 success, 1 the operation failed (a corrupt or missing checkpoint), 2 bad input
(a missing directory, not a checkpoint store, a bad option or setting).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from smartckpt_cli.cli import (
    completions,
    config_cmd,
    export,
    inspect_cmd,
    plot,
    prune,
    rollback,
    simulate_cmd,
    verify,
)
from smartckpt_cli.errors import EXIT_USAGE, SmartckptError

try:  # typer vendors click from 0.2x on; before, it is click itself
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover - an older typer
    from click import exceptions as _click_errors  # type: ignore[no-redef]

UsageError = _click_errors.UsageError
NoArgsIsHelp = getattr(_click_errors, "NoArgsIsHelpError", None)  # click 8.2 on

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


def _version(value: bool) -> None:
    if value:
        from smartckpt_cli.version import __version__

        console.print(f"smartckpt {__version__}", markup=False, highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Adaptive, tiered, verified checkpointing for PyTorch training."""


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
app.command("plot")(plot.plot)
app.add_typer(config_cmd.config_app, name="config")
app.command("completions")(completions.completions)


# `smartckpt bench`'s options, in the order its help lists them.
_BenchDevice = Annotated[
    str | None, typer.Option(help="cpu or cuda (default: cuda when torch sees a GPU, else cpu).")
]
_BenchParams = Annotated[
    float | None,
    typer.Option(help="Model size in parameters (default 1e8 on cpu, 4e8 = ~5 GB of state on cuda)."),
]
_BenchReps = Annotated[int, typer.Option(min=1, help="Repetitions of the one-save-at-a-time part.")]
_BenchEvery = Annotated[
    float, typer.Option(min=0.01, help="Throughput part: seconds of training between saves.")
]
_BenchRounds = Annotated[
    int, typer.Option(min=0, help="Throughput part: rotated rounds of all contenders (0: skip it).")
]
_BenchBatch = Annotated[
    int | None, typer.Option(min=1, help="Training batch (default 8 on cpu, 4096 on cuda).")
]
_BenchPrecision = Annotated[str, typer.Option(help="exact, bf16 or fp16 for smartckpt's moments.")]
_BenchLevel = Annotated[int, typer.Option(help="zstd level for smartckpt (-1: raw).")]
_BenchWorkers = Annotated[int, typer.Option(help="Encoder threads (0: min(8, 2 x CPUs)).")]
_BenchWorkdir = Annotated[Path | None, typer.Option(help="Where to write (default: the temp dir).")]
_BenchJson = Annotated[
    Path | None,
    typer.Option("--json", help="Also write the results to this file (updated after each part)."),
]


@app.command()
def bench(
    device: _BenchDevice = None,
    params: _BenchParams = None,
    reps: _BenchReps = 3,
    every: _BenchEvery = 10.0,
    rounds: _BenchRounds = 2,
    batch: _BenchBatch = None,
    precision: _BenchPrecision = "exact",
    level: _BenchLevel = 1,
    workers: _BenchWorkers = 0,
    workdir: _BenchWorkdir = None,
    as_json: _BenchJson = None,
) -> None:
    """Measure smartckpt against torch.save, torch.distributed.checkpoint and the machine's bounds:
    the first save, training throughput with a save every --every seconds, and each save alone.

    Example: smartckpt bench --device cuda --reps 1 --json bench.json
    """
    from smartckpt_cli.bench.run import run_bench
    from smartckpt_cli.cli.bench_view import render

    write = _bench_writer(as_json, shlex.join(["smartckpt", *sys.argv[1:]]))
    # SIGTERM (a time limit's `timeout`) ends the bench through its cleanup, which removes the
    # checkpoints it wrote, instead of leaving them in the work directory.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    started = time.monotonic()
    live = console.is_terminal  # a spinner on a terminal; in a log (the GPU check), one line per part
    with console.status("benchmarking") if live else contextlib.nullcontext() as status:
        result = run_bench(
            int(params) if params else None,
            device=device,
            reps=reps,
            every=every,
            rounds=rounds,
            batch=batch,
            workdir=workdir,
            precision=precision,
            compression_level=level,
            workers=workers,
            progress=lambda m: _bench_say(status, started, m),
            on_update=write,
        )
    render(result, console)
    write(result)
    if as_json is not None:
        console.print(f"results written to {as_json}")


def _bench_writer(as_json: Path | None, command: str) -> Callable[[Any], None]:
    def write(result: Any) -> None:
        # Rewritten after every part, so a bench cut short (a time limit) keeps what it measured.
        if as_json is not None:
            result.record(command).write(as_json)

    return write


def _bench_say(status: Any, started: float, msg: str) -> None:
    if status is not None:
        status.update(msg)
    else:
        console.print(f"bench: {time.monotonic() - started:6.1f} s  {msg}", highlight=False)


app.command("simulate")(simulate_cmd.simulate)


# `smartckpt run`'s options, in the order its help lists them.
_RunCommand = Annotated[list[str] | None, typer.Argument(help="train.py [ARGS], or -- CMD [ARGS].")]
_RunDir = Annotated[str | None, typer.Option("--dir", help="Checkpoint store (default ./checkpoints).")]
_RunEvery = Annotated[
    str | None,
    typer.Option(help="Fixed schedule instead of the trigger: steps (50) or a duration (30s)."),
]
_RunMaxRestarts = Annotated[int | None, typer.Option(help="Restarts before giving up (default 5).")]
_RunHangTimeout = Annotated[
    float | None, typer.Option(help="Seconds without a step that count as a hang (default: learned).")
]
_RunRequeue = Annotated[
    bool | None, typer.Option("--requeue/--no-requeue", help="Requeue the SLURM job after USR1/USR2.")
]
_RunConfig = Annotated[
    Path | None,
    typer.Option(envvar="SMARTCKPT_CONFIG", help="YAML settings file (default ./smartckpt.yaml)."),
]
_RunRemote = Annotated[
    str | None,
    typer.Option(
        help="Replicate committed checkpoints here (s3://bucket/prefix, file:///path) and restore from it."
    ),
]
_RunRemoteStartWait = Annotated[
    float | None,
    typer.Option(
        help="Seconds to wait for an unreachable remote when nothing is local to resume (default 300)."
    ),
]
_RunRemoteStartFresh = Annotated[
    bool | None,
    typer.Option(
        "--remote-start-fresh/--no-remote-start-fresh",
        help="With nothing local and the remote unreachable: start a new store at step 0 at once.",
    ),
]
_RunRamEvery = Annotated[
    float | None,
    typer.Option(
        help="Seconds between snapshots kept in shared memory for a fast restart (default: as often as 2 % of the step time allows)."
    ),
]
_RunWarmRestart = Annotated[
    bool | None,
    typer.Option(
        "--warm-restart/--no-warm-restart",
        help="Keep a spare interpreter with torch imported for the next restart (default on).",
    ),
]
_RunResumeFinished = Annotated[
    bool,
    typer.Option(
        "--resume-finished",
        help="Start the command even when its last run in --dir finished (it trains on from the final checkpoint).",
    ),
]


@app.command(
    "run",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def run_cmd(
    command: _RunCommand = None,
    dir: _RunDir = None,
    every: _RunEvery = None,
    max_restarts: _RunMaxRestarts = None,
    hang_timeout: _RunHangTimeout = None,
    requeue: _RunRequeue = None,
    config: _RunConfig = None,
    remote: _RunRemote = None,
    remote_start_wait: _RunRemoteStartWait = None,
    remote_start_fresh: _RunRemoteStartFresh = None,
    ram_every: _RunRamEvery = None,
    warm_restart: _RunWarmRestart = None,
    resume_finished: _RunResumeFinished = False,
) -> None:
    """Run a training script under smartckpt: checkpoints without code changes, restarts after
    crashes from the newest verified checkpoint.

    \b
      smartckpt run train.py --lr 3e-4     (python train.py, this interpreter)
      smartckpt run --every 30s -- torchrun --nproc_per_node 2 train.py

    Options go before the script; everything from the script (or after --) is the command.
    Each option but --resume-finished can also be set in smartckpt.yaml (--config) or as
    SMARTCKPT_<NAME>. The same command again on a store whose last run finished does nothing
    (exit 0) unless --resume-finished.

    \b
    Exit codes:
      0        training finished (or the job was requeued after a preemption)
      N        the child's own exit code when it is not restarted (SyntaxError,
               ImportError, a failure before the first step, a no_restart_on
               match)
      128+N    stopped by signal N (SIGTERM: 143) that was passed to the child
      2        bad input (a missing script, a bad option or setting)
      3        gave up: max_restarts reached
      4        crash loop: the same failure after a rollback to the previous
               checkpoint
      5        nothing to resume locally and the remote unreachable for
               --remote-start-wait: not started over at step 0
               (--remote-start-fresh does, deliberately)
    """
    from smartckpt_cli.cli.run import run_command

    overrides = {
        "dir": dir,
        "max_restarts": max_restarts,
        "hang_timeout": hang_timeout,
        "requeue": requeue,
        "remote": remote,
        "remote_start_wait": remote_start_wait,
        "remote_start_fresh": remote_start_fresh,
        "ram_every": ram_every,
        "warm_restart": warm_restart,
    }
    raise typer.Exit(
        run_command(list(command or []), overrides, config, every, resume_finished=resume_finished)
    )


def _reflow(doc: str | None) -> str | None:
    """A command's help with each paragraph on one line, for the help to wrap at the terminal's
    width (a docstring's own line breaks, made for the source, cut every line twice at 80
    columns). Blocks marked ``\\b`` and indented blocks (examples) keep their lines."""
    if not doc:
        return doc
    out: list[str] = []
    for block in inspect.cleandoc(doc).split("\n\n"):
        lines = block.split("\n")
        fixed = lines[0].strip() == "\b" or any(ln.startswith(" ") for ln in lines)
        out.append(block if fixed else " ".join(ln.strip() for ln in lines))
    return "\n\n".join(out)


def _reflow_all(typer_app: typer.Typer) -> None:
    for info in typer_app.registered_commands:
        if info.callback is not None:
            info.callback.__doc__ = _reflow(info.callback.__doc__)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _reflow_all(group.typer_instance)
    callback = typer_app.registered_callback
    if callback is not None and callback.callback is not None:
        callback.callback.__doc__ = _reflow(callback.callback.__doc__)


_reflow_all(app)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="smartckpt: %(message)s")
    # Each command reports the journal's damaged lines itself (in its table, its error line);
    # the journal's own warning is for training processes and would say it twice.
    journal_log = logging.getLogger("smartckpt_cli.store.journal")
    level = journal_log.level
    journal_log.setLevel(logging.ERROR)
    try:
        _run()
    finally:
        journal_log.setLevel(level)  # main() may run inside a longer-lived process (tests)


def _run() -> None:
    try:
        # usage errors come here: one line, not click's box
        code = app(standalone_mode=False, prog_name="smartckpt")
    except UsageError as err:
        if NoArgsIsHelp is not None and isinstance(err, NoArgsIsHelp) and err.ctx is not None:
            console.print(err.ctx.get_help(), markup=False, highlight=False)
            sys.exit(EXIT_USAGE)
        where = f" ({err.ctx.command_path} -h)" if err.ctx is not None else " (smartckpt -h)"
        line = " ".join(err.format_message().split())
        err_console.print(f"smartckpt: error: {line}{where}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(EXIT_USAGE)
    except SmartckptError as err:
        err_console.print(f"smartckpt: error: {err}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except ImportError as err:
        # export, demo and bench need torch; every other command runs without it.
        if err.name != "torch" and "torch" not in str(err):
            raise
        err_console.print(
            f"smartckpt: error: this command needs PyTorch, which does not import here ({err}); "
            "install torch for this Python",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(EXIT_USAGE)
    except OSError as err:
        err_console.print(f"smartckpt: error: {err}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(EXIT_USAGE if isinstance(err, FileNotFoundError | PermissionError) else 1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
