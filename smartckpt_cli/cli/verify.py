"""``smartckpt verify``: re-hash and decode checkpoints; exit 1 naming each corrupt one."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from smartckpt_cli.cli._shared import (
    MetaDirOpt,
    RemoteOpt,
    StoreArg,
    human,
    open_checkpoints,
    progress_bar,
    say,
)

if TYPE_CHECKING:
    from smartckpt_cli.ops.verify import VerifyReport

__all__ = ["verify"]

# The options as types of their own, so that the command's signature stays one screen with its help.
_StepOpt = Annotated[int | None, typer.Option("--step", help="Verify the checkpoint(s) of this step.")]
_AllOpt = Annotated[bool, typer.Option("--all", help="Verify every live checkpoint.")]
_JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
_WorkersOpt = Annotated[
    int, typer.Option("--workers", min=0, help="Hashing threads (0: one per CPU, at least 4).")
]
_RecordOpt = Annotated[
    bool,
    typer.Option("--record/--no-record", help="Note the outcome in the journal, for inspect."),
]
_RepairOpt = Annotated[
    bool,
    typer.Option(
        "--repair",
        help="Rebuild the journal from the manifests no journal line names (those that verify), "
        "then verify every live checkpoint.",
    ),
]


def verify(
    directory: StoreArg,
    step: _StepOpt = None,
    all_: _AllOpt = False,
    as_json: _JsonOpt = False,
    workers: _WorkersOpt = 0,
    record: _RecordOpt = True,
    repair: _RepairOpt = False,
    meta_dir: MetaDirOpt = None,
    remote: RemoteOpt = None,
) -> None:
    """Re-hash and decode checkpoints; exit 1 naming each corrupt one.

    Checks the newest live checkpoint (or --step N, or --all live ones): every blob is re-hashed
    and every chunk decoded, the manifests are checked against their commits, and the journal
    for torn or damaged lines.

    Prints one line per checkpoint: 'ok', or 'CORRUPT:' and what is wrong (missing blob, hash
    mismatch, undecodable chunk, a manifest that does not match its commit), plus one line per
    torn or damaged journal line. A progress bar is shown on a terminal.

    A checkpoint of several ranks is checked part by part: every rank's part this directory
    holds (all of them on a shared dir). Parts written to another node's disk (node-local dirs)
    are named on the line as not checked here; verify that node's directory too.

    \b
    Examples:
      smartckpt verify ./checkpoints
      smartckpt verify ./checkpoints --all --json
      smartckpt verify ./checkpoints --step 1200 || echo "step 1200 is damaged"
      smartckpt verify ./checkpoints --remote s3://bucket/run1 --all

    With --remote, the same checkpoints (newest, --step or --all) are checked on the remote
    side too: its commit, its manifest and every blob downloaded and re-hashed; one line each,
    prefixed 'remote'.

    A journal that lost lines (emptied, overwritten, damaged in the middle) leaves manifests no
    line names: verify says so in one line and exits 1. With --repair it rebuilds the journal
    from those that verify completely (the old journal is kept beside it, nothing is removed),
    then checks every live checkpoint. It refuses while a run writes the store.

    \b
    Exit codes:
      0  every checked checkpoint is sound (or there is none)
      1  a checkpoint is corrupt (locally or remotely), the journal has a
         torn/damaged line, the remote is unreachable, or DIR holds run
         records of smartckpt run but no checkpoint
      2  bad input: not a store, no such step, --step with --all
    """
    report, all_ = _verify_here(directory, meta_dir, step, all_, workers, record=record, repair=repair)
    remote_results = None if remote is None else _verify_remote(remote, step, all_, workers)
    remote_ok = remote_results is None or remote_results.ok
    if as_json:
        typer.echo(json.dumps(_report_json(report, remote_results), indent=2))
    else:
        _say_report(report, remote_results)
    raise typer.Exit(0 if report.ok and remote_ok else 1)


def _verify_here(
    directory: str,
    meta_dir: Path | None,
    step: int | None,
    all_: bool,
    workers: int,
    *,
    record: bool,
    repair: bool,
) -> tuple[VerifyReport, bool]:
    """The local store verified (after --repair, when asked) and the outcome recorded; returns
    the report and whether every live checkpoint was checked (--repair implies --all)."""
    from smartckpt_cli.errors import UsageError
    from smartckpt_cli.ops.verify import record_results
    from smartckpt_cli.ops.verify import verify as run_verify
    from smartckpt_cli.store.storage import is_url

    if step is not None and all_:
        raise UsageError("--step and --all exclude each other")
    if repair and step is not None:
        raise UsageError("--repair checks every live checkpoint: no --step")
    if repair and is_url(directory):
        raise UsageError("--repair rebuilds the journal of a store in directories, not at a URL")
    if repair:
        _repair(_open_for_repair(Path(directory), meta_dir), workers)
        all_ = True
    store = open_checkpoints(directory, meta_dir)
    with progress_bar("verifying") as progress:
        report = run_verify(store, step=step, all_checkpoints=all_, workers=workers, progress=progress)
    if record and store.url is None:  # nothing is written into a store named by a URL
        record_results(store, report)
    return report, all_


def _verify_remote(url: str, step: int | None, all_: bool, workers: int) -> VerifyReport:
    """The same checkpoints checked on the replica, by the same code as here (its commits,
    manifests, every blob re-hashed and decoded)."""
    from smartckpt_cli.ops.verify import verify as run_verify
    from smartckpt_cli.remote.check import reach

    return run_verify(reach(url), step=step, all_checkpoints=all_, workers=max(workers, 4))


def _results_json(report: VerifyReport) -> list[dict[str, object]]:
    return [{k: v for k, v in r.__dict__.items() if k != "problem"} for r in report.results]


def _report_json(report: VerifyReport, remote: VerifyReport | None) -> dict[str, object]:
    return {
        "ok": report.ok,
        "results": _results_json(report),
        "journal_problems": report.journal_problems,
        "unjournalled": report.unjournalled,
        "bytes_checked": report.bytes_checked,
        "seconds": round(report.seconds, 3),
        "remote": None
        if remote is None
        else {"ok": remote.ok, "results": _results_json(remote), "journal_problems": remote.journal_problems},
    }


def _say_report(report: VerifyReport, remote: VerifyReport | None) -> None:
    """One line per checkpoint checked, locally then remotely, and each journal problem."""
    for r in report.results:
        # Plain lines, never wrapped: operators grep them for blob ids.
        state = r.note if r.note else "ok" if r.ok else f"CORRUPT: {r.problem}"
        say(f"step {r.step} ({r.id}): {state}{_parts_said(r.ranks_checked, r.ranks_elsewhere)}")
    for p in report.journal_problems:
        say(f"journal: {p}")
    for line in report.unjournalled:
        say(line)
    for rr in remote.results if remote is not None else []:
        say(f"remote step {rr.step} ({rr.id}): " + ("ok" if rr.ok else f"CORRUPT: {rr.problem}"))
    for p in remote.journal_problems if remote is not None else []:
        say(f"remote journal: {p}")
    if remote is not None and not remote.results:
        say("remote: no checkpoint to verify")
    if not report.results and not report.unjournalled:
        say("no checkpoint to verify")
    elif report.seconds > 0 and sys.stderr.isatty():
        rate = report.bytes_checked / report.seconds
        say(
            f"checked {human(report.bytes_checked)} in {report.seconds:.2f} s ({human(rate)}/s)",
            error=True,
        )


def _open_for_repair(directory: Path, meta_dir: Path | None) -> object:
    """The store even without its journal (what --repair rebuilds); the directories must exist."""
    from smartckpt_cli.errors import StoreNotFoundError
    from smartckpt_cli.store.directory import open_store

    for path in (directory, meta_dir if meta_dir is not None else directory):
        if not path.is_dir():
            raise StoreNotFoundError(f"{path} is not a directory")
    return open_store(directory, meta_dir, create=True)


def _repair(store: object, workers: int) -> None:
    """Rebuild the journal (ops/repair.py) and say what it did, one line each."""
    from smartckpt_cli.ops.repair import repair
    from smartckpt_cli.store.directory import StoreDir

    assert isinstance(store, StoreDir)
    with progress_bar("verifying manifests without a journal line") as progress:
        done = repair(store, workers=workers, progress=progress)
    if done.nothing:
        say("repair: every manifest has its journal line; nothing to repair")
    for line in done.refused:
        say(f"repair: {line}")
    if done.rebuilt:
        steps = ", ".join(map(str, done.rebuilt))
        kept = f"; the old journal is kept as {store.meta_root / done.backup}" if done.backup else ""
        say(f"repair: journal rebuilt with {len(done.rebuilt)} checkpoint(s) put back (steps {steps}){kept}")


def _parts_said(checked: list[int], elsewhere: list[int]) -> str:
    """What of a multi-rank checkpoint was checked from this directory ('' for one process)."""
    if not elsewhere:
        return f" ({len(checked)} ranks' parts)" if len(checked) > 1 else ""
    ranks = ", ".join(map(str, elsewhere))
    mine = ", ".join(map(str, checked)) or "none"
    return (
        f" (parts checked here: rank {mine}; rank {ranks} wrote to another disk: "
        "verify that node's directory with the same --meta-dir)"
    )
